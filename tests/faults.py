"""Fault-injection helpers: a TCP proxy that can be cut, private PostgreSQL and Redis servers
that a test may stop and start, and the one invariant checker every fault test applies.

The shared PostgreSQL and Redis serve other test sessions, so a test that restarts a service
restarts a private one, started here on a free loopback port in a temporary directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing answered on 127.0.0.1:{port} within {timeout} s")


class TcpProxy:
    """Forwards a loopback port to ``target``; ``cut()`` closes every connection and refuses
    new ones (the port is unbound, so clients see "connection refused") until ``restore()``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.connections = 0  # accepted so far, to show traffic went through the proxy
        self.delay_s = 0.0  # a pause before forwarding each chunk: a slow link

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._acceptor.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed: cut() or stop()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), 5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
                self.connections += 1
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
            with self._lock:
                self._sockets.difference_update((source, sink))

    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        with self._lock:
            open_sockets = list(self._sockets)
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self.start()

    stop = cut


class PrivateRedis:
    """A throwaway ``redis-server`` (no persistence) that a test may restart."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", str(self.directory)]  # fmt: skip
        with (self.directory / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def postgres_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name) or name


class PrivatePostgres:
    """A throwaway PostgreSQL cluster (initdb + pg_ctl, trust auth, fsync off).

    PostgreSQL refuses to run as root; under root the cluster belongs to, and its commands
    run as, the ``postgres`` system user (``runuser``), in a directory of its own outside
    pytest's (which only root may enter). ``remove()`` deletes it.
    """

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="dipaco-faults-pg-"))
        self.data = self.directory / "data"
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/dipaco"

    def _as_owner(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    def _checked(self, command: list[str]) -> None:
        result = self._as_owner(command)
        if result.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {result.stdout}{result.stderr}")

    def init(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres")
        self._checked([postgres_bin("initdb"), "-D", str(self.data), "-A", "trust",
                       "-U", "postgres", "--no-sync"])  # fmt: skip
        self.start()
        self._checked([postgres_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                       "-U", "postgres", "dipaco"])  # fmt: skip

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.directory} -c fsync=off"
        self._checked([postgres_bin("pg_ctl"), "-D", str(self.data), "-o", options,
                       "-l", str(self.directory / "postgres.log"), "-w", "start"])  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._as_owner([postgres_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)


# --- the invariants every fault test checks -------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """A completion the server answered 200: its lease and the modules it reported."""

    lease_id: int
    modules: tuple[str, ...]


def check_invariants(database_url: str, run_id: int, accepted: list[Accepted] = ()) -> None:  # type: ignore[assignment]
    """After a fault: the run finished; each round's outer step of each module was recorded
    once and published version t + 1 (or, with no accepted Δ, kept the module: no version);
    every module's versions are exactly 0 and those; every
    contribution the server took (and each given in ``accepted``) is settled and counted in
    its round's outer step; no unit was completed under two leases."""
    import psycopg

    with psycopg.connect(database_url, connect_timeout=10) as conn:
        state, rounds = _one(conn, "SELECT state, config->>'rounds' FROM runs_run WHERE id = %s",
                             run_id)  # fmt: skip
        assert state == "finished", f"run {run_id} is {state}, not finished"
        rounds = int(rounds)
        modules: dict[int, str] = dict(conn.execute(
            "SELECT id, module_id FROM runs_module WHERE run_id = %s", (run_id,)
        ).fetchall())  # fmt: skip
        assert modules, "the run has modules"
        for pk, name in modules.items():
            versions = [v for (v,) in conn.execute(
                "SELECT version FROM runs_moduleversion WHERE module_id = %s ORDER BY version",
                (pk,))]  # fmt: skip
            steps = conn.execute(
                "SELECT r.t, s.outcome, s.base_version, s.version, s.accepted, s.rejected"
                " FROM rounds_outerstep s"
                " JOIN rounds_round r ON r.id = s.round_id WHERE s.module_id = %s ORDER BY r.t",
                (pk,),
            ).fetchall()
            # One outer step per round. A round may close without an accepted Δ of a module
            # (issue 20: a quorum closes it while killed workers' units are still out; or
            # verification refused them): that step is "kept", publishes nothing, and the
            # module's next version still follows the round's index (t + 1).
            assert [step[0] for step in steps] == list(range(rounds)), (
                f"module {name}: outer steps {steps}"
            )
            current, expected = 0, [0]
            for t, outcome, base, version, took, _ in steps:
                if outcome == "stepped":
                    assert (base, version) == (current, t + 1) and took > 0, (
                        f"module {name}: outer steps {steps}"
                    )
                    current = version
                    expected.append(version)
                else:
                    assert outcome == "kept" and version is None and took == 0, (
                        f"module {name}: outer steps {steps}"
                    )
                    assert base in (current, None), f"module {name}: outer steps {steps}"
            assert versions == expected, f"module {name} has versions {versions}"
            assert len(expected) > 1, f"module {name} never stepped: outer steps {steps}"
            counted = {(t, status): n for t, status, n in conn.execute(
                "SELECT r.t, c.status, count(*) FROM rounds_contribution c JOIN rounds_workunit u"
                " ON u.id = c.unit_id JOIN rounds_round r ON r.id = u.round_id"
                " WHERE c.module_id = %s GROUP BY r.t, c.status", (pk,)
            )}  # fmt: skip
            for t, _, _, _, took, refused in steps:
                stored = (counted.get((t, "accepted"), 0), counted.get((t, "rejected"), 0))
                assert (took, refused) == stored, (
                    f"module {name} round {t}: the outer step counted {took} accepted and "
                    f"{refused} rejected, the contributions say {stored}"
                )
        pending = _one(conn, "SELECT count(*) FROM rounds_contribution c JOIN runs_module m"
                       " ON m.id = c.module_id WHERE m.run_id = %s AND c.status = 'pending'",
                       run_id)[0]  # fmt: skip
        assert pending == 0, f"{pending} contributions were never settled by an outer step"
        twice = conn.execute(
            "SELECT c.unit_id, count(DISTINCT c.lease_id) FROM rounds_contribution c"
            " JOIN runs_module m ON m.id = c.module_id WHERE m.run_id = %s"
            " AND c.status IN ('pending', 'accepted') GROUP BY c.unit_id, c.module_id"
            " HAVING count(DISTINCT c.lease_id) > 1",
            (run_id,),
        ).fetchall()
        assert not twice, f"units completed under two leases: {twice}"
        completed = conn.execute(
            "SELECT l.unit_id, count(*) FROM rounds_lease l JOIN rounds_workunit u"
            " ON u.id = l.unit_id JOIN rounds_round r ON r.id = u.round_id"
            " WHERE r.run_id = %s AND l.state = 'completed' GROUP BY l.unit_id"
            " HAVING count(*) > 1",
            (run_id,),
        ).fetchall()
        assert not completed, f"units with two completed leases: {completed}"
        for item in accepted:
            statuses: dict[str, str] = dict(conn.execute(
                "SELECT m.module_id, c.status FROM rounds_contribution c JOIN runs_module m"
                " ON m.id = c.module_id WHERE c.lease_id = %s", (item.lease_id,)
            ).fetchall())  # fmt: skip
            assert set(statuses) == set(item.modules), (
                f"lease {item.lease_id} was accepted with {item.modules}, stored {statuses}"
            )
            assert "pending" not in statuses.values(), (
                f"lease {item.lease_id}'s contributions were not counted: {statuses}"
            )


def _one(conn: Any, query: str, *args: Any) -> tuple[Any, ...]:
    row = conn.execute(query, args).fetchone()
    assert row is not None, query
    return tuple(row)
