"""An S3 test server behind a slow link: moto's S3 server on loopback, and a proxy in front
of it that adds a latency to every request and paces each response body at a bandwidth.

Benches that move data through S3 (bench/unit_data.py, bench/server_round.py) point their
store and their presigned URLs at the proxy, so every GET and PUT pays what a real store
costs: `latency_s` before the answer starts, then `bandwidth` bytes per second for its body
(per request: S3 serves each connection at about this rate). Moto checks no signatures and
no sizes; nothing here relies on it for security.
"""

from __future__ import annotations

import http.client
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BLOCK = 256 * 1024  # bytes paced at once


class SlowLink:
    """moto's S3 server and a pacing proxy to it, both on loopback; `endpoint_url` is the
    proxy's. Counts requests and bytes through the proxy."""

    def __init__(self, latency_s: float, bandwidth: float) -> None:
        from moto.server import ThreadedMotoServer

        self.latency_s, self.bandwidth = latency_s, bandwidth
        self.requests, self.bytes_out, self.bytes_in = 0, 0, 0
        self._lock = threading.Lock()
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        link = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                started = time.perf_counter()
                upstream = http.client.HTTPConnection(host, port, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                upstream.close()
                sent = len(data) + (length or 0)
                with link._lock:
                    link.requests += 1
                    link.bytes_out += len(data)
                    link.bytes_in += length
                # the request's latency, then its bytes at the link's pace
                wait = link.latency_s + sent / link.bandwidth - (time.perf_counter() - started)
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    time.sleep(max(0.0, wait))
                    return
                step = BLOCK / link.bandwidth
                head = max(0.0, wait - len(data) / link.bandwidth)
                time.sleep(head)
                for at in range(0, len(data), BLOCK):
                    self.wfile.write(data[at : at + BLOCK])
                    time.sleep(step * min(1.0, (len(data) - at) / BLOCK))

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.proxy.daemon_threads = True
        self._thread = threading.Thread(target=self.proxy.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self.proxy.server_address[1]}"
        self.moto_url = f"http://{host}:{port}"

    def counters(self) -> tuple[int, int, int]:
        with self._lock:
            return self.requests, self.bytes_out, self.bytes_in

    def bucket(self, store_kwargs: dict[str, Any] | None = None) -> Any:
        """A new bucket and an S3BlobStore on it through the link (the server's modules
        load after django.setup())."""
        import boto3

        from dipaco_server.storage.s3 import S3BlobStore

        name = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3", endpoint_url=self.moto_url, aws_access_key_id="bench",
            aws_secret_access_key="bench", region_name="us-east-1",
        ).create_bucket(Bucket=name)  # fmt: skip
        return S3BlobStore(
            bucket=name, endpoint_url=self.endpoint_url, access_key_id="bench",
            secret_access_key="bench", region="us-east-1", **(store_kwargs or {}),
        )  # fmt: skip

    def close(self) -> None:
        self.proxy.shutdown()
        self.moto.stop()
