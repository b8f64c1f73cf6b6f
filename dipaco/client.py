"""The HTTP client of a dipaco server's public API: manifests, verified path downloads.

The library's one module that speaks HTTP (httpx), for ``dipaco download``, ``dipaco
route``, ``dipaco generate`` and ``dipaco.load_path``; it needs no Django. A path
download reads the path's manifest, fetches the small files and the path's module blobs
in parallel (each checked against its sha256), assembles model.safetensors locally with
the library, and checks that against the server's sha256 too (on a mismatch it logs why
and fetches the server's copy instead). A file already there with the right sha256 is
kept, so a second call after an interruption fetches only what is missing. Transient
failures are retried under dipaco.retry's one policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from dipaco.config import RunConfig
from dipaco.inference import MODEL_FILE, RUN_FILE, open_path_dir, sha256_file, write_model_file
from dipaco.retry import Backoff, retry

DEFAULT_SERVER = "http://127.0.0.1:8000"
# Transient failures (connection errors, 5xx, 429): 4 tries, waits from 0.5 s doubling.
RETRY = Backoff(attempts=4, initial_s=0.5, multiplier=2.0, max_s=8.0)
TIMEOUT_S = 60.0
CHUNK = 1024 * 1024
Log = Callable[[str], None]
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")  # no separators, no dot-files


class _Transient(Exception):
    """A 5xx or 429 answer: worth another try."""


def _transient(error: BaseException) -> bool:
    return isinstance(error, _Transient | httpx.TransportError)


class DownloadError(Exception):
    """A refusal or failure to show the user as is (the message says what to do)."""


def stderr(message: str) -> None:
    sys.stderr.write(message + "\n")  # one write: download threads log concurrently
    sys.stderr.flush()


class Client:
    """The dipaco server's inference API over httpx: JSON calls and verified file fetches."""

    def __init__(self, server: str, token: str | None = None, *, timeout: float = TIMEOUT_S):
        if urlsplit(server).scheme not in ("http", "https"):
            raise DownloadError(f"--server {server!r}: give a URL such as {DEFAULT_SERVER}")
        self.server = server.rstrip("/") + "/"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(headers=headers, timeout=timeout, follow_redirects=True)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def url(self, path_or_url: str) -> str:
        """Absolute URLs as they are; API paths under the server's URL (which may have a prefix)."""
        return urljoin(
            self.server, path_or_url if "://" in path_or_url else path_or_url.lstrip("/")
        )

    def send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """An open streamed response (close it). Transient failures (connection errors, 5xx,
        429) are retried under dipaco.retry's policy; a 4xx raises DownloadError at once."""

        def once() -> httpx.Response:
            request = self.http.build_request(method, self.url(url), **kwargs)
            response = self.http.send(request, stream=True)
            if response.status_code < 400:
                return response
            response.read()
            response.close()
            if response.status_code < 500 and response.status_code != 429:
                raise DownloadError(_error_message(response))
            raise _Transient(_error_message(response))

        try:
            return retry(once, RETRY, what=f"{method} {self.url(url)}", transient=_transient)
        except (_Transient, httpx.TransportError) as exc:
            problem = str(exc) if isinstance(exc, _Transient) else f"{type(exc).__name__}: {exc}"
            raise DownloadError(
                f"{method} {self.url(url)} failed {RETRY.attempts} times; last: {problem}"
            ) from None

    def get_json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        params = {k: v for k, v in (params or {}).items() if v is not None}
        with closing(self.send("GET", path, params=params)) as response:
            return json.loads(response.read())

    def post_json(self, path: str, body: Any) -> Any:
        with closing(self.send("POST", path, json=body)) as response:
            return json.loads(response.read())

    def fetch(self, url: str, dest: Path, size: int, sha256: str) -> None:
        """Stream `url` into `dest` through a temporary file; refused unless size and sha256
        match. One more try after a broken stream or a mismatch (a file can change on the
        server meanwhile)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        problem = ""
        for _ in range(2):
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
            try:
                digest, written = hashlib.sha256(), 0
                with os.fdopen(fd, "wb") as out, closing(self.send("GET", url)) as response:
                    for chunk in response.iter_bytes(CHUNK):
                        digest.update(chunk)
                        written += len(chunk)
                        out.write(chunk)
                if (written, digest.hexdigest()) == (size, sha256):
                    os.replace(tmp, dest)
                    return
                problem = (
                    f"got {written} bytes with sha256 {digest.hexdigest()[:12]}..., expected "
                    f"{size} bytes with {sha256[:12]}...; the path changed on the server "
                    "while downloading: run the command again"
                )
            except httpx.TransportError as exc:
                problem = f"the transfer broke ({type(exc).__name__}: {exc}); run it again"
            finally:
                Path(tmp).unlink(missing_ok=True)
        raise DownloadError(f"{dest.name}: {problem}")


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"{error['message']} ({response.status_code} {error['code']})"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code} from {response.request.url}"


def verified(path: Path, size: int, sha256: str) -> bool:
    """True when `path` holds exactly the expected bytes (size first: it is free)."""
    return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha256


def fetch_manifest(client: Client, run: int, path: int, round: int | None = None) -> Any:
    return client.get_json(f"/api/v1/runs/{run}/paths/{path}/manifest", {"round": round})


def download_path(
    client: Client,
    manifest: dict[str, Any],
    out: Path,
    *,
    module_dir: Path | None = None,
    jobs: int = 4,
    log: Log = stderr,
) -> Path:
    """Make `out` the manifest's directory; returns `out`.

    `module_dir` keeps the module blobs (a cache shared by paths); by default they go to a
    temporary folder inside `out`, removed once model.safetensors is verified.
    """
    for name in [f["name"] for f in manifest["files"]] + [manifest["folder"]]:
        _check_name(name)
    for m in manifest["modules"]:
        _check_name(m["module_id"])
    out.mkdir(parents=True, exist_ok=True)
    files = {f["name"]: f for f in manifest["files"]}
    model = files[MODEL_FILE]
    todo = [f for f in files.values() if not verified(out / f["name"], f["size"], f["sha256"])]
    need_model = any(f["name"] == MODEL_FILE for f in todo)
    private_modules = module_dir is None
    modules_root = out / ".dipaco-modules" if module_dir is None else module_dir
    fetches: list[tuple[str, Path, int, str]] = [
        (f["url"], out / f["name"], f["size"], f["sha256"]) for f in todo if f is not model
    ]
    if need_model:
        for m in manifest["modules"]:
            dest = modules_root / _module_file(m)
            if not verified(dest, m["size"], m["sha256"]):
                fetches.append((m["url"], dest, m["size"], m["sha256"]))
    plan = _plan_text(files, todo, len(fetches), len(manifest["modules"]) if need_model else 0)
    log(f"{manifest['folder']}: {plan}")

    def fetch(item: tuple[str, Path, int, str]) -> None:
        client.fetch(*item)
        log(f"  fetched {item[1].name} ({item[2]:,} bytes, sha256 verified)")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(fetch, fetches))  # list(): re-raises the first error
    if need_model:
        _assemble(manifest, out, modules_root, model, client, log)
    if private_modules:
        shutil.rmtree(modules_root, ignore_errors=True)
    log(f"{out}: ready")
    return out


def _plan_text(files: dict[str, Any], todo: list[Any], fetches: int, modules: int) -> str:
    """What the download will do, in counts that add up: the directory's files already
    there, the files to fetch, and model.safetensors built from module blobs (which are
    fetched too, unless cached): "0 of 8 files already there; 7 to fetch, and
    model.safetensors to assemble from 3 module blobs (3 to fetch)". `modules` is 0 when
    model.safetensors is already there."""
    kept = len(files) - len(todo)
    file_fetches = len(todo) - (1 if modules else 0)
    text = f"{kept} of {len(files)} files already there; {file_fetches} to fetch"
    if modules:
        blobs = fetches - file_fetches
        text += f", and {MODEL_FILE} to assemble from {modules} module blobs ({blobs} to fetch)"
    return text


def _check_name(name: object) -> None:
    """Names in a manifest become local file names: refuse anything but a plain name."""
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name):
        raise DownloadError(f"the server's manifest names a file {name!r}; refusing it")


def _module_file(module: dict[str, Any]) -> str:
    return f"{module['module_id']}-v{module['version']}-{module['sha256'][:16]}.safetensors"


def _assemble(
    manifest: dict[str, Any],
    out: Path,
    modules_root: Path,
    model: dict[str, Any],
    client: Client,
    log: Log,
) -> None:
    """model.safetensors from the module blobs, as the server builds it; the server's copy
    when this dipaco builds other bytes (another version on either side)."""
    from dipaco.modules_file import load_module_file  # torch: `dipaco download` starts without it

    staged = out / f".{MODEL_FILE}.assembled"
    try:
        facts = json.loads((out / RUN_FILE).read_text("utf-8"))
        config = RunConfig.model_validate(facts["config"])
        modules = {
            m["module_id"]: load_module_file(modules_root / _module_file(m), config, m["module_id"])
            for m in manifest["modules"]
        }
        write_model_file(config, manifest["path"]["index"], modules, staged)
        if verified(staged, model["size"], model["sha256"]):
            os.replace(staged, out / MODEL_FILE)
            log(f"  assembled {MODEL_FILE} from {len(modules)} modules (sha256 verified)")
            return
        why = "it differs from the server's (another dipaco or safetensors version?)"
    except ValueError as exc:  # a config or module this dipaco cannot read
        why = f"this dipaco cannot build it: {exc}"
    finally:
        staged.unlink(missing_ok=True)
    log(f"  {MODEL_FILE} not assembled here, {why}; fetching the server's copy")
    client.fetch(model["url"], out / MODEL_FILE, model["size"], model["sha256"])


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    default = os.environ.get("DIPACO_CACHE") or Path.home() / ".cache" / "dipaco"
    return Path(cache_dir or default)


def cached_path_dir(
    server: str,
    run: int,
    path: int,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    round: int | None = None,
    token: str | None = None,
    log: Log = stderr,
) -> Path:
    """The path's directory under the cache, fetched when missing or incomplete. Module
    blobs are kept per run, so paths sharing modules download them once."""
    with Client(server, token) as client:
        manifest = fetch_manifest(client, run, path, round)
        server_part = re.sub(r"[^A-Za-z0-9.-]+", "_", urlsplit(client.server).netloc)
        run_dir = cache_root(cache_dir) / server_part / f"run-{run}"
        out = run_dir / manifest["folder"]
        return download_path(client, manifest, out, module_dir=run_dir / "modules", log=log)


def load_path(
    server: str,
    run: int,
    path: int,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    round: int | None = None,
    token: str | None = None,
    device: str = "cpu",
) -> tuple[Any, Any]:
    """Download path `path` of run `run` from a dipaco server (once; later calls reuse the
    cache) and open it: returns a transformers model (eval mode) and its tokenizer.

    >>> model, tokenizer = dipaco.load_path("http://127.0.0.1:8000", run=1, path=2)

    `round`: the weights after that round closed (default: the last closed round).
    `cache_dir`: default ``$DIPACO_CACHE`` or ``~/.cache/dipaco``.
    """
    directory = cached_path_dir(server, run, path, cache_dir, round=round, token=token)
    return open_path_dir(directory, device=device)
