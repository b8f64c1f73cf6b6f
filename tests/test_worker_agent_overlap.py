"""The unit's edges overlapped, and a distrusted volunteer told so, on a live server.

A trained Δ is handed in (encoded, uploaded, completed) on its own thread while the agent
leases, fetches and trains its next unit; the lease request names the lease in hand-in
(``POST /worker/lease?handing_in=<id>``), which the server leaves out of the worker's
lease limit: one lease training and one handing in, never more.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from dipaco_server.rounds.models import Lease, WorkUnit
from dipaco_server.storage import BlobStore
from dipaco_server.workers.models import Worker
from tests.test_worker_agent_client import FAST, enrolled
from tests.test_worker_agent_e2e import running_run
from tests.test_worker_agent_e2e import store as store
from worker_agent import cli
from worker_agent.agent import Agent, AgentOptions
from worker_agent.client import Client
from worker_agent.config import WorkerIdentity, save_identity
from worker_agent.device import detect_device
from worker_agent.errors import ExitCode, ServerError
from worker_agent.heartbeat import HeartbeatThread
from worker_agent.progress import JsonReporter

pytestmark = pytest.mark.django_db(transaction=True)
GATE_S = 60.0  # how long the held upload waits for the next unit's first step, at most


def test_a_worker_handing_in_its_lease_gets_the_next_one_and_no_more(
    store: BlobStore, live_server: Any
) -> None:
    running_run(store, steps=3)
    client = enrolled(live_server.url)
    first = client.lease()
    assert first is not None
    client.heartbeat(first.lease_id, first.secret)  # heard: not a grant lost in transit
    with pytest.raises(ServerError) as limit:
        client.lease()
    assert limit.value.code == "lease_limit_reached"

    second = client.lease(handing_in=first.lease_id)
    assert second is not None and second.unit_id != first.unit_id
    client.heartbeat(second.lease_id, second.secret)
    for handing_in in (first.lease_id, second.lease_id):  # one training, one handing in
        with pytest.raises(ServerError) as again:
            client.lease(handing_in=handing_in)
        assert again.value.code == "lease_limit_reached"

    headers = {"Authorization": f"Bearer {client.token}"}
    for bad in ("x", "-1", str(2**64)):  # refused as the client's fault, never a 500
        answer = httpx.post(f"{live_server.url}/api/v1/worker/lease?handing_in={bad}",
                            headers=headers, timeout=30)  # fmt: skip
        assert answer.status_code == 422, (bad, answer.text)

    other = enrolled(live_server.url)  # another worker's lease frees nobody's limit
    with pytest.raises(ServerError):
        client.lease(handing_in=other.lease().lease_id)  # type: ignore[union-attr]
    assert Lease.objects.filter(state=Lease.State.ACTIVE).count() == 3
    client.close()
    other.close()


def test_heartbeats_extend_the_lease_in_hand_in_as_well_as_the_one_training(
    store: BlobStore, live_server: Any
) -> None:
    running_run(store, steps=3)
    client = enrolled(live_server.url)
    first = client.lease()
    assert first is not None
    beats = HeartbeatThread(client, interval_s=60)
    beats.track(first.lease_id, first.secret)
    beats.beat()
    beats.keep_alive(first.lease_id, first.secret)  # trained: its Δ is being handed in
    second = client.lease(handing_in=first.lease_id)
    assert second is not None
    beats.track(second.lease_id, second.secret)
    heard = Lease.objects.get(pk=first.lease_id).heartbeat_at
    beats.beat()
    leases = {lease.pk: lease for lease in Lease.objects.all()}
    assert heard is not None and leases[first.lease_id].heartbeat_at > heard
    assert leases[second.lease_id].heartbeat_at is not None
    assert not beats.lease_lost.is_set()

    beats.forget(first.lease_id)  # handed in
    beats.beat()
    assert Lease.objects.get(pk=first.lease_id).heartbeat_at == leases[first.lease_id].heartbeat_at
    client.close()


class HeldUpload(httpx.HTTPTransport):
    """A slow volunteer line: the first hand-in's upload-URL request waits until `release`
    is set (at most GATE_S); every manifest, upload-URL and completion request is written
    to `order`."""

    def __init__(self, order: list[tuple[str, int]], release: threading.Event) -> None:
        super().__init__()
        self.order, self.release, self.held = order, release, False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith(("/upload-urls", "/manifest")):
            self.order.append((path.split("/")[-1], int(path.split("/")[-2])))
        if path.endswith("/upload-urls") and not self.held:
            self.held = True
            self.release.wait(GATE_S)
        if path.endswith("/complete"):
            self.order.append(("complete", int(path.split("/")[-2])))
        return super().handle_request(request)


class OrderedReporter(JsonReporter):
    """Writes each lease's first step to `order`; sets `release` at the first step of a
    lease other than the first, after reading what the agent's lease.json then says."""

    def __init__(
        self, out: io.StringIO, order: list[tuple[str, int]], release: threading.Event, state: Path
    ) -> None:
        super().__init__(out)
        self.order, self.release, self.state = order, release, state
        self.leases: list[int] = []
        self.saved_then: dict[str, Any] = {}

    def status(self, **fields: Any) -> None:
        super().status(**fields)
        lease_id = fields.get("lease_id")
        if "step" in fields and lease_id is not None and lease_id not in self.leases:
            self.leases.append(lease_id)
            self.order.append(("step", lease_id))
            if len(self.leases) > 1:
                self.saved_then = json.loads(self.state.read_text())
                self.release.set()


def test_a_slow_upload_does_not_delay_the_next_units_first_step(
    store: BlobStore, live_server: Any, tmp_path: Path
) -> None:
    running_run(store, steps=2)  # 2x2 paths, one unit each: the next unit is another path
    token = enrolled(live_server.url).token
    # A worker of known speed: a calibration unit is handed in before the next lease is
    # asked for (its completion reports the speed that sizes it).
    Worker.objects.update(measured_speed=10_000.0)
    order: list[tuple[str, int]] = []
    release = threading.Event()
    client = Client(live_server.url, token, policy=FAST, transport=HeldUpload(order, release))
    out, stop = io.StringIO(), threading.Event()
    options = AgentOptions(data_dir=tmp_path, max_units=2, policy=FAST)
    reporter = OrderedReporter(out, order, release, tmp_path / "lease.json")
    agent = Agent(client, HeartbeatThread(client, 30.0), detect_device("cpu"), options,
                  reporter, stop)  # fmt: skip
    try:
        agent.run()
    finally:
        agent.close()
        client.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    leases = [e["lease_id"] for e in events if e["event"] == "lease"]
    assert len(leases) == 2, out.getvalue()
    first, second = leases
    assert order.index(("step", second)) < order.index(("complete", first)), (order, out.getvalue())
    # On the CPU the next unit's modules are read once the last Δ is encoded (its upload
    # URLs are asked for then): the two units' weights and Δ are never held at once.
    assert order.index(("upload-urls", first)) < order.index(("manifest", second)), order
    # Meanwhile the state file named the lease in hand-in: a restart would hand its Δ in.
    saved = reporter.saved_then
    assert (saved["lease"]["lease_id"], saved["phase"]) == (first, "uploading"), saved
    assert [e["event"] for e in events].count("completed") == 2, out.getvalue()
    assert all("calibration" not in e["size_reason"] for e in events if e["event"] == "lease")
    done = Lease.objects.select_related("unit").filter(pk__in=leases)
    assert {(lease.state, lease.unit.state) for lease in done} == {
        (Lease.State.COMPLETED, WorkUnit.State.DONE)
    }
    assert not (tmp_path / "lease.json").exists(), "both units are in: no state left"


def test_a_calibration_unit_is_handed_in_before_the_next_lease_is_asked_for(
    store: BlobStore, live_server: Any, tmp_path: Path
) -> None:
    """Its completion carries the speed that sizes the worker's next unit: asked for before,
    that unit would calibrate again."""
    running_run(store, steps=2)
    token = enrolled(live_server.url).token
    client = Client(live_server.url, token, policy=FAST)
    out, stop = io.StringIO(), threading.Event()
    options = AgentOptions(data_dir=tmp_path, max_units=2, policy=FAST)
    agent = Agent(client, HeartbeatThread(client, 30.0), detect_device("cpu"), options,
                  JsonReporter(out), stop)  # fmt: skip
    try:
        agent.run()
    finally:
        agent.close()
        client.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    names = [e["event"] for e in events]
    assert names.count("lease") == 2 and names.count("completed") == 2, out.getvalue()
    second = [i for i, name in enumerate(names) if name == "lease"][1]
    assert names.index("completed") < second, names
    sizes = [e["size_reason"] for e in events if e["event"] == "lease"]
    assert sizes[0].startswith("calibration") and "tokens/s x" in sizes[1], sizes


def test_a_distrusted_worker_exits_with_its_own_code_naming_its_page(
    store: BlobStore, live_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    running_run(store, steps=2)
    client = enrolled(live_server.url)
    worker = Worker.objects.get()
    Worker.objects.filter(pk=worker.pk).update(trust=0.1)  # below DIPACO_MIN_TRUST
    identity = WorkerIdentity(live_server.url, worker.pk, str(client.token), worker.name)
    save_identity(tmp_path, identity)
    client.close()

    code = cli.main(["--data-dir", str(tmp_path), "--json-logs", "--threads", "1",
                     "--probe-seconds", "0.05", "--once"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == ExitCode.DISTRUSTED, text
    errors = [json.loads(line) for line in text.splitlines() if '"error"' in line]
    assert errors and errors[-1]["exit_code"] == int(ExitCode.DISTRUSTED), text
    message = errors[-1]["message"]
    assert f"{live_server.url}/workers/{worker.pk}/" in message, message
    assert "checks" in message and "operator" in message, message
    assert "unexpected" not in text, text
