"""The agent's loop: lease → fetch → train → (encode → upload → complete, meanwhile) → next.

One `Agent` serves one server with one worker token. The main thread leases, fetches and
trains; a trained unit's Δ is handed in (encoded, uploaded, completed) on a thread of its
own while the next unit is leased, fetched and trained (worker_agent.handin); heartbeats
run on their own thread (worker_agent.heartbeat) and cover both leases.

At most one unit trains and one is handed in. The next unit of the *same* path waits for
its predecessor's hand-in before it trains: its warm AdamW moments and codec residual are
the path's only once that completion is accepted (worker_agent.state.InnerStates), so a refused
hand-in leaves them as the last accepted unit left them, as before the overlap. Units of
other paths start at once. A calibration unit (a worker whose speed the server does not
know yet) is handed in before the next lease is asked for: its completion reports the
speed that sizes that lease. The state file names the lease in hand-in until it is in
(worker_agent.state): a restart after a crash then hands its Δ in.

A lease names the unit's length once (`LeaseGrant.steps`: H, or fewer when the server
sized the unit to this worker's speed, with the reason), the inner loop's bound; the run
config's H (inner.steps) stays the unit's slot of the lr schedule. For a new worker it
also names a time limit that calibrates its speed. Training ends early, and the Δ of the
steps done is *salvaged*
(uploaded and completed with its true token count, which weights it in the outer step),
when:
- the first SIGINT/SIGTERM arrives (cli.py): the current step finishes, the partial Δ is
  uploaded (seconds), then the agent exits;
- the lease expires while the agent is alive (a heartbeat says so): the server still
  takes the Δ while no other lease holds the unit;
- the round's deadline is near (`LeaseGrant.round_deadline`): the round may close soon.
A trained Δ is handed in (upload URLs, uploads, completion) for as long as its round may
take it (`hand_in`): a server or store out of reach past the client's own tries (about 2
minutes) is tried again every 30 s until the round's deadline as last heard has passed.
A round that closed or a run that stopped (heartbeat "release") makes the work useless:
it is dropped. Fewer than ``units.min_partial_steps`` steps are released, not uploaded.

Checkpoints live per unit (``work/unit-<id>``), not per lease: after ``kill -9`` a
restart resumes the saved lease if the server still calls it active; if it expired
meanwhile the server gives this worker the same unit back under a new lease
(rounds.protocol.grant) and training resumes from the checkpoint, while its round is open.

`_work` is one lease top to bottom: lease -> fetch -> train -> hand in. The policies it
applies are named: the micro-batch fitted to the device and its stop reasons and progress
(worker_agent.unit), the out-of-memory fallback and the resident model (the library's
`dipaco.inner.ResidentTrainer`), salvage (`_salvageable`), the hand-in's patience
(worker_agent.handin).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch import Tensor

from dipaco.config import GiB, RunConfig
from dipaco.inner import (
    DEFAULT_CHECKPOINT_INTERVAL_S,
    DoesNotFit,
    InnerResult,
    InnerState,
    ResidentTrainer,
    UnitHooks,
    UnitWork,
)
from dipaco.retry import HAND_IN_PAUSE_S, hand_in_patience_s, idle_pause_s
from worker_agent.client import (
    BlobRef,
    ChunkRef,
    Client,
    LeaseGrant,
    Manifest,
    UnitData,
    lease_from_json,
    seconds_until,
)
from worker_agent.device import DeviceInfo
from worker_agent.downloads import HeldModules, ModuleFetcher
from worker_agent.errors import (
    LEASE_GONE,
    AgentError,
    DiskFull,
    Interrupted,
    OutOfMemory,
    ServerError,
)
from worker_agent.handin import HandInThread, TrainedUnit, hand_in, send_unit
from worker_agent.heartbeat import HeartbeatThread
from worker_agent.progress import Reporter
from worker_agent.rebase import Rebaser
from worker_agent.retry import Backoff
from worker_agent.state import InnerStates, LeaseRecord, LeaseStateFile
from worker_agent.transfer import BlobCache, Transfers, disk_errors
from worker_agent.unit import UnitProgress, UnitStops, unit_source, unit_split, unit_stop_at

__all__ = ["Agent", "AgentOptions", "hand_in"]

log = logging.getLogger(__name__)


@dataclass
class AgentOptions:
    data_dir: Path
    max_units: int | None = None  # --once is 1; None: until stopped
    # A checkpoint every this many seconds of training (what a crash may lose), and/or every
    # `checkpoint_every` steps; both None: none (a stopped unit still saves one).
    checkpoint_interval_s: float | None = DEFAULT_CHECKPOINT_INTERVAL_S
    checkpoint_every: int | None = None
    compile: bool | None = None  # torch.compile: None lets the library decide (CUDA only)
    memory_budget_bytes: int | None = None  # --memory-cap, or the GPU's memory
    idle_wait_s: tuple[float, float] = (1.0, 30.0)  # first and longest wait when no work
    cache_max_bytes: int = 20 * GiB
    step_delay_s: float = 0.0  # --step-delay: a slower device (tests, benchmarks)
    policy: Backoff = field(default_factory=Backoff)
    hand_in_pause_s: float = HAND_IN_PAUSE_S  # between tries to hand in a trained Δ


class Agent:
    def __init__(
        self,
        client: Client,
        heartbeats: HeartbeatThread,
        device: DeviceInfo,
        options: AgentOptions,
        reporter: Reporter,
        stop: threading.Event,
    ) -> None:
        self.client, self.heartbeats, self.device = client, heartbeats, device
        self.options, self.reporter, self.stop = options, reporter, stop
        root = options.data_dir
        # Uploads of a finished unit are not cut short by the first stop request.
        self.transfers = Transfers(root, policy=options.policy, stop=stop)
        self.upload_transfers = Transfers(root, policy=options.policy)
        reporter.meter = self.transfers.meter
        self.upload_transfers.meter = self.transfers.meter
        self.cache = BlobCache(root / "cache" / "blobs", self.transfers)
        self.modules = ModuleFetcher(self.cache, HeldModules(root / "cache" / "held"))
        # Warm inner AdamW state (and error-feedback residual) per (run, path).
        self.inner_states = InnerStates(root / "cache" / "inner")
        self.state = LeaseStateFile(root)
        # The model, built (and compiled) once per run architecture, resident across units.
        self.trainer = ResidentTrainer(device.device, compile=options.compile)
        self.units_done = 0
        self.handing_in: HandInThread | None = None  # the trained unit being handed in

    def close(self) -> None:
        self.transfers.close()
        self.upload_transfers.close()

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Work until stopped or `max_units` are done; AgentError when it cannot go on."""
        grant = self._saved_lease()
        limit = self.options.max_units
        try:
            while not self.stop.is_set():
                if self.handing_in is not None and self.handing_in.done():
                    self._wait_for_hand_in()  # what it could not handle ends the agent now
                if limit is not None and self.units_done + self._units_in_hand_in() >= limit:
                    if self.handing_in is None:
                        break
                    self._wait_for_hand_in()  # refused or lost: the unit does not count
                    continue
                if self.heartbeats.auth_error is not None:
                    raise self.heartbeats.auth_error
                if grant is None:
                    grant = self._next_lease()
                    if grant is None:
                        break  # stopped while waiting
                self._work(grant)
                grant = None
        except Exception:
            self._wait_for_hand_in(quiet=True)  # the trained Δ still goes in, if it can
            raise
        self._wait_for_hand_in()

    def _units_in_hand_in(self) -> int:
        return 0 if self.handing_in is None else 1

    def _wait_for_hand_in(self, *, quiet: bool = False) -> None:
        """Until the unit being handed in (if any) is in; raises what its hand-in could not
        handle, unless `quiet` (the agent is ending for another reason: logged)."""
        job, self.handing_in = self.handing_in, None
        if job is None:
            return
        try:
            job.wait()
        except Exception as error:
            if not quiet:
                raise
            log.warning("handing in lease %s failed too: %s", job.lease_id, error)

    def _next_lease(self) -> LeaseGrant | None:
        first, longest = self.options.idle_wait_s
        wait = first
        if self.handing_in is not None and self.handing_in.before_next_lease:
            self._wait_for_hand_in()
        while not self.stop.is_set():
            if self.handing_in is not None and self.handing_in.done():
                self._wait_for_hand_in()  # in: its error, if any, is raised now
            job = self.handing_in
            handing_in = job.lease_id if job is not None else None
            try:
                grant = self.client.lease(handing_in=handing_in)
            except ServerError as exc:
                if exc.code != "lease_limit_reached":
                    raise
                if job is not None:
                    # A server that counts the lease in hand-in: the next one after it.
                    self._wait_for_hand_in()
                    continue
                # A lease granted but lost in transit: it expires soon; then we get work.
                self.reporter.event("waiting", f"{exc.message}; waiting for it to expire")
                grant = None
            if grant is not None:
                return grant
            # The server's Retry-After wins when nothing was queued (it paces the idle crowd
            # and knows when the next round opens); when shed, the longer of the two.
            pause = idle_pause_s(wait, self.client.idle_retry_after_s, self.client.overloaded)
            why = "the server is overloaded" if self.client.overloaded else "no work queued"
            self.reporter.event("idle", f"{why}; asking again in {pause:.1f} s")
            self.stop.wait(pause)
            wait = min(longest, wait * 1.5)  # gently: a round often reopens within seconds
        return None

    def _saved_lease(self) -> LeaseGrant | None:
        """The lease of an interrupted unit, if the server still has it active; else None."""
        record = self.state.load()
        if record is None:
            return None
        grant = lease_from_json(record.lease)
        if record.server.rstrip("/") != self.client.server:
            self._discard(grant)
            return None
        try:
            answer = self.client.heartbeat(grant.lease_id, grant.secret)
        except ServerError as exc:
            if exc.code not in LEASE_GONE:
                raise
            # Its checkpoint stays: the server gives an expired lease's unit back to us.
            self.reporter.event(
                "resume", f"lease {grant.lease_id} is over ({exc.code}); its unit's "
                "checkpoint is kept for when the server hands the unit back",
            )  # fmt: skip
            self._discard(grant, keep_work=exc.code == "lease_expired")
            return None
        if answer.lease_state != "active" or "release" in answer.instructions:
            self._discard(grant)
            return None
        self.reporter.event(
            "resume", f"resuming lease {grant.lease_id} from step {record.step}",
            lease_id=grant.lease_id, step=record.step,
        )  # fmt: skip
        return grant

    # --- one unit: lease -> fetch -> train -> hand in --------------------------------------

    def _work(self, grant: LeaseGrant) -> None:
        """One lease, top to bottom. How its work ends short of a completion (the lease
        gone, a stop, this machine unable to do it) is `_lease_ends`' policy."""
        work = self._work_dir(grant)
        self._prune_work(keep=work)
        record = self._record(grant)
        config = RunConfig.model_validate(grant.config)
        self._announce(grant, config)
        self.heartbeats.track(grant.lease_id, grant.secret)
        try:
            with self._lease_ends(grant), disk_errors(self.options.data_dir):
                self._wait_for_encoded()
                manifest, modules = self._fetch(grant, config)
                self._wait_for_same_path(grant)
                trained = self._train(grant, config, modules, manifest.data, record, work)
                if trained is not None:
                    self._start_hand_in(trained, manifest)
        finally:
            self.heartbeats.untrack()

    def _record(self, grant: LeaseGrant) -> LeaseRecord:
        """The lease's record on disk (a resumed lease's, with its step and split)."""
        record = self.state.load()
        if record is None or record.lease_id != grant.lease_id:
            record = LeaseRecord(server=self.client.server, lease=grant.raw)
            self.state.save(record)
        return record

    def _announce(self, grant: LeaseGrant, config: RunConfig) -> None:
        h = config.inner.steps
        of = f" of H = {h}" if h > grant.steps else ""
        why = f" ({grant.size_reason})" if grant.size_reason else ""
        self.reporter.event(
            "lease", f"lease {grant.lease_id}: run {grant.run_name} round {grant.round + 1} "
            f"path {grant.path}, {grant.steps} steps{of}{why}",
            lease_id=grant.lease_id, run=grant.run_name, round=grant.round, path=grant.path,
            steps=grant.steps, size_reason=grant.size_reason,
        )  # fmt: skip

    @contextmanager
    def _lease_ends(self, grant: LeaseGrant) -> Iterator[None]:
        """How a lease's work ends short of its completion, the same while it trains and
        while its Δ is handed in: the lease gone (discarded), a stop (released), or this
        machine unable to do the unit (released for another one, then raised)."""
        try:
            yield
        except ServerError as exc:
            if exc.code not in LEASE_GONE:
                raise
            self.reporter.event("lost", f"lease {grant.lease_id} is over: {exc.message}")
            self._discard(grant)
        except Interrupted:
            self._release(grant)
        except DoesNotFit as exc:
            self._release(grant)
            raise OutOfMemory(str(exc)) from exc
        except (DiskFull, OutOfMemory):
            self._release(grant)
            raise

    def _fetch(
        self, grant: LeaseGrant, config: RunConfig
    ) -> tuple[Manifest, dict[str, dict[str, Tensor]]]:
        """The manifest and the path's modules (encoded updates from the versions it holds,
        else fp32 files: downloads.py); the unit's row chunks stream while it trains."""
        held = self.modules.held_versions(grant.run_id, grant.modules)
        manifest = self.client.manifest(grant.lease_id, grant.secret, held)
        modules, fetched = self.modules.fetch(grant.run_id, manifest, config)
        self.reporter.event(
            "modules", f"modules: {fetched.from_updates} from encoded updates "
            f"({fetched.update_bytes:,} B), {fetched.whole} whole ({fetched.module_bytes:,} B), "
            f"{fetched.held} held already, {fetched.fallbacks} fallback(s)",
            **{f"download_{k}": v for k, v in asdict(fetched).items()},
        )  # fmt: skip
        data = manifest.data
        self.reporter.event(
            "fetched", f"fetched {len(modules)} modules; the training data streams from "
            f"{len(data.chunks)} chunk(s) ({sum(c.size for c in data.chunks):,} B)",
        )  # fmt: skip
        return manifest, modules

    def _chunk(self, grant: LeaseGrant, ref: ChunkRef) -> Path:
        """A row chunk's verified local copy (the unit's source fetches them as it goes)."""
        with disk_errors(self.options.data_dir):
            return self.cache.fetch(ref.url, ref.sha256, ref.size,
                                    what=f"training rows of path {grant.path}")  # fmt: skip

    def _wait_for_encoded(self) -> None:
        """On the CPU, where training and the hand-in share the host's memory, the last
        unit's Δ is encoded and its fp32 copy let go before this unit's modules are read:
        else the two units' weights and Δ (4 bytes a parameter each) would be held at once.
        Its upload goes on meanwhile. On a GPU the unit trains in device memory and the
        encoding overlaps it."""
        if self.handing_in is not None and self.device.device.type == "cpu":
            self.handing_in.wait_encoded()

    def _wait_for_same_path(self, grant: LeaseGrant) -> None:
        """A unit of the path being handed in trains once that completion is accepted: its
        warm state is the path's only then (module doc)."""
        job = self.handing_in
        if job is not None and (job.run_id, job.path) == (grant.run_id, grant.path):
            self.reporter.event(
                "hand_in_first", f"lease {grant.lease_id}: path {grant.path} trains once "
                f"lease {job.lease_id}'s Δ of the same path is handed in",
                lease_id=grant.lease_id, handing_in=job.lease_id,
            )  # fmt: skip
            self._wait_for_hand_in()

    def _train(
        self,
        grant: LeaseGrant,
        config: RunConfig,
        modules: dict[str, dict[str, Tensor]],
        data: UnitData,
        record: LeaseRecord,
        work: Path,
    ) -> TrainedUnit | None:
        """Train the unit; None when it stopped early and its Δ is not worth handing in."""
        device = self.device.device.type
        compiled = self.options.compile if self.options.compile is not None else device == "cuda"
        inner = unit_split(config, record, self.options.memory_budget_bytes, device,
                           compiled=compiled)  # fmt: skip
        stops = UnitStops(grant, self.stop, self.heartbeats)
        progress = UnitProgress(grant, record, self.state, self.reporter, stops)
        source = unit_source(config, data, lambda ref: self._chunk(grant, ref),
                             step_delay_s=self.options.step_delay_s,
                             accum=inner.grad_accum_steps)  # fmt: skip
        rebaser = None
        if grant.rebase is not None:
            rebaser = self._rebaser(grant, config, modules, data, work, stops.must_stop)
        hooks = UnitHooks(should_stop=stops.should_stop, on_step=progress.on_step,
                          on_fallback=progress.on_fallback, rebase=rebaser)  # fmt: skip
        unit = UnitWork(config, grant.run_id, grant.path, grant.round, modules, source,
                        grant.data.start_position)  # fmt: skip
        try:
            result, inner = self.trainer.train(
                unit, work_dir=work, state=self._inner_state(grant, config),
                inner=inner, stop_at=unit_stop_at(grant, record), hooks=hooks,
                checkpoint_every=self.options.checkpoint_every,
                checkpoint_interval_s=self.options.checkpoint_interval_s,
                finish_write=False,  # the last checkpoint is written while the Δ is handed in
            )  # fmt: skip
        finally:
            source.close()  # a chunk still in flight is dropped
        if not result.completed:
            result.checkpoint_written()  # what a restart resumes: on disk before any release
            if not self._salvageable(grant, config, result, stops.reason):
                return None
        record.phase, record.step = "uploading", len(result.losses)
        self.state.save(record)
        salvaged = stops.reason if not result.completed else ""
        return TrainedUnit(grant, config, result, work, salvaged, rebaser, inner.micro_batch_size)

    def _inner_state(self, grant: LeaseGrant, config: RunConfig) -> InnerState | None:
        """The path's warm state, or none for a unit another worker trains too (`cold`):
        the two copies are compared, so both start from fresh moments."""
        if grant.cold:
            return None
        return self.inner_states.load(grant.run_id, grant.path, config)

    def _start_hand_in(self, trained: TrainedUnit, manifest: Manifest) -> None:
        """Hand the trained unit's Δ in on its own thread while the next unit trains."""
        grant = trained.grant
        until = self._hand_in_until(grant)
        self._wait_for_hand_in()  # one unit in hand-in at a time
        self.state.hold(grant.lease_id)  # a restart hands it in (the next unit's record waits)
        self.heartbeats.keep_alive(grant.lease_id, grant.secret)
        job = HandInThread(
            grant.lease_id, grant.run_id, grant.path, trained.work,
            lambda: self._hand_in_unit(trained, until, on_encoded=job.encoded.set),
            before_next_lease=grant.seconds_limit is not None,
        )  # fmt: skip
        self.handing_in = job
        job.start()
        # The next unit's fetch starts from here: keep what this unit used (held modules).
        rebased = trained.rebaser.refs if trained.rebaser is not None else []
        keep = {ref.sha256 for ref in [*manifest.modules, *rebased]}  # the unit's rows go
        self.cache.prune(keep, self.options.cache_max_bytes)

    def _hand_in_unit(
        self, trained: TrainedUnit, until: float, *, on_encoded: Callable[[], None]
    ) -> None:
        """Encode, upload and complete a trained unit's Δ (on its hand-in thread), then keep
        its path's new inner state. A lease gone or a stop is handled here, as `_work`
        handles them; anything else is raised (again by `_wait_for_hand_in`)."""
        grant = trained.grant
        try:
            with self._lease_ends(grant):
                try:
                    self._send(trained, until, on_encoded)
                finally:  # the last checkpoint, written meanwhile, is whole before any discard
                    trained.result.checkpoint_written()
        finally:
            self.heartbeats.forget(grant.lease_id)

    def _send(self, trained: TrainedUnit, until: float, on_encoded: Callable[[], None]) -> None:
        grant = trained.grant
        metrics, state = send_unit(
            trained, until=until, client=self.client, transfers=self.upload_transfers,
            reporter=self.reporter, stop=self.stop, pause_s=self.options.hand_in_pause_s,
            data_dir=self.options.data_dir, on_encoded=on_encoded,
        )  # fmt: skip
        # Only now: the server holds these Δs, so their moments and residual are the path's.
        self.inner_states.save(grant.run_id, grant.path, state)
        self.units_done += 1
        self.reporter.event(
            "completed",
            f"lease {grant.lease_id} completed: loss {metrics['loss']:.4f}, "
            f"{metrics['tokens_per_second']:,.0f} tokens/s (micro-batch {trained.micro_batch})",
            units_done=self.units_done,
            lease_id=grant.lease_id,
            round=grant.round,
            path=grant.path,
            **metrics,
        )  # fmt: skip (lease, round and path: the hand-in may end after the next lease)
        trained.result.checkpoint_written()  # in flight while the Δ went in: its folder goes
        self._discard(grant)

    def _hand_in_until(self, grant: LeaseGrant) -> float:
        """Until when (monotonic) a trained Δ is worth handing in (dipaco.retry's rule)."""
        left = seconds_until(self.heartbeats.round_deadline or grant.round_deadline)
        floor = self.client.policy.longest_total_s
        patience = hand_in_patience_s(left, grant.heartbeat_interval_s, floor)
        return time.monotonic() + patience

    def _rebaser(
        self,
        grant: LeaseGrant,
        config: RunConfig,
        modules: dict[str, dict[str, Tensor]],
        data: UnitData,
        work: Path,
        must_stop: Callable[[], str | None],
    ) -> Rebaser:
        """outer.overlap eager's hook for this unit (worker_agent.rebase)."""
        plan = grant.rebase
        assert plan is not None

        def load(refs: list[BlobRef]) -> dict[str, dict[str, Tensor]]:
            with disk_errors(self.options.data_dir):
                new, stats = self.modules.fetch(grant.run_id, Manifest(refs, data), config)
            self.reporter.event(
                "rebase", f"lease {grant.lease_id}: rebased at step {plan.at_step} onto round "
                f"{plan.round}'s versions {dict((r.module_id, r.version) for r in refs)} "
                f"after waiting {rebaser.waited_s:.1f} s ({stats.from_updates} from encoded "
                f"updates, {stats.update_bytes:,} B; {stats.whole} whole, "
                f"{stats.module_bytes:,} B)",
                at_step=plan.at_step, waited_s=rebaser.waited_s,
                **{f"download_{k}": v for k, v in asdict(stats).items()},
            )  # fmt: skip
            return new

        rebaser = Rebaser(
            plan=plan, config=config, path=grant.path, base=modules, work_dir=work,
            ask=lambda: self.client.rebase(grant.lease_id, grant.secret), load=load,
            give_up=must_stop, sleep=self.stop.wait, hard_deadline=grant.hard_deadline,
            steps=grant.steps, margin_s=2 * grant.heartbeat_interval_s,
            on_wait=lambda: self.reporter.event(
                "rebase_wait", f"lease {grant.lease_id}: waiting at step {plan.at_step} for "
                f"round {plan.round + 1}'s versions (its outer step is still running)",
                at_step=plan.at_step, round=plan.round,
            ),
        )  # fmt: skip
        return rebaser

    # --- endings ----------------------------------------------------------------------

    def _salvageable(
        self, grant: LeaseGrant, config: RunConfig, result: InnerResult, reason: str
    ) -> bool:
        """Whether a unit that stopped early uploads its partial Δ; if not, its lease is
        released or dropped here."""
        steps = len(result.losses)
        if self.heartbeats.lease_lost.is_set() and self.heartbeats.release_requested:
            # The round closed or the run stopped: nobody will use this Δ.
            self.reporter.event(
                "lost", f"lease {grant.lease_id} stopped: {self.heartbeats.lost_reason}"
            )
            self._release(grant)
            return False
        if not result.module_deltas or steps < config.units.min_partial_steps:
            self.reporter.event(
                "stopped", f"lease {grant.lease_id}: {steps} step(s) trained, fewer than "
                f"units.min_partial_steps = {config.units.min_partial_steps}; nothing to upload",
            )  # fmt: skip
            if self.heartbeats.lease_lost.is_set():
                self._discard(grant, keep_work=True)
            else:
                self._release(grant)
            return False
        self.reporter.event(
            "salvage", f"lease {grant.lease_id}: {reason}; uploading the Δ of the "
            f"{steps} step(s) trained ({result.tokens:,} tokens)",
            steps=steps, tokens=result.tokens, reason=reason,
        )  # fmt: skip
        return True

    def _release(self, grant: LeaseGrant) -> None:
        """Give the unit back; if the server cannot be told, keep the state to resume it."""
        try:
            self.client.release(grant.lease_id, grant.secret, policy=Backoff(attempts=3))
        except ServerError as exc:
            if exc.code not in LEASE_GONE:
                log.warning("release of lease %s refused: %s", grant.lease_id, exc)
        except AgentError as exc:
            self.reporter.event(
                "release_failed", f"could not release lease {grant.lease_id} ({exc.message}); "
                "it expires on its own, or a restart resumes it",
            )  # fmt: skip
            return
        self.reporter.event("released", f"lease {grant.lease_id} released")
        self._discard(grant)

    def _discard(self, grant: LeaseGrant, *, keep_work: bool = False) -> None:
        """Forget the lease; its unit's work directory too, unless it may come back
        (an expired lease: the server hands its unit back to this worker to resume)."""
        self.state.clear(grant.lease_id)
        if not keep_work:
            shutil.rmtree(self._work_dir(grant), ignore_errors=True)

    def _work_dir(self, grant: LeaseGrant) -> Path:
        return self.options.data_dir / "work" / f"run-{grant.run_id}-unit-{grant.unit_id}"

    def _prune_work(self, keep: Path) -> None:
        """One unit trains and one is handed in at a time: other units' leftovers are gone
        for good."""
        root = self.options.data_dir / "work"
        kept = {keep} | ({self.handing_in.work_dir} if self.handing_in is not None else set())
        if root.is_dir():
            for folder in root.iterdir():
                if folder not in kept:
                    shutil.rmtree(folder, ignore_errors=True)
