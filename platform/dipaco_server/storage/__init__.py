"""Blob stores: one interface (base.BlobStore), an S3 backend and a local-directory backend.

Use `get_blob_store()` (factory.py) to get the configured one; see base.py for the shared
semantics and keys.py for which keys are accepted.
"""

from .base import BlobStore, PresignedPost
from .factory import build_blob_store, get_blob_store
from .keys import BlobNotFound, BlobStoreError, InvalidBlobKey, validate_key, validate_prefix

__all__ = [
    "BlobNotFound",
    "BlobStore",
    "BlobStoreError",
    "InvalidBlobKey",
    "PresignedPost",
    "build_blob_store",
    "get_blob_store",
    "validate_key",
    "validate_prefix",
]
