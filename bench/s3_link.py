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
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BLOCK = 256 * 1024  # bytes paced at once


def serve(latency_s: float, bandwidth: float) -> None:
    """moto and the pacing proxy in this process; prints the proxy's URL, then serves."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    stats = {"requests": 0, "bytes_out": 0, "bytes_in": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _forward(self) -> None:
            if self.path == "/__stats":
                with lock:
                    body = json.dumps(stats).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            started = time.perf_counter()
            upstream = http.client.HTTPConnection(host, port, timeout=600)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
            upstream.close()
            with lock:
                stats["requests"] += 1
                stats["bytes_out"] += len(data)
                stats["bytes_in"] += length
            # the request's latency, then its bytes at the link's pace
            wait = latency_s + (len(data) + length) / bandwidth
            wait -= time.perf_counter() - started
            self.send_response(answer.status)
            skip: tuple[str, ...] = ("transfer-encoding", "connection")
            if self.command != "HEAD":  # a HEAD's length is the object's, as upstream says
                skip += ("content-length",)
                self.send_header("Content-Length", str(len(data)))
            for k, v in answer.getheaders():
                if k.lower() not in skip:
                    self.send_header(k, v)
            self.end_headers()
            # What moto itself took counts against the link's time: the head waits out the
            # rest of the latency, the body the rest of its transfer time.
            body_s = len(data) / bandwidth
            time.sleep(max(0.0, wait - body_s))
            step = BLOCK / bandwidth * min(1.0, max(0.0, wait) / body_s) if body_s else 0.0
            try:
                for at in range(0, len(data), BLOCK):
                    self.wfile.write(data[at : at + BLOCK])
                    time.sleep(step * min(1.0, (len(data) - at) / BLOCK))
            except ConnectionError:  # the client gave up (a prefetch cancelled): not an error
                self.close_connection = True

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    proxy.daemon_threads = True
    print(f"http://127.0.0.1:{proxy.server_address[1]} http://{host}:{port}", flush=True)
    proxy.serve_forever()


class SlowLink:
    """moto's S3 server and a pacing proxy to it, on loopback in a process of their own (so
    the bench's CPU seconds are its own); `endpoint_url` is the proxy's. `counters()`:
    requests and bytes through the proxy so far."""

    def __init__(self, latency_s: float, bandwidth: float) -> None:
        self.latency_s, self.bandwidth = latency_s, bandwidth
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(latency_s), str(bandwidth)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        if len(line) != 2:
            self.process.kill()
            raise RuntimeError("the S3 test server did not start (is moto[server] installed?)")
        self.endpoint_url, self.moto_url = line

    def counters(self) -> tuple[int, int, int]:
        with urllib.request.urlopen(f"{self.endpoint_url}/__stats", timeout=30) as answer:
            stats = json.loads(answer.read())
        return stats["requests"], stats["bytes_out"], stats["bytes_in"]

    def create_bucket(self) -> str:
        """A new bucket's name (S3_BUCKET for a server whose S3_ENDPOINT_URL is the link)."""
        import boto3

        name = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3", endpoint_url=self.moto_url, aws_access_key_id="bench",
            aws_secret_access_key="bench", region_name="us-east-1",
        ).create_bucket(Bucket=name)  # fmt: skip
        return name

    def environ(self, bucket: str) -> dict[str, str]:
        """The S3_* variables that point a server at `bucket` through the link."""
        return {
            "S3_ENDPOINT_URL": self.endpoint_url, "S3_BUCKET": bucket,
            "S3_ACCESS_KEY_ID": "bench", "S3_SECRET_ACCESS_KEY": "bench",
            "S3_REGION": "us-east-1",
        }  # fmt: skip

    def bucket(self, store_kwargs: dict[str, Any] | None = None) -> Any:
        """A new bucket and an S3BlobStore on it through the link (the server's modules
        load after django.setup())."""
        from dipaco_server.storage.s3 import S3BlobStore

        name = self.create_bucket()
        return S3BlobStore(
            bucket=name, endpoint_url=self.endpoint_url, access_key_id="bench",
            secret_access_key="bench", region="us-east-1", **(store_kwargs or {}),
        )  # fmt: skip

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    serve(float(sys.argv[1]), float(sys.argv[2]))
