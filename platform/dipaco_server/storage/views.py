"""The /blobs/ views that make a LocalBlobStore behave like presigned S3.

GET streams the blob; PUT takes a raw body; POST takes an S3-style form
upload (a ``file`` field). Each request must carry a signature for its own
method and key (signing.py). Uploads are counted while they stream, and a
body over the URL's ``max_bytes`` is refused with 413 however it declares
its length. Every refusal is JSON ``{"error": {"code", "message"}}`` with a
4xx status; nothing a client sends can make these views answer 500.
"""

from __future__ import annotations

import logging
from typing import BinaryIO

from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from dipaco_server.errors import error_response as error

from . import signing
from .factory import get_blob_store
from .keys import BlobNotFound, BlobStoreError, InvalidBlobKey
from .local import LocalBlobStore
from .uploads import BlobTooLarge, BodyRefused, copy_limited, form_upload_handler

log = logging.getLogger(__name__)

# Room for the multipart boundaries and headers around a POST's file field.
FORM_OVERHEAD_BYTES = 64 * 1024


@csrf_exempt  # authorised by the URL's signature, not by a session
def blob(request: HttpRequest, key: str) -> HttpResponse:
    method = request.method or ""
    if method not in signing.SIGNED_METHODS:
        response = error(
            405, "method_not_allowed", f"{method} is not supported; use GET, PUT or POST"
        )
        response["Allow"] = ", ".join(signing.SIGNED_METHODS)
        return response
    store = get_blob_store()
    if not isinstance(store, LocalBlobStore):
        return error(
            404, "not_served", "blobs live in S3 here; presigned URLs point at it directly"
        )
    try:
        store.path_for(key)  # refuse bad keys before anything else
        max_bytes = store.authorise(method, key, request.GET.dict())
        if method == "GET":
            return FileResponse(store.open(key), content_type="application/octet-stream")
        assert max_bytes is not None  # verify() requires it for uploads
        if method == "PUT":
            size = _receive_put(request, store, key, max_bytes)
            return JsonResponse({"key": key, "size": size}, status=200)
        _receive_post(request, store, key, max_bytes)
        return HttpResponse(status=204)  # S3's default success_action_status
    except InvalidBlobKey as exc:
        return error(400, "invalid_key", str(exc))
    except signing.UrlRefused as exc:
        return error(403, exc.code, exc.message)
    except BlobNotFound:
        return error(404, "blob_not_found", f"no blob under key {key!r}")
    except (BlobTooLarge, RequestDataTooBig) as exc:
        return error(413, "blob_too_large", str(exc))
    except BodyRefused as exc:
        return error(exc.status, exc.code, str(exc))
    except (MultiPartParserError, SuspiciousOperation) as exc:
        return error(400, "bad_form", f"the upload form could not be read: {exc}")
    except BlobStoreError as exc:
        log.warning("blob %s refused: %s", key, exc)
        return error(409, "blob_conflict", str(exc))


def _receive_put(request: HttpRequest, store: LocalBlobStore, key: str, max_bytes: int) -> int:
    declared = _declared_length(request)
    if declared is None:
        raise BodyRefused(411, "length_required", "a PUT needs a Content-Length header")
    if declared > max_bytes:
        raise BlobTooLarge(f"the body is {declared} bytes; this URL allows at most {max_bytes}")
    with store.writer(key) as out:
        return copy_limited(request, out, max_bytes, expected=declared)


def _receive_post(request: HttpRequest, store: LocalBlobStore, key: str, max_bytes: int) -> None:
    if request.content_type != "multipart/form-data":
        raise BodyRefused(400, "bad_form", "POST a multipart/form-data form with a 'file' field")
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes + FORM_OVERHEAD_BYTES:
        raise BlobTooLarge(f"the form is {declared} bytes; this URL allows a {max_bytes}-byte file")
    out: BinaryIO
    with store.writer(key) as out:
        handler = form_upload_handler(request, out, max_bytes)
        request.upload_handlers = [handler]
        request.POST  # noqa: B018 -- parsing streams the file through the handler
        if not handler.received:
            raise BodyRefused(400, "missing_file", "the form has no 'file' field")


def _declared_length(request: HttpRequest) -> int | None:
    raw = request.META.get("CONTENT_LENGTH") or ""
    if not raw.isdigit():
        return None
    return int(raw)
