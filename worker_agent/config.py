"""The agent's data directory and its one secret file, ``worker.json`` (mode 0600).

Layout under the data directory (``--data-dir``; default ``$DIPACO_WORKER_DIR`` or
``$XDG_DATA_HOME/dipaco-worker``, i.e. ``~/.local/share/dipaco-worker``)::

    worker.json        server URL, worker id and token (0600: the token is a credential)
    lease.json         the lease being worked on, for resuming after a crash (0600)
    cache/blobs/       module weights and paths' train shards, content-addressed by sha256
    cache/inner/       inner state per (run, path): AdamW moments and the Δ codec's
                       error-feedback residual (dipaco.inner.InnerState), reused when
                       the path comes back
    work/<lease>/      the unit in progress: inner checkpoint, encoded Δs

Files that hold secrets are written to a temporary file created 0600 and renamed into
place, so neither a crash nor another user ever sees a partial or readable secret.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from worker_agent.errors import DiskFull, UsageError

__all__ = [
    "CONFIG_NAME",
    "WorkerIdentity",
    "default_data_dir",
    "load_identity",
    "save_identity",
    "write_private_json",
]

log = logging.getLogger(__name__)
CONFIG_NAME = "worker.json"
PRIVATE_MODE = 0o600


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this machine is to one server: what `--enroll` obtained."""

    server: str
    worker_id: int
    token: str
    name: str


def default_data_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("DIPACO_WORKER_DIR"):
        return Path(env["DIPACO_WORKER_DIR"]).expanduser()
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "dipaco-worker"


def write_private_json(path: Path, value: Any) -> None:
    """Write JSON atomically, readable by the owner only (0600 from creation, fsynced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(value, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, PRIVATE_MODE)  # O_CREAT's mode is masked by the umask; this is not
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFull(
                f"no space left to write {path}; free space in {path.parent} "
                "or choose another --data-dir"
            ) from exc
        raise


def save_identity(data_dir: Path, identity: WorkerIdentity) -> Path:
    path = data_dir / CONFIG_NAME
    write_private_json(path, asdict(identity))
    return path


def load_identity(data_dir: Path) -> WorkerIdentity:
    """The saved identity; UsageError naming the fix when there is none or it is broken."""
    path = data_dir / CONFIG_NAME
    if not path.exists():
        raise UsageError(
            f"this machine is not enrolled ({path} does not exist); run once with "
            "dipaco-worker --server URL --enroll TOKEN (the token comes from the operator)"
        )
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s was readable by others (mode %o); setting it to 0600", path, mode)
        os.chmod(path, PRIVATE_MODE)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return WorkerIdentity(
            server=str(raw["server"]),
            worker_id=int(raw["worker_id"]),
            token=str(raw["token"]),
            name=str(raw["name"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(
            f"{path} is damaged ({exc}); delete it and enroll again with --server URL --enroll TOKEN"
        ) from exc
