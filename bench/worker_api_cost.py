"""Server CPU per worker-API request, in one process (Django's test client, no HTTP).

    .venv/bin/python bench/worker_api_cost.py --workers 300

Seeds a running run on a fresh PostgreSQL database (as bench/control_plane.py does) and
sends every kind of worker request once per worker: heartbeat without and with a lease,
lease (a grant, then with nothing queued: 204), upload-urls and complete. Prints, per
kind, wall and process-CPU milliseconds per request and SQL queries per request. What
the control plane's load (bench/control_plane.py) is made of, without a network or a
client in the way; run it before and after a change to the worker API. `--profile KIND`
prints cProfile's top functions for one kind.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "platform")]

import control_plane as cp  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=300, help="workers (one unit each)")
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/12", help="flushed")
    parser.add_argument("--profile", metavar="KIND", help="cProfile one kind, e.g. heartbeat+lease")
    args = parser.parse_args()
    import redis

    name = f"dipaco_cost_{os.getpid()}"
    database = cp.create_database(args.postgres, name)
    redis.Redis.from_url(args.redis).flushdb()
    work = Path(tempfile.mkdtemp(prefix="dipaco-cost-"))
    # The local blob store under the data dir (no S3 variables), the server's defaults.
    defaults = argparse.Namespace(db_pool="off", grant_rate=None, shed_after=None)
    environ = cp.server_environ(database, args.redis, work / "data", "http://x", {}, defaults)
    os.environ.update(environ)
    try:
        subprocess.run([sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
                       env=os.environ, check=True)  # fmt: skip
        from dipaco_server.cli.admin import setup_django

        setup_django()
        import logging

        logging.getLogger("dipaco_server").setLevel(logging.WARNING)
        (work / "seed").mkdir()
        _, tokens, _ = cp.seed(args.workers, args.workers, 4, work / "seed")
        measure(tokens, args.profile)
    finally:
        from django.db import connections

        connections.close_all()
        cp.drop_database(args.postgres, name)
        redis.Redis.from_url(args.redis).flushdb()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def measure(tokens: list[str], profile: str | None) -> None:
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from dipaco_server.storage import get_blob_store

    client = Client(HTTP_HOST="127.0.0.1")
    print(f"{'kind':<18}{'requests':>9}{'wall ms':>9}{'CPU ms':>9}{'queries':>9}")

    def timed(kind: str, calls: list[Callable[[], Any]]) -> list[Any]:
        profiler = cProfile.Profile() if profile == kind else None
        connection.queries_log.clear()  # the log keeps 9,000 queries; count from empty
        wall, cpu = time.perf_counter(), time.process_time()
        with CaptureQueriesContext(connection) as queries:
            if profiler:
                profiler.enable()
            out = [call() for call in calls]
            if profiler:
                profiler.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        n = len(calls)
        print(f"{kind:<18}{n:>9}{1e3 * wall / n:>9.2f}{1e3 * cpu / n:>9.2f}"
              f"{len(queries.captured_queries) / n:>9.1f}")  # fmt: skip
        if profiler:
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        bad = [r.status_code for r in out if r.status_code >= 300 and r.status_code != 204]
        if bad:
            raise SystemExit(f"{kind}: unexpected answers {sorted(set(bad))}")
        return out

    def auth(token: str, secret: str | None = None) -> dict[str, str]:
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
        return {**headers, "HTTP_X_LEASE_SECRET": secret} if secret else headers

    def post(url: str, token: str, secret: str | None = None, body: Any = None) -> Any:
        return client.post(url, body, content_type="application/json", **auth(token, secret))

    api = "/api/v1/worker"
    post(f"{api}/heartbeat", tokens[0], body={})  # warm-up: URL resolvers, first imports
    timed("heartbeat", [lambda t=t: post(f"{api}/heartbeat", t, body={}) for t in tokens])
    answers = timed("lease (grant)", [lambda t=t: post(f"{api}/lease", t) for t in tokens])
    leases = [a.json() for a in answers]
    pairs = list(zip(tokens, leases, strict=True))
    timed("heartbeat+lease", [lambda t=t, g=g: post(
        f"{api}/heartbeat", t, g["lease_secret"], {"lease_id": g["lease_id"]}) for t, g in pairs])  # fmt: skip
    urls = timed("upload-urls", [lambda t=t, g=g: post(
        f"{api}/lease/{g['lease_id']}/upload-urls", t, g["lease_secret"]) for t, g in pairs])  # fmt: skip
    payload = b"x" * 4096  # the completion does not read it (the outer step does)
    digest, store = hashlib.sha256(payload).hexdigest(), get_blob_store()
    for answer in urls:  # what the PUTs to the presigned URLs would leave
        for upload in answer.json()["uploads"]:
            store.put_bytes(upload["key"], payload)

    def complete(token: str, grant: dict[str, Any], answer: Any) -> Any:
        body = {"contributions": [{"module_id": u["module_id"], "sha256": digest,
                                   "size": len(payload)} for u in answer.json()["uploads"]],
                "tokens": cp.trained_tokens(grant), "metrics": {"loss": 1.0}}  # fmt: skip
        return post(f"{api}/lease/{grant['lease_id']}/complete", token, grant["lease_secret"], body)

    timed("complete", [lambda t=t, g=g, a=a: complete(t, g, a)
                       for (t, g), a in zip(pairs, urls, strict=True)])  # fmt: skip
    timed("lease (204)", [lambda t=t: post(f"{api}/lease", t) for t in tokens])


if __name__ == "__main__":
    sys.exit(main())
