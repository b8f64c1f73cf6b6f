"""The factory that builds the configured blob store from settings, one per configuration."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .base import BlobStore
from .local import LocalBlobStore

__all__ = ["build_blob_store", "get_blob_store"]


def get_blob_store() -> BlobStore:
    """The store named by `settings.DIPACO_BLOB_STORE` (cached per configuration)."""
    config = settings.DIPACO_BLOB_STORE
    public_url = getattr(settings, "DIPACO_PUBLIC_URL", "http://127.0.0.1:8000")
    frozen = tuple(sorted((str(k), str(v)) for k, v in config.items()))
    cache_key = (frozen, public_url, settings.SECRET_KEY)
    store = _STORES.get(cache_key)
    if store is None:
        store = build_blob_store(config, public_url=public_url, secret=settings.SECRET_KEY)
        _STORES.clear()  # a new configuration (tests override settings); drop the old ones
        _STORES[cache_key] = store
    return store


_STORES: dict[object, BlobStore] = {}


def build_blob_store(config: dict[str, object], *, public_url: str, secret: str) -> BlobStore:
    """Build a store from a DIPACO_BLOB_STORE-shaped dict (see settings)."""
    backend = config.get("backend")
    if backend == "local":
        return LocalBlobStore(Path(str(config["root"])), public_url=public_url, secret=secret)
    if backend == "s3":
        from .s3 import S3BlobStore  # boto3 (~0.2 s to import) only where s3 is configured

        missing = [k for k in ("bucket",) if not config.get(k)]
        if missing:
            raise ImproperlyConfigured(f"DIPACO_BLOB_STORE for s3 needs {', '.join(missing)}")
        return S3BlobStore.from_config(config)
    raise ImproperlyConfigured(
        f"DIPACO_BLOB_STORE backend is {backend!r}; use 'local' (a directory) or 's3'"
    )
