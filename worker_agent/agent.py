"""The agent's loop: lease → fetch → train → encode → upload → complete → next.

One `Agent` serves one server with one worker token. The main thread does the work;
heartbeats run on their own thread (worker_agent.heartbeat). A stop request (the first
SIGINT/SIGTERM, see cli.py) ends training at the end of the current step, releases the
lease and returns; a unit whose Δ is already computed is uploaded and completed first
(seconds, and no work is lost). The lease in progress is saved in ``lease.json``; a
restart after a crash resumes it if the server still calls it active.
"""

from __future__ import annotations

import logging
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from dipaco.config import GiB, InnerConfig, RunConfig
from dipaco.data.shards import TokenShard
from dipaco.data.windows import ShardSource
from dipaco.inner import InnerResult, StepMetrics
from worker_agent.client import Client, Contribution, LeaseGrant, lease_from_json
from worker_agent.device import DeviceInfo
from worker_agent.errors import (
    LEASE_GONE,
    AgentError,
    DiskFull,
    Interrupted,
    OutOfMemory,
    ServerError,
)
from worker_agent.heartbeat import HeartbeatThread
from worker_agent.payload import encode_deltas, load_module
from worker_agent.progress import Reporter
from worker_agent.retry import Backoff
from worker_agent.state import LeaseRecord, LeaseStateFile
from worker_agent.trainer import InnerStates, UnitWork, fit_micro_batch, train_unit
from worker_agent.transfer import BlobCache, Transfers, disk_errors

__all__ = ["Agent", "AgentOptions"]

log = logging.getLogger(__name__)


@dataclass
class AgentOptions:
    data_dir: Path
    max_units: int | None = None  # --once is 1; None: until stopped
    checkpoint_every: int | None = 50  # inner steps between checkpoints
    memory_budget_bytes: int | None = None  # --memory-cap, or the GPU's memory
    idle_wait_s: tuple[float, float] = (1.0, 30.0)  # first and longest wait when no work
    cache_max_bytes: int = 20 * GiB
    policy: Backoff = field(default_factory=Backoff)


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
        # Warm inner AdamW state (and error-feedback residual) per (run, path).
        self.inner_states = InnerStates(root / "cache" / "inner")
        self.state = LeaseStateFile(root)
        self.units_done = 0

    def close(self) -> None:
        self.transfers.close()
        self.upload_transfers.close()

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Work until stopped or `max_units` are done; AgentError when it cannot go on."""
        grant = self._saved_lease()
        limit = self.options.max_units
        while not self.stop.is_set() and (limit is None or self.units_done < limit):
            if self.heartbeats.auth_error is not None:
                raise self.heartbeats.auth_error
            if grant is None:
                grant = self._next_lease()
                if grant is None:
                    break  # stopped while waiting
            self._work(grant)
            grant = None

    def _next_lease(self) -> LeaseGrant | None:
        first, longest = self.options.idle_wait_s
        wait = first
        while not self.stop.is_set():
            try:
                grant = self.client.lease()
            except ServerError as exc:
                if exc.code != "lease_limit_reached":
                    raise
                # A lease granted but lost in transit: it expires soon; then we get work.
                self.reporter.event("waiting", f"{exc.message}; waiting for it to expire")
                grant = None
            if grant is not None:
                return grant
            # The server's Retry-After, when longer, wins: it grows with the idle crowd.
            hint = self.client.idle_retry_after_s
            pause = wait if hint is None else max(wait, min(hint, 2 * longest))
            self.reporter.event("idle", f"no work queued; asking again in {pause:.1f} s")
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
            self._discard(grant.lease_id)
            return None
        try:
            answer = self.client.heartbeat(grant.lease_id, grant.secret)
        except ServerError as exc:
            if exc.code not in LEASE_GONE:
                raise
            self.reporter.event("resume", f"lease {grant.lease_id} is over ({exc.code}); fresh")
            self._discard(grant.lease_id)
            return None
        if answer.lease_state != "active" or "release" in answer.instructions:
            self._discard(grant.lease_id)
            return None
        self.reporter.event(
            "resume", f"resuming lease {grant.lease_id} from step {record.step}",
            lease_id=grant.lease_id, step=record.step,
        )  # fmt: skip
        return grant

    # --- one unit ---------------------------------------------------------------------

    def _work(self, grant: LeaseGrant) -> None:
        work_dir = self.options.data_dir / "work" / f"lease-{grant.lease_id}"
        record = self.state.load()
        if record is None or record.lease_id != grant.lease_id:
            record = LeaseRecord(server=self.client.server, lease=grant.raw)
            self.state.save(record)
        self.reporter.event(
            "lease", f"lease {grant.lease_id}: run {grant.run_name} round {grant.round} "
            f"path {grant.path}, {grant.steps} steps",
            lease_id=grant.lease_id, run=grant.run_name, round=grant.round, path=grant.path,
        )  # fmt: skip
        self.heartbeats.track(grant.lease_id, grant.secret)
        try:
            self._train_and_contribute(grant, record, work_dir)
        except ServerError as exc:
            if exc.code not in LEASE_GONE:
                raise
            self.reporter.event("lost", f"lease {grant.lease_id} is over: {exc.message}")
            self._discard(grant.lease_id)
        except Interrupted:
            self._release(grant)
        except (DiskFull, OutOfMemory):
            self._release(grant)  # this machine cannot do the unit: let another one have it
            raise
        finally:
            self.heartbeats.untrack()

    def _train_and_contribute(self, grant: LeaseGrant, record: LeaseRecord, work: Path) -> None:
        config = RunConfig.model_validate(grant.config)
        with disk_errors(self.options.data_dir):
            manifest = self.client.manifest(grant.lease_id, grant.secret)
            modules = {}
            for ref in manifest.modules:
                blob = self.cache.fetch(
                    ref.url, ref.sha256, ref.size, what=f"module {ref.module_id}"
                )
                modules[ref.module_id] = load_module(blob, config, ref.module_id)
            # The whole shard, once per path: every unit of the path reads its windows from it.
            shard = self.cache.fetch(
                manifest.data.url, manifest.data.sha256, manifest.data.size,
                what=f"train shard of path {grant.path}",
            )  # fmt: skip
            self.reporter.event("fetched", f"fetched {len(modules)} modules and the train shard")
            result, inner = self._train(grant, config, modules, shard, record, work)
            if not result.completed:
                if self.heartbeats.lease_lost.is_set():
                    reason = self.heartbeats.lost_reason
                    self.reporter.event("lost", f"lease {grant.lease_id} stopped: {reason}")
                    if self.heartbeats.release_requested:
                        self._release(grant)
                    else:
                        self._discard(grant.lease_id)
                else:
                    self._release(grant)
                return
            record.phase, record.step = "uploading", grant.steps
            self.state.save(record)
            encoded, state = encode_deltas(
                result.module_deltas, config, work / "deltas", result.state
            )
        targets = self.client.upload_urls(grant.lease_id, grant.secret)
        for delta in encoded:
            self.upload_transfers.upload(targets[delta.module_id], delta.path)
        tail = result.losses[-max(1, len(result.losses) // 10) :]
        metrics = {
            "loss": sum(tail) / len(tail),
            "tokens_per_second": result.tokens_per_second,
            "train_seconds": result.seconds,
        }
        contributions = [Contribution(d.module_id, d.sha256, d.size) for d in encoded]
        self.client.complete(grant.lease_id, grant.secret, contributions, result.tokens, metrics)
        # Only now: the server holds these Δs, so their moments and residual are the path's.
        self.inner_states.save(grant.run_id, grant.path, state)
        self.units_done += 1
        self.reporter.event(
            "completed", f"lease {grant.lease_id} completed: loss {metrics['loss']:.4f}, "
            f"{metrics['tokens_per_second']:,.0f} tokens/s (micro-batch {inner.micro_batch_size})",
            units_done=self.units_done, **metrics,
        )  # fmt: skip
        self._discard(grant.lease_id)
        keep = {ref.sha256 for ref in manifest.modules} | {manifest.data.sha256}
        self.cache.prune(keep, self.options.cache_max_bytes)

    def _train(
        self,
        grant: LeaseGrant,
        config: RunConfig,
        modules: dict[str, dict[str, Tensor]],
        shard: Path,
        record: LeaseRecord,
        work: Path,
    ) -> tuple[InnerResult, InnerConfig]:
        inner = config.inner
        if (
            record.micro_batch_size is not None
            and record.micro_batch_size != inner.micro_batch_size
        ):
            inner = inner.model_copy(update={
                "micro_batch_size": record.micro_batch_size,
                "grad_accum_steps": inner.batch_size // record.micro_batch_size,
            })  # fmt: skip
        else:
            inner = fit_micro_batch(config, self.options.memory_budget_bytes)
        every = self.options.checkpoint_every

        def on_step(m: StepMetrics) -> None:
            speed = m.tokens / m.seconds if m.seconds > 0 else 0.0
            self.reporter.status(step=m.step, steps=grant.steps, loss=m.loss,
                                 tokens_per_second=speed, lease_id=grant.lease_id)  # fmt: skip
            # The library checkpoints after on_step, so step k - 1's checkpoint exists now.
            if every and m.step > 1 and (m.step - 1) % every == 0:
                record.step = m.step - 1
                self.state.save(record)

        def on_fallback(old: InnerConfig, new: InnerConfig) -> None:
            record.micro_batch_size = new.micro_batch_size
            self.state.save(record)
            self.reporter.event(
                "fallback", f"out of memory: micro-batch {old.micro_batch_size} -> "
                f"{new.micro_batch_size}, accumulation {new.grad_accum_steps} (same batch)",
            )  # fmt: skip

        stop, lost = self.stop, self.heartbeats.lease_lost
        # The unit's windows in the path's seeded order, from its start: as dipaco simulate.
        source = ShardSource(TokenShard(shard, grant.data.dtype), config.model.seq_len,
                             grant.data.seed)  # fmt: skip
        unit = UnitWork(config, grant.run_id, grant.path, grant.round, modules, source,
                        grant.data.start_position)  # fmt: skip
        state = self.inner_states.load(grant.run_id, grant.path, config)
        return train_unit(
            unit, device=self.device.device, work_dir=work, inner=inner,
            state=state, checkpoint_every=every,
            should_stop=lambda: stop.is_set() or lost.is_set(),
            on_step=on_step, on_fallback=on_fallback,
        )  # fmt: skip

    # --- endings ----------------------------------------------------------------------

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
        self._discard(grant.lease_id)

    def _discard(self, lease_id: int) -> None:
        self.state.clear()
        shutil.rmtree(self.options.data_dir / "work" / f"lease-{lease_id}", ignore_errors=True)
