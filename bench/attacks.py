"""Attackers among four workers: what each attack does to a run, and what it is credited.

    .venv/bin/python bench/attacks.py --seeds 0 1 2 --jobs 3 --json docs/figures/attacks.json

A short DiPaCo 2x2 run with R=1 (dipaco.simulate's round loop: four units a round, one per
path, each trained by its own simulated worker with warm AdamW state) in which worker 0
attacks every round (workers 0 and 1 for `colluders`). Every upload then goes through the
server's own checks, in the server's order: the completion's token bound (rounds.protocol.complete
refuses a unit claiming more tokens than H x batch x seq_len), the codec check and the
round-median outlier rule, then rounds.verification.rules's rules as rounds.verification applies them
(replay, norm against the module's history, direction against its outer momentum, proof
of useful work on the unit's own windows and on held-out windows), replica pairs settled
by evidence (`settle_replicas`; an honest check copy of a refused original aggregated in
its place), the first-round peer check (`peer_refusals`), then clipped-mean aggregation
and the outer step (dipaco.outer). Credit is the server's: a unit is credited when every
one of its Δs was accepted, its claimed tokens x its useful fraction
(`rules.useful_fraction`, its gain per token against the round's other accepted units).

Reported per attack, over every seed: the final routed validation loss ÷ that of the
clean run with the same seed (`ratio`: per seed, mean and spread), the tokens credited to
the attacker(s) and the tokens they claimed, and the honest workers' rejected
contributions. `clean_vs_unverified` is the clean run ÷ the same run with verification
switched off (outer.verify false, plain mean: the platform before it screened Δs). `overhead` is
the verification's CPU seconds per contribution ÷ the worker's training seconds for a unit.

Attacks: sign flip (a plausible norm, from round 0); scaled x10, x1e3 and to the fp16
maximum; Gaussian noise of the honest norm; zeros (free rider); a Δ replayed from an
earlier round (byte-identical); a Δ computed for another path; a Δ computed against a
stale base version; an honest Δ whose completion claims 100x the tokens the unit allowed;
two colluders flipping their Δs with every unit replicated (each unit's check copy goes to
the next worker, so worker 1 checks worker 0's unit); a lazy worker sending 0.1 x its Δ
for the whole unit's tokens; a fixed-direction bias (the same unit vector every round, at
0.5 x the Δ's norm; every unit replicated, by another worker each round: a copy's
difference from the other copy, held against what its worker's copies differed by against
other workers before, refuses it once it repeats, rounds.verification.persistence; both
copies of a replicated unit train cold, as on the platform); a sign flip whose
completion claims one token fewer than trained.

Attacks on the scored windows (`SCORED`): `scored_windows` trains every step on the
windows the old rule scored (its unit's first `score_windows`); `lazy_scored` trains a
tenth of the steps, three quarters of each batch from those windows, rescales each
module's Δ to the norm an honest Δ of the unit has (the attacker's best case) and claims
the whole unit; `sleeper_scored` and `sleeper_lazy_scored` hand in honest units for their
first --sleeper-rounds rounds, then attack. `attack_credited_tokens` counts what units
trained with the attack on were credited (a sleeper's honest units left out).
`--draw old` scores as the server did before: the unit's first windows and the split's
last held-out windows every round; `--draw new` (the default) as it does now
(dipaco.data.scored): drawn from all of the unit's windows and, afresh each round, from the
whole validation split, with a secret no worker holds. `--score-windows` sets
outer.score_windows (the 150M preset's budget buys 6; --at-150m-budget reruns every run at it).

Over 500 lines: the server's step is mirrored here check by check (`Run`), in the server's
order, so that one file shows what each attack meets.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from dipaco import codecs
from dipaco.config import LayoutConfig, RunConfig
from dipaco.data.scored import (
    first_windows,
    heldout_seed,
    heldout_windows,
    last_windows,
    unit_seed,
    unit_windows_scored,
)  # fmt: skip
from dipaco.data.windows import path_seed, unit_start, unit_windows
from dipaco.evaluate import routed_mean, stream_windows
from dipaco.flops import score_windows
from dipaco.inner import InnerState, train_path
from dipaco.model import build_model
from dipaco.modular import init_modules_from_base, module_ids, module_spec, modules_of_path
from dipaco.outer import DeltaAccumulator, delta_norm, norm_outliers, outer_lr, outer_step
from dipaco.simulate import DataBudget
from dipaco.simulate.base import prepare_with_base
from dipaco.simulate.train import evaluate_paths
from dipaco_server.rounds.verification import first_round, persistence, rules

ATTACKS = [
    "sign_flip", "scale_x10", "scale_x1e3", "scale_fp16_max", "gaussian_noise", "zeros",
    "replay", "other_path", "stale_base", "token_inflation_x100", "colluders", "lazy_x0.1",
    "bias_0.5", "flip_one_token_short", "scored_windows", "lazy_scored", "sleeper_scored",
    "sleeper_lazy_scored",
]  # fmt: skip
FLIPS = ("sign_flip", "colluders", "flip_one_token_short")
HONEST_BYTES = ("other_path", "stale_base", "token_inflation_x100")  # the Δ itself is honest
REPLICATED = ("colluders", "bias_0.5")  # every unit also trained by another worker
# Train on the windows the old rule scored (the unit's first score_windows): every step
# ("scored_windows"), or a tenth of the steps mostly on them, the Δ rescaled to the honest
# norm and the whole unit claimed ("lazy_scored"); "sleeper_": honest for the first
# --sleeper-rounds hand-ins, then the attack.
SCORED = ("scored_windows", "lazy_scored", "sleeper_scored", "sleeper_lazy_scored")
LAZY_SCORED = ("lazy_scored", "sleeper_lazy_scored")
LAZY_STEPS = 0.1  # the lazy attacker's share of the unit's steps
LAZY_SCORED_SHARE = 0.75  # of each of its batches, from the scored windows
FP16_MAX = 65504.0

Modules = dict[str, dict[str, Tensor]]


def attackers(attack: str | None) -> set[int]:
    if attack is None:
        return set()
    return {0, 1} if attack == "colluders" else {0}


def config(args: argparse.Namespace, seed: int, **outer: Any) -> RunConfig:
    layers = RunConfig.tiny().model.num_layers
    if getattr(args, "score_windows", None):
        outer = {"score_windows": args.score_windows, **outer}
    return RunConfig.tiny(
        name="attacks", rounds=args.rounds, replicas_per_path=1,
        layout=LayoutConfig.grid(layers, 2, 2), seed=seed,
        inner={"steps": args.inner_steps, "lr": 3e-3, "warmup_steps": 5,
               "micro_batch_size": args.batch},
        data={"val_fraction": 0.05, "corpus": args.corpus}, outer=outer,
    )  # fmt: skip


def unit_token_cap(cfg: RunConfig) -> int:
    """dipaco.data.windows.unit_tokens: the most tokens a unit can claim."""
    return unit_windows(cfg) * cfg.model.seq_len


def attacked(
    name: str, delta: dict[str, Tensor], rng: torch.Generator, bias: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The attacker's version of one module's honest Δ (`bias`: its fixed unit direction)."""
    if name in FLIPS:
        return {k: -v for k, v in delta.items()}
    if name == "scale_x10":
        return {k: v * 10 for k, v in delta.items()}
    if name == "scale_x1e3":
        return {k: v * 1e3 for k, v in delta.items()}
    if name == "lazy_x0.1":
        return {k: v * 0.1 for k, v in delta.items()}
    if name == "bias_0.5":
        size = 0.5 * delta_norm(delta)
        return {k: v + size * bias[k] for k, v in delta.items()}
    if name == "scale_fp16_max":
        top = max(float(v.abs().max()) for v in delta.values()) or 1.0
        return {k: (v / top * FP16_MAX).clamp(-FP16_MAX, FP16_MAX) for k, v in delta.items()}
    if name == "gaussian_noise":
        noise = {k: torch.randn(v.shape, generator=rng) for k, v in delta.items()}
        scale = delta_norm(delta) / max(delta_norm(noise), 1e-30)
        return {k: v * scale for k, v in noise.items()}
    if name == "zeros":
        return {k: torch.zeros_like(v) for k, v in delta.items()}
    return delta


@dataclass
class Unit:
    """One unit trained this round: an original, or a check copy of `check_of`."""

    index: int
    worker: int
    path: int
    tokens: int  # claimed
    check_of: int | None = None
    encoded: dict[str, bytes] = field(default_factory=dict)  # module -> its upload
    score: rules.Score | None = None
    rejected: bool = False
    waiting: int = 0  # modules whose first step waits with this unit's Δ kept
    credited: bool = False
    evil: bool = False  # the attack was on when it was trained (a sleeper's: after it turned)


@dataclass
class Entry:
    """One upload in a module's step."""

    unit: Unit
    delta: dict[str, Tensor] | None = None
    norm: float = 0.0
    reason: str = ""
    cosine: float | None = None


class Run:
    """One simulated run: data, model, modules, and what the server remembers."""

    def __init__(self, cfg: RunConfig, attack: str | None, args: argparse.Namespace) -> None:
        torch.manual_seed(cfg.seed)
        self.cfg, self.attack, self.args = cfg, attack, args
        self.bad = attackers(attack)
        data, base = prepared(cfg, args)
        torch.manual_seed(cfg.seed)  # the same state whether the base was trained or loaded
        seq = cfg.model.seq_len
        self.windows = data.val_windows(seq, args.eval_windows)
        self.sources = [data.train_source(p, seq, path_seed(cfg, p)) for p in range(cfg.num_paths)]
        # Every validation window of each path: the held-out windows are drawn from them
        # (--draw new: afresh each round; old: the last score_windows, every round).
        self.val_all = [stream_windows(data.val_tokens(p), seq) for p in range(cfg.num_paths)]
        self.secret = f"bench-secret-{cfg.seed}".encode()  # the server's; no worker reads it
        self.modules: Modules = init_modules_from_base(cfg, base)
        self.previous: Modules = {m: dict(t) for m, t in self.modules.items()}  # stale base
        self.momentum: Modules = {}
        self.history: dict[str, list[float]] = defaultdict(list)  # accepted medians per round
        self.seen: set[str] = set()
        self.states: dict[tuple[int, int], InnerState] = {}
        self.replayable: dict[str, bytes] = {}
        self.credited: dict[int, int] = defaultdict(int)
        self.claimed: dict[int, int] = defaultdict(int)
        self.evil_credited = self.evil_claimed = 0  # the attacker's units with the attack on
        self.reasons: dict[str, int] = defaultdict(int)
        self.honest_rejected = 0
        self.first_verdicts: dict[int, str] = {}  # unit index -> the first round's verdict
        # (worker, module) -> its compared copies' difference sketches, newest first
        self.replica_past: dict[tuple[int, str], list[tuple[int, bool, Tensor]]] = defaultdict(
            list
        )  # (worker, module) -> (partner, was the check copy, its difference sketch)
        self.replica_new: list[tuple[list[tuple[int, bool, Tensor]], int, bool, Tensor]] = []
        # rounds.verification.first_round: a module whose first step waits keeps its Δs for
        # the next round's step (module -> the units kept); unit indices run across rounds
        self.carried: dict[str, list[Unit]] = defaultdict(list)
        self.issued = 0
        self.rng = torch.Generator().manual_seed(cfg.seed + 7)
        self.bias = {  # a fixed unit direction per module, the same every round
            m: _unit_vector(module_spec(cfg, m), cfg.seed + 11) for m in module_ids(cfg)
        }
        self.model = build_model(cfg.model, cfg.seed)
        self.cap = unit_token_cap(cfg)
        self.train_seconds = self.verify_seconds = 0.0
        self.scored = 0

    def evil(self, t: int, worker: int) -> str | None:
        """The attack `worker` makes in round t (a sleeper's: none before it turns)."""
        if worker not in self.bad:
            return None
        if self.attack and self.attack.startswith("sleeper_") and t < self.args.sleeper_rounds:
            return None
        return self.attack

    def train(self, t: int, worker: int, p: int, *, check: bool) -> tuple[dict[str, bytes], int]:
        """One unit of path p trained by `worker`, as its uploads and claimed tokens."""
        cfg, evil = self.cfg, self.evil(t, worker)
        if evil in SCORED:
            return self.train_scored(t, worker, p, evil, check=check)
        trained_path, start_from = p, self.modules
        if evil == "other_path":
            trained_path = (p + 1) % cfg.num_paths
        if evil == "stale_base":
            start_from = self.previous
        # Both copies of a replicated unit train from fresh AdamW moments (the lease's
        # `cold`, rounds.verification.replication.replicated); others continue warm ones.
        cold = check or self.attack in REPLICATED
        state = None if cold else self.states.get((worker, trained_path))
        clock = time.perf_counter()
        result = train_path(
            cfg, trained_path, start_from, self.sources[trained_path], round_index=t,
            start_position=unit_start(cfg, t, 0), state=state,
        )  # fmt: skip
        self.train_seconds += time.perf_counter() - clock
        state = result.state or InnerState()
        if not check:
            self.states[(worker, trained_path)] = state
        tokens = result.tokens * (100 if evil == "token_inflation_x100" else 1)
        tokens -= 1 if evil == "flip_one_token_short" else 0
        encoded = {}
        own, trained = modules_of_path(cfg, p), modules_of_path(cfg, trained_path)
        for module_id, source_id in zip(own, trained, strict=True):
            delta = result.module_deltas[source_id]
            if evil is None or evil in HONEST_BYTES:
                encoded[module_id], residual = codecs.encode_with_feedback(
                    delta, cfg.comm.codec, state.module_residual(source_id),
                    block_size=cfg.comm.block_size,
                )  # fmt: skip
                if not check:
                    state.set_module_residual(source_id, residual)
            elif evil == "replay":
                fresh = codecs.encode(delta, cfg.comm.codec, block_size=cfg.comm.block_size)
                encoded[module_id] = self.replayable.setdefault(module_id, fresh)
            else:
                bad = attacked(evil, delta, self.rng, self.bias[module_id])
                encoded[module_id] = codecs.encode(
                    bad, cfg.comm.codec, block_size=cfg.comm.block_size
                )
        return encoded, tokens

    def train_scored(
        self, t: int, worker: int, p: int, evil: str, *, check: bool
    ) -> tuple[dict[str, bytes], int]:
        """The scored-window attacks (SCORED): trained on the windows the old rule scores."""
        cfg = self.cfg
        start = unit_start(cfg, t, 0)
        state = None if check else self.states.get((worker, p))
        source: Any = ScoredSource(self.sources[p], start, score_windows(cfg), cfg.model.seq_len)
        stop_at, norms = None, None
        if evil in LAZY_SCORED:
            # Its honest norm (the attacker's best case: it knows what an honest Δ of this
            # unit measures), then a tenth of the steps, mostly on the scored windows.
            honest = train_path(cfg, p, self.modules, self.sources[p], round_index=t,
                                start_position=start, state=copy.deepcopy(state))  # fmt: skip
            norms = {m: delta_norm(d) for m, d in honest.module_deltas.items()}
            source = MixedSource(source, self.sources[p], LAZY_SCORED_SHARE)
            stop_at = max(1, round(LAZY_STEPS * cfg.inner.steps))
        clock = time.perf_counter()
        trained = cfg
        if stop_at is not None:  # its own schedule: no warm-up to spend its few steps in
            trained = cfg.model_copy(update={"inner": cfg.inner.model_copy(
                update={"warmup_steps": 0})})  # fmt: skip
        result = train_path(trained, p, self.modules, source, round_index=t,
                            start_position=start, state=state, stop_at=stop_at)  # fmt: skip
        self.train_seconds += time.perf_counter() - clock
        if not check and result.state is not None:
            self.states[(worker, p)] = result.state
        encoded = {}
        for module_id, delta in result.module_deltas.items():
            if norms is not None:
                scale = norms[module_id] / max(delta_norm(delta), 1e-30)
                delta = {k: v * scale for k, v in delta.items()}
            encoded[module_id] = codecs.encode(
                delta, cfg.comm.codec, block_size=cfg.comm.block_size
            )
        return encoded, self.cap  # the whole unit claimed

    def round(self, t: int) -> None:
        cfg = self.cfg
        units: list[Unit] = []
        for p in range(cfg.num_paths):
            encoded, tokens = self.train(t, p, p, check=False)
            units.append(Unit(self.issued + len(units), p, p, tokens, encoded=encoded,
                              evil=self.evil(t, p) is not None))  # fmt: skip
        if self.attack in REPLICATED:  # replication forced on: every unit checked
            for original in list(units[: cfg.num_paths]):
                # `colluders`: the next worker; otherwise each round another (checks go to
                # whichever worker asks, so a worker meets several partners)
                shift = 1 if self.attack == "colluders" else 1 + t % (cfg.num_paths - 1)
                checker = (original.worker + shift) % cfg.num_paths
                encoded, tokens = self.train(t, checker, original.path, check=True)
                units.append(
                    Unit(self.issued + len(units), checker, original.path, tokens,
                         original.index, encoded, evil=self.evil(t, checker) is not None)
                )  # fmt: skip
        self.issued += len(units)
        for u in units:
            self.claimed[u.worker] += u.tokens
            self.evil_claimed += u.tokens if u.evil else 0
        self.previous = {m: dict(v) for m, v in self.modules.items()}
        for (
            u
        ) in units:  # rounds.protocol.complete: a claim above the unit's tokens is refused outright
            if u.tokens > self.cap:
                u.rejected = True
                self.reasons["completion_refused: tokens above H x batch x seq_len"] += 1
        live = [u for u in units if not u.rejected]
        round_base = {m: dict(v) for m, v in self.modules.items()}  # what the units started from
        self.score_units(live, t, round_base)
        kept = list({id(u): u for us in self.carried.values() for u in us}.values())
        self.first_verdicts = {}
        if cfg.outer.verify and not any(self.history.values()):  # the modules' first step
            self.first_verdicts = self.first_round(live + kept)
        lr = outer_lr(cfg.outer, t)
        seen_now: set[str] = set()
        for module_id in module_ids(cfg):
            carried = self.carried.pop(module_id, [])
            for u in carried:
                u.waiting -= 1
            entries = [Entry(u) for u in [*live, *carried] if module_id in u.encoded]
            if entries:
                self.step_module(module_id, entries, lr, seen_now, can_wait=t < cfg.rounds - 1)
        self.seen |= seen_now
        self.credit(units + kept)

    def score_units(self, units: list[Unit], t: int, base: Modules) -> None:
        """Proof of useful work per unit, its whole Δ (rounds.verification.scorer)."""
        cfg = self.cfg
        if not (cfg.outer.verify and cfg.outer.score):
            return
        cache: dict[int, rules.BaseLosses] = {}
        k = score_windows(cfg)
        heldout = {}
        for p in {u.path for u in units}:
            every = self.val_all[p]
            picks = (last_windows(len(every), k) if self.args.draw == "old" else
                     heldout_windows(len(every), k, heldout_seed(self.secret, "bench", "paths",
                                                                 t, p)))  # fmt: skip
            heldout[p] = every[torch.from_numpy(picks)]
        for u in units:
            clock = time.process_time()
            try:
                deltas = {m: codecs.decode(e, module_spec(cfg, m)) for m, e in u.encoded.items()}
            except codecs.CodecError:
                continue  # refused by the format check in each module's step
            if not all(math.isfinite(delta_norm(d)) for d in deltas.values()):
                continue
            if all(delta_norm(d) == 0 for d in deltas.values()):
                continue  # the zero check refuses it before scoring
            train_w = self.scored_rows(t, u.path)
            u.score = rules.score_delta(cfg, u.path, self.model, base, deltas, train_w,
                                         heldout[u.path], before=cache.get(u.path))  # fmt: skip
            if u.score.base is not None:
                cache[u.path] = u.score.base
            self.verify_seconds += time.process_time() - clock

    def scored_rows(self, t: int, p: int) -> Tensor:
        """(score_windows, T+1) the windows that score path p's unit of round t: its first
        (--draw old) or drawn from all of its windows with the server's secret (new: the
        unit's replicas, at the same position, get the same draw; dipaco.data.scored)."""
        cfg, start, seq = self.cfg, unit_start(self.cfg, t, 0), self.cfg.model.seq_len
        k = score_windows(cfg)
        if self.args.draw == "old":
            positions = first_windows(start, k)
        else:
            seed = unit_seed(self.secret, "bench", "paths", t, p, start)
            positions = unit_windows_scored(start, unit_windows(cfg), k, seed)
        return torch.cat([self.sources[p].batch(int(q), 1, seq) for q in positions])

    def work(self, u: Unit) -> float:
        return min(1.0, u.tokens / self.cap)

    def step_module(
        self,
        module_id: str,
        entries: list[Entry],
        lr: float,
        seen_now: set[str],
        can_wait: bool = False,
    ) -> None:
        cfg, outer = self.cfg, self.cfg.outer
        spec = module_spec(cfg, module_id)
        for e in entries:  # format
            try:
                e.delta = codecs.decode(e.unit.encoded[module_id], spec)
                e.norm = delta_norm(e.delta)
                if not math.isfinite(e.norm):
                    raise codecs.CodecError("norm_overflow", "its norm overflows fp32")
            except codecs.CodecError as exc:
                e.reason = f"{exc.code}: {exc}"
        ok = [e for e in entries if not e.reason]
        for e, outlier in zip(
            ok, norm_outliers([e.norm for e in ok], outer.reject_norm_factor), strict=True
        ):
            if outlier:
                e.reason = "norm_outlier: above reject_norm_factor x the round's median"
        past = self.history[module_id][-outer.history_rounds :]
        clock = time.process_time()
        if outer.verify:
            candidates = []
            for i, e in enumerate(entries):
                if e.reason:
                    continue
                assert e.delta is not None
                if module_id in self.momentum:
                    e.cosine = rules.cosine(e.delta, self.momentum[module_id])
                sha = hashlib.sha256(e.unit.encoded[module_id]).hexdigest()
                seen_now.add(sha)
                candidates.append(rules.Candidate(i, e.norm, sha, e.cosine, e.unit.score,
                                                   work=self.work(e.unit)))  # fmt: skip
                self.scored += 1
            for i, why in rules.screen(candidates, past, outer, seen=self.seen).items():
                entries[i].reason = why
            self.settle_replicas(entries, module_id)
            if not past:  # the module's first step: no history yet
                for e in entries:  # rounds.verification.checks.first_round_check
                    if not e.reason and e.unit.index in self.first_verdicts:
                        e.reason = self.first_verdicts[e.unit.index]
                self.peer_check(entries)
                if can_wait and self.waits(module_id, entries):
                    self.verify_seconds += time.process_time() - clock
                    return
        self.verify_seconds += time.process_time() - clock
        chosen = [e for e in entries if not e.reason and self.aggregated(e, entries)]
        self.count_refusals(entries)
        if self.args.verbose:
            for e in entries:
                s = e.unit.score
                print(f"  {module_id:6s} w{e.unit.worker} p{e.unit.path}"
                      f"{' check' if e.unit.check_of is not None else ''} norm {e.norm:.3g} "
                      f"cos {e.cosine} gain {s.relative_gain if s else None} {e.reason[:60]}",
                      file=sys.stderr)  # fmt: skip
        if not chosen:
            return
        norms = [e.norm for e in chosen]
        limit = None
        if outer.robust == "clipped-mean":
            limit = rules.clip_limit(norms, past, outer)
        acc = DeltaAccumulator(spec, token_weighting=outer.token_weighting, clip_norm=limit)
        for e in chosen:
            assert e.delta is not None
            acc.add(e.delta, min(e.unit.tokens, self.cap))
        grad = acc.mean()
        # What the server keeps per step: the median of the accepted norms (OuterStep).
        self.history[module_id].append(statistics.median(norms))
        self.modules[module_id], self.momentum[module_id] = outer_step(
            self.modules[module_id], grad, self.momentum.get(module_id), outer, lr=lr
        )

    def waits(self, module_id: str, entries: list[Entry]) -> bool:
        """rounds.outer.step: an undecided first round makes the step wait, its version
        kept and every Δ kept for the next round's step."""
        if not any(e.reason.startswith(first_round.UNSETTLED) for e in entries):
            return False
        for e in entries:
            e.reason = ""
            e.unit.waiting += 1
            self.carried[module_id].append(e.unit)
        return True

    def count_refusals(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.reason:
                e.unit.rejected = True
                who = "" if e.unit.worker in self.bad else "honest "
                held = e.reason.startswith(f"{rules.AGREED_NO_GAIN}:")  # not the worker's fault
                self.honest_rejected += 1 if who and not held else 0
                self.reasons[who + e.reason.split(":")[0]] += 1

    def aggregated(self, e: Entry, entries: list[Entry]) -> bool:
        """rounds.verification.aggregated: a check copy only in place of a refused original."""
        if e.unit.check_of is None:
            return True
        original = next((o for o in entries if o.unit.index == e.unit.check_of), None)
        return original is None or bool(original.reason)

    def settle_replicas(self, entries: list[Entry], module_id: str) -> None:
        self.hold_no_gain(entries, module_id)
        for check in entries:
            if check.unit.check_of is None or check.reason:
                continue
            original = next((o for o in entries if o.unit.index == check.unit.check_of), None)
            if original is None or original.reason:
                continue
            pair = (original, check)
            assert original.delta is not None and check.delta is not None
            kept_from = len(self.replica_new)
            repeats = self.repeated(pair, module_id)
            flagged = [i for i, why in enumerate(repeats) if why]
            close = rules.replicas_agree(original.delta, check.delta, self.cfg.outer)[0]
            if not close:  # a difference from a far-off copy is that copy's error, not evidence
                del self.replica_new[kept_from:]
            if len(flagged) == 1 and close:
                outcome = rules.ReplicaOutcome("disagree", flagged[0], repeats[flagged[0]])
            else:
                outcome = rules.settle_replicas(
                    original.delta, check.delta, self.cfg.outer,
                    tuple(rules.ReplicaEvidence(e.unit.score, e.cosine,  # type: ignore[arg-type]
                          hashlib.sha256(e.unit.encoded[module_id]).hexdigest()) for e in pair),
                    repeated="; ".join(repeats) if flagged else "",
                )  # fmt: skip
            if outcome.kind == "disagree" and outcome.loser is not None:
                pair[outcome.loser].reason = f"{rules.REPLICA}: {outcome.why}"
        for past, partner, check, signed in self.replica_new:  # newest first, as the server
            past.insert(0, (partner, check, persistence.from_bytes(persistence.to_bytes(signed))))
            del past[persistence.PAST :]
        self.replica_new.clear()

    def hold_no_gain(self, entries: list[Entry], module_id: str) -> None:
        """rounds.verification.checks._held_pairs: agreeing copies that both bought nothing."""
        for check in entries:
            if check.unit.check_of is None:
                continue
            original = next((o for o in entries if o.unit.index == check.unit.check_of), None)
            if original is None or original.delta is None or check.delta is None:
                continue
            pair = (original, check)
            same = original.unit.encoded[module_id] == check.unit.encoded[module_id]
            held = rules.held_no_gain(
                (original.reason, check.reason), (original.unit.score, check.unit.score),
                original.delta, check.delta, self.cfg.outer, identical=same,
            )  # fmt: skip
            for e in pair if held else ():
                e.reason = held

    def repeated(self, pair: tuple[Entry, Entry], module_id: str) -> list[str]:
        """rounds.verification.checks._repeated: per copy, whether its difference repeats
        what its worker's copies in the module differed by against other workers; each
        keeps its side of it."""
        if pair[0].unit.encoded[module_id] == pair[1].unit.encoded[module_id]:
            return ["", ""]
        a, b = (e.delta for e in pair)
        assert a is not None and b is not None
        sketch, difference = persistence.difference_sketch(a, b, module_spec(self.cfg, module_id))
        sides, kept = [], []
        for e, other, signed in ((*pair, sketch), (pair[1], pair[0], -sketch)):
            past = self.replica_past[(e.unit.worker, module_id)]
            sides.append((e.unit.worker, signed,
                          [(partner, s) for partner, _, s in past  # against other workers
                           if partner != other.unit.worker]))  # fmt: skip
            kept.append((past, other.unit.worker, e is pair[1], signed))
        for entry in kept:  # as stored, seen from the next round's step on
            self.replica_new.append(entry)
        return persistence.repeated(sides, difference, min(e.norm for e in pair))

    def first_round(self, units: list[Unit]) -> dict[int, str]:
        """rounds.verification.settlement: the round's units settled over every module they
        share (first_round.settle), the same verdict for each of their Δs."""
        flat: dict[str, dict[int, Tensor]] = defaultdict(dict)
        for u in units:
            for module_id, data in u.encoded.items():
                try:
                    delta = codecs.decode(data, module_spec(self.cfg, module_id))
                except codecs.CodecError:
                    continue
                flat[module_id][u.index] = torch.cat(
                    [t.double().reshape(-1) for t in delta.values()]
                )
        sums: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for deltas in flat.values():
            keys = sorted(deltas)
            for i, a in enumerate(keys):
                for b in keys[i + 1 :]:
                    acc = sums[(a, b)]
                    acc[0] += float(deltas[a] @ deltas[b])
                    acc[1] += float(deltas[a] @ deltas[a])
                    acc[2] += float(deltas[b] @ deltas[b])
        cosines = {
            pair: (ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 and math.isfinite(ab) else None)
            for pair, (ab, aa, bb) in sums.items()
        }
        facts = {
            u.index: first_round.UnitFacts(u.worker, rules.gain_rate(u.score, self.work(u)))
            for u in units
        }
        copies = [(u.check_of, u.index) for u in units if u.check_of is not None]
        return first_round.settle(facts, cosines, copies)

    def peer_check(self, entries: list[Entry]) -> None:
        live = {i: e for i, e in enumerate(entries) if not e.reason and self.aggregated(e, entries)}
        deltas = {i: e.delta for i, e in live.items() if e.delta is not None and e.norm > 0}
        rates = {i: rules.gain_rate(e.unit.score, self.work(e.unit)) for i, e in live.items()}
        for i, why in rules.peer_refusals(rules.pairwise_cosines(deltas), rates).items():
            entries[i].reason = why

    def credit(self, units: list[Unit]) -> None:
        """rounds.verification.credit: whole units only, x their useful fraction, once every
        Δ of the unit is settled (none kept by a waiting step)."""
        accepted = [u for u in units if not u.rejected and not u.waiting and not u.credited]
        for u in accepted:
            u.credited = True
            peers = [(o.score, self.work(o)) for o in accepted if o is not u and o.score]
            fraction = rules.useful_fraction(u.score, self.work(u), peers)
            self.credited[u.worker] += round(u.tokens * fraction)
            self.evil_credited += round(u.tokens * fraction) if u.evil else 0

    def result(self) -> dict[str, Any]:
        losses = evaluate_paths(self.cfg, self.modules, self.windows)
        units = self.cfg.rounds * self.cfg.num_paths
        return {
            "loss": routed_mean(losses),
            "credited_tokens": sum(self.credited[w] for w in self.bad),
            "claimed_tokens": sum(self.claimed[w] for w in self.bad),
            "attack_credited_tokens": self.evil_credited,  # its units with the attack on
            "attack_claimed_tokens": self.evil_claimed,
            "honest_credited_tokens": sum(v for w, v in self.credited.items() if w not in self.bad),
            "honest_rejected": self.honest_rejected,
            "reasons": dict(self.reasons),
            "train_seconds_per_unit": self.train_seconds / units,
            "verify_cpu_seconds_per_contribution": self.verify_seconds / max(1, self.scored),
        }


class ScoredSource:
    """A TokenSource that serves only the `count` windows the old rule scores (positions
    start .. start + count - 1 of `source`), over and over, whatever position is asked."""

    def __init__(self, source: Any, start: int, count: int, seq_len: int) -> None:
        self.start, self.count = start, count
        self.rows = source.batch(start, count, seq_len)  # (count, T+1)

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        picks = (position - self.start + torch.arange(batch_size)) % self.count
        return self.rows[picks]


class MixedSource:
    """`share` of each batch from `scored`, the rest from the unit's own windows."""

    def __init__(self, scored: ScoredSource, source: Any, share: float) -> None:
        self.scored, self.source, self.share = scored, source, share

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        mine = min(batch_size, max(1, round(self.share * batch_size)))
        parts = [self.scored.batch(position, mine, seq_len)]
        if batch_size > mine:
            parts.append(self.source.batch(position + mine, batch_size - mine, seq_len))
        return torch.cat(parts)


def prepared(cfg: RunConfig, args: argparse.Namespace) -> tuple[Any, dict[str, Tensor]]:
    """The run's data and its dense base, trained once per seed and configuration and
    kept in the work dir (tfidf routing: the data does not depend on the base)."""
    assert cfg.router.featurizer == "tfidf", "the base is trained after the data here"
    digest = hashlib.sha256(cfg.model_dump_json(exclude={"outer"}).encode()).hexdigest()[:16]
    file = args.work_dir / f"base-{digest}-{args.base_steps}.safetensors"
    cached = file.exists()
    data, base = prepare_with_base(
        cfg, DataBudget(), args.work_dir, 0 if cached else args.base_steps
    )
    if cached:
        return data, load_file(file)
    assert base is not None  # prepare_with_base trained it
    save_file({k: v.contiguous() for k, v in base.items()}, str(file))
    return data, base


def _unit_vector(spec: Any, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = {name: torch.randn(shape, generator=g) for name, (shape, _) in spec.items()}
    norm = delta_norm(v)
    return {k: t / norm for k, t in v.items()}


def run(cfg: RunConfig, attack: str | None, args: argparse.Namespace) -> dict[str, Any]:
    sim = Run(cfg, attack, args)
    for t in range(cfg.rounds):
        sim.round(t)
    return sim.result()


def one_run(task: tuple[argparse.Namespace, int, str]) -> dict[str, Any]:
    """One run of the bench in a worker process: (args, seed, "clean" | "unverified" | attack)."""
    args, seed, name = task
    torch.set_num_threads(1)
    args = argparse.Namespace(**{**vars(args), "work_dir": args.work_dir / f"seed-{seed}"})
    if name == "unverified":
        return run(config(args, seed, verify=False, robust="mean"), None, args)
    return run(config(args, seed), None if name == "clean" else name, args)


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "mean": round(statistics.mean(values), 4),
        "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "per_seed": [round(v, 4) for v in values],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rounds", type=int, default=4, help="T (default %(default)s)")
    parser.add_argument("--inner-steps", type=int, default=10, help="H (default %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per inner step")
    parser.add_argument("--base-steps", type=int, default=100, help="dense base (%(default)s)")
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--corpus", default="stdlib", help="stdlib, a directory or a .jsonl")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one process each")
    parser.add_argument("--verbose", action="store_true", help="each Δ's checks, on stderr")
    parser.add_argument("--no-unverified", action="store_true", help="skip the unverified run")
    parser.add_argument("--attack", action="append", choices=ATTACKS, help="default: all")
    parser.add_argument("--draw", choices=("new", "old"), default="new",
                        help="the scored windows: drawn after the upload with the server's "
                        "secret from all of the unit's windows, held-out ones afresh each "
                        "round (new), or the unit's first and the split's last (old, the "
                        "rule before) (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--sleeper-rounds",
        type=int,
        help="rounds a sleeper_ attack hands in honestly (default: half of --rounds, so that "
        "it turns within the run)",
    )
    parser.add_argument(
        "--score-windows", type=int, help="outer.score_windows (default: the config's)"
    )
    parser.add_argument(
        "--at-150m-budget",
        action="store_true",
        help="also every run again with the scoring windows the 150M preset's "
        "outer.score_flops buys (the JSON's at_150m_budget)",
    )
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/dipaco/simulate")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sleeper_rounds is None:
        args.sleeper_rounds = args.rounds // 2
    torch.set_num_threads(1)
    started = time.perf_counter()
    out = measure(args)
    if args.at_150m_budget:
        # the same runs with the windows the 150M preset's outer.score_flops buys
        windows = score_windows(RunConfig.paper_150m())
        again = argparse.Namespace(**{**vars(args), "score_windows": windows})
        print(f"at the 150M scoring budget: {windows} windows", flush=True)
        out["at_150m_budget"] = {
            "score_windows": windows,
            "score_flops": RunConfig.paper_150m().outer.score_flops,
            **measure(again),
        }
    out["command"] = "bench/attacks.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of `args` (the clean ones first), summarised per attack."""
    names = args.attack or ATTACKS
    # The clean runs first (they prepare each seed's data in its own folder), then the rest:
    # every run is independent, so --jobs processes share them out.
    first = [(seed, "clean") for seed in args.seeds]
    rest = [(seed, "unverified") for seed in args.seeds if not args.no_unverified]
    rest += [(seed, name) for seed in args.seeds for name in names]
    done: dict[tuple[int, str], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for batch in (first, rest):
            results_ = pool.map(one_run, [(args, *t) for t in batch])
            for task, result in zip(batch, results_, strict=True):
                done[task] = result
                print(f"seed {task[0]} {task[1]:22s} loss {result['loss']:.4f} credited "
                      f"{result['credited_tokens']:7d} of {result['claimed_tokens']:7d} "
                      f"honest rejected {result['honest_rejected']} {result['reasons']}",
                      flush=True)  # fmt: skip
    return summarise(args, names, done)


def summarise(
    args: argparse.Namespace, names: list[str], done: dict[tuple[int, str], dict[str, Any]]
) -> dict[str, Any]:
    clean = {seed: done[(seed, "clean")] for seed in args.seeds}
    unverified = {
        seed: clean[seed]["loss"] / done[(seed, "unverified")]["loss"]
        for seed in args.seeds
        if (seed, "unverified") in done
    }
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for seed in args.seeds:
        for name in names:
            result = done[(seed, name)]
            result["ratio"] = result["loss"] / clean[seed]["loss"]
            results[name].append(result)
    out: dict[str, Any] = {"seeds": args.seeds, "attacks": {}}
    for name, rows in results.items():
        reasons: dict[str, int] = defaultdict(int)
        for row in rows:
            for reason, n in row["reasons"].items():
                reasons[reason] += n
        out["attacks"][name] = {
            "ratio": spread([r["ratio"] for r in rows]),
            "credited_tokens": [r["credited_tokens"] for r in rows],
            "claimed_tokens": [r["claimed_tokens"] for r in rows],
            "honest_rejected": [r["honest_rejected"] for r in rows],
            "attack_credited_tokens": [r["attack_credited_tokens"] for r in rows],
            "attack_claimed_tokens": [r["attack_claimed_tokens"] for r in rows],
            "reasons": dict(reasons),
        }
    out["draw"] = args.draw
    out["sleeper_rounds"] = args.sleeper_rounds
    out["score_windows"] = score_windows(config(args, args.seeds[0]))
    if unverified:
        out["clean_vs_unverified"] = spread(list(unverified.values()))
    out["clean"] = {
        "loss": spread([c["loss"] for c in clean.values()]),
        "honest_credited_tokens": [c["honest_credited_tokens"] for c in clean.values()],
        "honest_rejected": [c["honest_rejected"] for c in clean.values()],
        "reasons": [c["reasons"] for c in clean.values()],
    }
    per_unit = statistics.mean(c["train_seconds_per_unit"] for c in clean.values())
    per_contribution = statistics.mean(
        c["verify_cpu_seconds_per_contribution"] for c in clean.values()
    )
    out["overhead"] = {
        "verify_cpu_seconds_per_contribution": round(per_contribution, 4),
        "train_seconds_per_unit": round(per_unit, 4),
        "fraction": round(per_contribution / per_unit, 4),
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
