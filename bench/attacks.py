"""One attacker among four workers: what each attack does to a run, and what it is credited.

    .venv/bin/python bench/attacks.py --json docs/figures/attacks.json   # ~10 min on 2 cores

A short DiPaCo 2x2 run with R=1 (dipaco.simulate's round loop: four units a round, one per
path, each trained by its own simulated worker with warm AdamW state) in which worker 0
attacks every round. Every upload then goes through the server's own checks, in the
server's order: the completion's token bound (rounds.complete refuses a unit claiming more
tokens than H x batch x seq_len), the codec check and the round-median outlier rule
(rounds.outer_step), then rounds.verify (replay, norm against the module's history,
direction against its outer momentum, proof of useful work on the unit's own windows and
on held-out windows), then clipped-mean aggregation and the outer step (dipaco.outer).

Reported per attack: the final routed validation loss ÷ that of the clean run with the same
seed (`ratio`), and the tokens credited to the attacker (a unit is credited only when every
one of its contributions was accepted, as the server does). `clean_vs_unverified` is the
clean run ÷ the same run with verification switched off (outer.verify false, plain mean:
the platform before issue 19). `overhead` is the verification's CPU seconds per
contribution (scoring and screening) ÷ the worker's training seconds for one unit.

Attacks: sign flip; scaled x10, x1e3 and to the fp16 maximum; Gaussian noise of the honest
norm; zeros (free rider); a Δ replayed from an earlier round (byte-identical); a Δ computed
for another path; a Δ computed against a stale base version (the previous round's
modules); an honest Δ whose completion claims 100x the tokens the unit allowed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from dipaco import codecs
from dipaco.config import RunConfig
from dipaco.data.windows import path_seed, unit_start, unit_windows
from dipaco.evaluate import routed_mean, stream_windows
from dipaco.inner import InnerState, train_path
from dipaco.model import build_model
from dipaco.modular import module_ids, module_spec, modules_of_path
from dipaco.outer import DeltaAccumulator, delta_norm, norm_outliers, outer_lr, outer_step
from dipaco.simulate import DataBudget
from dipaco.simulate.base import prepare_with_base
from dipaco.simulate.train import evaluate_paths
from dipaco_server.rounds import verify

ATTACKS = [
    "sign_flip", "scale_x10", "scale_x1e3", "scale_fp16_max", "gaussian_noise", "zeros",
    "replay", "other_path", "stale_base", "token_inflation_x100",
]  # fmt: skip
ATTACKER = 0  # worker 0 trains path 0 every round
FP16_MAX = 65504.0

Modules = dict[str, dict[str, Tensor]]


def config(args: argparse.Namespace, **outer: Any) -> RunConfig:
    layers = RunConfig.tiny().model.num_layers
    from dipaco.config import LayoutConfig

    return RunConfig.tiny(
        name="attacks", rounds=args.rounds, replicas_per_path=1,
        layout=LayoutConfig.grid(layers, 2, 2), seed=args.seed,
        inner={"steps": args.inner_steps, "lr": 3e-3, "warmup_steps": 5,
               "micro_batch_size": args.batch},
        data={"val_fraction": 0.05, "corpus": args.corpus}, outer=outer,
    )  # fmt: skip


def unit_token_cap(cfg: RunConfig) -> int:
    """dipaco.data.windows.unit_tokens: the most tokens a unit can claim."""
    return unit_windows(cfg) * cfg.model.seq_len


def attacked(name: str, delta: dict[str, Tensor], rng: torch.Generator) -> dict[str, Tensor]:
    """The attacker's version of one module's honest Δ."""
    if name == "sign_flip":
        return {k: -v for k, v in delta.items()}
    if name == "scale_x10":
        return {k: v * 10 for k, v in delta.items()}
    if name == "scale_x1e3":
        return {k: v * 1e3 for k, v in delta.items()}
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


def run(cfg: RunConfig, attack: str | None, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    data, base = prepare_with_base(cfg, DataBudget(), args.work_dir, args.base_steps)
    windows = data.val_windows(cfg.model.seq_len, args.eval_windows)
    seq = cfg.model.seq_len
    sources = [data.train_source(p, seq, path_seed(cfg, p)) for p in range(cfg.num_paths)]
    heldout = [stream_windows(data.val_tokens(p), seq)[-cfg.outer.score_windows :]
               for p in range(cfg.num_paths)]  # fmt: skip
    from dipaco.modular import init_modules_from_base

    assert base is not None  # prepare_with_base trained or loaded it
    modules: Modules = init_modules_from_base(cfg, base)
    previous: Modules = {m: dict(t) for m, t in modules.items()}  # the stale base
    momentum: Modules = {}
    history: dict[str, list[list[float]]] = defaultdict(list)  # module -> norms per round
    seen: set[str] = set()
    states: dict[tuple[int, int], InnerState] = {}
    replayable: dict[str, bytes] = {}
    credited: dict[int, int] = defaultdict(int)
    reasons: dict[str, int] = defaultdict(int)
    rng = torch.Generator().manual_seed(cfg.seed + 7)
    model = build_model(cfg.model, cfg.seed)
    cap = unit_token_cap(cfg)
    train_seconds, verify_seconds, contributions_scored = 0.0, 0.0, 0
    for t in range(cfg.rounds):
        # (worker, path, module, encoded Δ, tokens)
        uploads: list[tuple[int, int, str, bytes, int]] = []
        for p in range(cfg.num_paths):
            worker = p
            evil = attack if worker == ATTACKER else None
            trained_path, start_from = p, modules
            if evil == "other_path":
                trained_path = (p + 1) % cfg.num_paths
            if evil == "stale_base":
                start_from = previous
            clock = time.perf_counter()
            result = train_path(
                cfg, trained_path, start_from, sources[trained_path], round_index=t,
                start_position=unit_start(cfg, t, 0), state=states.get((worker, trained_path)),
            )  # fmt: skip
            train_seconds += time.perf_counter() - clock
            state = result.state or InnerState()
            states[(worker, trained_path)] = state
            own = modules_of_path(cfg, p)
            trained = modules_of_path(cfg, trained_path)
            tokens = result.tokens * (100 if evil == "token_inflation_x100" else 1)
            for module_id, source_id in zip(own, trained, strict=True):
                delta = result.module_deltas[source_id]
                if evil is None or evil in ("other_path", "stale_base", "token_inflation_x100"):
                    encoded, residual = codecs.encode_with_feedback(
                        delta, cfg.comm.codec, state.module_residual(source_id),
                        block_size=cfg.comm.block_size,
                    )  # fmt: skip
                    state.set_module_residual(source_id, residual)
                elif evil == "replay":
                    fresh = codecs.encode(delta, cfg.comm.codec, block_size=cfg.comm.block_size)
                    encoded = replayable.setdefault(module_id, fresh)  # round 0's, ever after
                else:
                    bad = attacked(evil, delta, rng)
                    encoded = codecs.encode(bad, cfg.comm.codec, block_size=cfg.comm.block_size)
                uploads.append((worker, p, module_id, encoded, tokens))
        previous = {m: dict(v) for m, v in modules.items()}
        # rounds.complete: a unit claiming more tokens than it holds is refused outright.
        refused_units = {(w, p) for w, p, _, _, n in uploads if n > cap}
        for _ in refused_units:
            reasons["completion_refused: tokens above H x batch x seq_len"] += 1
        uploads = [u for u in uploads if (u[0], u[1]) not in refused_units]
        lr = outer_lr(cfg.outer, t)
        accepted_units: dict[tuple[int, int], bool] = defaultdict(lambda: True)
        base_cache: dict[int, tuple[float, float]] = {}
        round_base = {m: dict(v) for m, v in modules.items()}  # what the units started from
        seen_now: set[str] = set()
        for module_id in module_ids(cfg):
            mine = [u for u in uploads if u[2] == module_id]
            if not mine:
                continue
            spec = module_spec(cfg, module_id)
            decoded: list[tuple[dict[str, Tensor], float] | None] = []
            verdicts: list[str] = []
            for _w, _p, _, encoded, _n in mine:
                try:
                    delta = codecs.decode(encoded, spec)
                    norm = delta_norm(delta)
                    if not math.isfinite(norm):
                        raise codecs.CodecError("norm_overflow", "its norm overflows fp32")
                except codecs.CodecError as exc:
                    verdicts.append(f"{exc.code}: {exc}")
                    decoded.append(None)
                    continue
                verdicts.append("")
                decoded.append((delta, norm))
            ok = [i for i, v in enumerate(verdicts) if not v]
            norms = [decoded[i][1] for i in ok]  # type: ignore[index]
            for i, outlier in zip(
                ok, norm_outliers(norms, cfg.outer.reject_norm_factor), strict=True
            ):
                if outlier:
                    verdicts[i] = "norm_outlier: above reject_norm_factor x the round's median"
            candidates = []
            for i, (_w, p, _, encoded, _n) in enumerate(mine):
                if verdicts[i]:
                    continue
                delta, norm = decoded[i]  # type: ignore[misc]
                clock = time.process_time()
                score, cos = None, None
                if cfg.outer.verify:
                    if module_id in momentum:
                        cos = verify.cosine(delta, momentum[module_id])
                    if cfg.outer.score:
                        train_w = sources[p].batch(
                            unit_start(cfg, t, 0), cfg.outer.score_windows, seq
                        )
                        unit = {  # the unit's whole Δ: every module it uploaded
                            m: codecs.decode(e, module_spec(cfg, m))
                            for w, q, m, e, _ in uploads
                            if (w, q) == (mine[i][0], p)
                        }
                        score = verify.score_delta(
                            cfg, p, model, round_base, unit, train_w, heldout[p],
                            before=base_cache.get(p),
                        )  # fmt: skip
                        base_cache[p] = (score.train_before, score.heldout_before)
                    contributions_scored += 1
                candidates.append(
                    verify.Candidate(i, norm, hashlib.sha256(encoded).hexdigest(), cos, score)
                )
                verify_seconds += time.process_time() - clock
            past = [n for r in history[module_id][-cfg.outer.history_rounds :] for n in r]
            if args.verbose:
                for c in candidates:
                    sc = c.score
                    print(
                        f"  t={t} {module_id:6s} w{mine[c.key][0]} norm {c.norm:.3g} "
                        f"ref {verify.norm_reference(past) or 0:.3g} cos {c.cosine} "
                        + (
                            f"gain {sc.gain:.4f} held {sc.heldout_after - sc.heldout_before:+.4f}"
                            if sc
                            else ""
                        ),
                        file=sys.stderr,
                    )
            clock = time.process_time()
            for i, why in verify.screen(candidates, past, cfg.outer, seen=seen).items():
                verdicts[i] = why
            verify_seconds += time.process_time() - clock
            for c in candidates:
                seen_now.add(c.sha256)  # replays are judged against earlier rounds
            good = [i for i, v in enumerate(verdicts) if not v]
            for i, v in enumerate(verdicts):
                if v:
                    accepted_units[(mine[i][0], mine[i][1])] = False
                    who = "" if mine[i][0] == ATTACKER else "honest "
                    reasons[who + v.split(":")[0]] += 1
                else:
                    accepted_units[(mine[i][0], mine[i][1])] &= True
            if not good:
                continue
            good_norms = [decoded[i][1] for i in good]  # type: ignore[index]
            limit = None
            if cfg.outer.robust == "clipped-mean":
                limit = verify.clip_limit(good_norms, past, cfg.outer)
            acc = DeltaAccumulator(spec, token_weighting=cfg.outer.token_weighting, clip_norm=limit)
            for i in good:
                acc.add(decoded[i][0], mine[i][4])  # type: ignore[index]
            grad = acc.mean()
            # What the server keeps per step: the median of the accepted norms (OuterStep).
            history[module_id].append([statistics.median(good_norms)])
            modules[module_id], momentum[module_id] = outer_step(
                modules[module_id], grad, momentum.get(module_id), cfg.outer, lr=lr
            )
        seen |= seen_now
        for (worker, p), ok_unit in accepted_units.items():
            if ok_unit:
                credited[worker] += next(u[4] for u in uploads if (u[0], u[1]) == (worker, p))
    losses = evaluate_paths(cfg, modules, windows)
    units = cfg.rounds * cfg.num_paths
    return {
        "loss": routed_mean(losses),
        "credited_tokens": credited[ATTACKER],
        "honest_credited_tokens": sum(v for w, v in credited.items() if w != ATTACKER),
        "reasons": dict(reasons),
        "train_seconds_per_unit": train_seconds / units,
        "verify_cpu_seconds_per_contribution": verify_seconds / max(1, contributions_scored),
    }


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="each Δ's checks, on stderr")
    parser.add_argument("--no-unverified", action="store_true", help="skip the unverified run")
    parser.add_argument("--attack", action="append", choices=ATTACKS, help="default: all")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/dipaco/simulate")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    clean = run(config(args), None, args)
    unverified = (
        clean if args.no_unverified else run(config(args, verify=False, robust="mean"), None, args)
    )
    print(f"clean {clean['loss']:.4f}; unverified {unverified['loss']:.4f}", flush=True)
    out: dict[str, Any] = {"attacks": {}}
    for name in args.attack or ATTACKS:
        result = run(config(args), name, args)
        ratio = result["loss"] / clean["loss"]
        out["attacks"][name] = {
            "ratio": round(ratio, 4),
            "credited_tokens": result["credited_tokens"],
            "reasons": result["reasons"],
        }
        print(f"{name:22s} ratio {ratio:.4f} credited {result['credited_tokens']:7d} "
              f"{result['reasons']}", flush=True)  # fmt: skip
    out["clean_vs_unverified"] = round(clean["loss"] / unverified["loss"], 4)
    out["clean"] = {
        "loss": round(clean["loss"], 4),
        "honest_credited_tokens": clean["honest_credited_tokens"],
        "reasons": clean["reasons"],
    }
    per_unit, per_contribution = (
        clean["train_seconds_per_unit"],
        clean["verify_cpu_seconds_per_contribution"],
    )
    out["overhead"] = {
        "verify_cpu_seconds_per_contribution": round(per_contribution, 4),
        "train_seconds_per_unit": round(per_unit, 4),
        "fraction": round(per_contribution / per_unit, 4),
    }
    out["command"] = "bench/attacks.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
