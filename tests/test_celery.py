"""Celery tasks round-trip through real worker processes, on Redis and on the embedded broker."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from queue import Empty

import pytest

from dipaco_server.env import celery_transport
from tests.conftest import CeleryWorker, compose_env, start_celery_worker, stop_process

PING = "dipaco_server.core.tasks.ping"


def test_a_task_round_trips_through_redis_with_a_real_worker(
    celery_worker_redis: CeleryWorker,
) -> None:
    nonce = uuid.uuid4().hex
    answer = celery_worker_redis.call(PING, nonce)
    assert answer["nonce"] == nonce
    assert answer["pid"] != os.getpid()  # it ran in the worker, not eagerly here


@pytest.fixture
def embedded_worker(tmp_path: Path) -> Iterator[CeleryWorker]:
    """A worker with nothing configured but its data dir: the filesystem broker."""
    environ = compose_env(
        DIPACO_DATA_DIR=str(tmp_path), DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}"
    )
    worker = start_celery_worker(environ, celery_transport(tmp_path, None), tmp_path)
    yield worker
    stop_process(worker.process)
    worker.app.close()


def test_a_task_round_trips_through_the_embedded_broker_with_a_real_worker(
    embedded_worker: CeleryWorker, tmp_path: Path
) -> None:
    nonce = uuid.uuid4().hex
    answer = embedded_worker.call(PING, nonce)
    assert answer["nonce"] == nonce
    assert answer["pid"] != os.getpid()
    # The message and its result went through files in the data dir, not a server.
    assert embedded_worker.app.conf.broker_url.startswith("filesystem://")
    assert any((tmp_path / "results").iterdir())


def test_the_worker_acknowledges_late_and_takes_one_task_at_a_time() -> None:
    from dipaco_server.celery import app

    assert app.conf.task_acks_late is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.accept_content == ["json"]
    if not os.environ.get("REDIS_URL"):  # the session's data dir, not the default one
        folder = Path(app.conf.broker_transport_options["data_folder_in"])
        assert folder.is_relative_to(Path(os.environ["DIPACO_DATA_DIR"]))
    app.loader.import_default_modules()  # what a worker does at start
    assert PING in app.tasks


@pytest.mark.timeout(60)  # a drain that ignored the stop would wait out its hour
def test_the_embedded_broker_delivers_what_waits_then_ends_a_stopping_workers_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery drains a polling broker 2 s at a time, and once more after SIGTERM: kombu's
    transport waited out both before the warm shutdown began. dipaco_server.broker's ends
    the drain at its next empty poll once the worker is stopping."""
    from celery.worker import state
    from kombu import Connection

    from dipaco_server.broker import FilesystemTransport

    transport = celery_transport(tmp_path, None)
    assert transport["broker_transport"] == "dipaco_server.broker:FilesystemTransport"
    with Connection(
        transport["broker_url"],
        transport=transport["broker_transport"],
        transport_options=transport["broker_transport_options"],
    ) as connection:
        assert isinstance(connection.transport, FilesystemTransport)
        queue = connection.SimpleQueue("drain-test")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}
        with pytest.raises(queue.Empty):  # not stopping: an empty queue waits its timeout
            queue.get(timeout=0.5)
        queue.put({"n": 2})
        monkeypatch.setattr(state, "should_stop", 0)  # what the SIGTERM handler sets
        assert queue.get(timeout=3600).payload == {"n": 2}  # a waiting message still comes
        with pytest.raises(queue.Empty):
            queue.get(timeout=3600)  # ends at the first empty poll
        queue.close()


def test_the_health_check_names_the_embedded_broker_and_finds_its_folder_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dipaco_server.celery import app
    from dipaco_server.core.services import Check, check_broker

    transport = celery_transport(tmp_path, None)
    for key in ("broker_url", "broker_transport", "broker_transport_options"):
        monkeypatch.setitem(app.conf, key, transport[key])
    assert check_broker() == Check(True, "filesystem")
    missing = tmp_path / "gone"
    options = {**transport["broker_transport_options"], "data_folder_out": str(missing)}
    monkeypatch.setitem(app.conf, "broker_transport_options", options)
    assert check_broker() == Check(False, f"filesystem: {missing} is not writable")


def test_each_pool_process_gets_its_share_of_the_cores_unless_the_operator_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from dipaco_server.celery import pool_threads, share_cores_between_pool_processes

    assert [pool_threads(8, n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert pool_threads(1, 0) == 1
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share_cores_between_pool_processes(SimpleNamespace(concurrency=1))
    assert os.environ["OMP_NUM_THREADS"] == str(cpus), "one process: every core"
    monkeypatch.delenv("OMP_NUM_THREADS")
    share_cores_between_pool_processes(SimpleNamespace(concurrency="auto"))
    assert os.environ["OMP_NUM_THREADS"] == "1", "auto: a process per core, a thread each"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    share_cores_between_pool_processes(SimpleNamespace(concurrency=cpus * 4))
    assert os.environ["OMP_NUM_THREADS"] == "3", "the operator's own value is kept"


def test_the_embedded_broker_never_shows_a_half_written_message(tmp_path: Path) -> None:
    """kombu's filesystem transport wrote a message in place: a worker listing the folder
    mid-write moved an empty file, failed to decode it and stopped consuming (a demo's
    server died that way). A consumer polling during a write finds nothing, then all of it."""
    from kombu import Connection

    from dipaco_server.broker import Channel

    transport = celery_transport(tmp_path, None)
    options = transport["broker_transport_options"]
    seen: list[object] = []
    with (
        Connection(transport["broker_url"], transport=transport["broker_transport"],
                   transport_options=options) as producer,
        Connection(transport["broker_url"], transport=transport["broker_transport"],
                   transport_options=options) as consumer,
    ):  # fmt: skip
        queue = consumer.SimpleQueue("whole")
        reader = queue.consumer.channel
        assert isinstance(reader, Channel)
        channel = producer.default_channel
        write = channel._write

        def write_in_two_halves(path: str, data: bytes) -> None:
            write(path, data[: len(data) // 2])
            try:  # the consumer polls between the halves
                seen.append(reader._get("whole"))
            except Empty:
                seen.append(None)
            write(path, data)

        channel._write = write_in_two_halves
        producer.SimpleQueue("whole").put({"n": 1, "text": "x" * 4096})
        assert seen == [None]
        assert queue.get(timeout=5).payload == {"n": 1, "text": "x" * 4096}
        queue.close()
