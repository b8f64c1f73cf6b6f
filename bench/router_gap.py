"""How much could any router gain over DiPaCo's k-means router? An oracle bound.

    .venv/bin/python bench/router_gap.py --work-dir /tmp/q/work      # quality.py's DiPaCo job
    .venv/bin/python bench/router_gap.py --quick

Trains bench/quality.py's b/dipaco-fp32 run (the same flags, config, cached base and
validation sample), then scores every validation window on every path:
  routed   each window on the path its document was routed to (the run's routed loss);
  oracle   each window on whichever path scores it best, chosen after seeing the loss: a
           bound on what any router (the paper's discriminative one included) could reach
           with these paths, since a router picks per document, before reading it;
  single   the best one path on every window (no routing at all).
Prints the losses, perplexities and the ratio oracle / routed perplexity: near 1, routing
does not hold DiPaCo back and a better router cannot close the gap to the dense model.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import quality  # bench/quality.py: the same flags, configs and cache
import torch

from dipaco.config import RunConfig
from dipaco.evaluate import ValWindows, window_losses
from dipaco.model import build_model
from dipaco.modular import assemble_path_state
from dipaco.simulate import DataBudget
from dipaco.simulate.base import prepare_with_base
from dipaco.simulate.train import Modules, train_dipaco


def oracle_gap(config: RunConfig, modules: Modules, windows: ValWindows) -> dict[str, Any]:
    """Routed, oracle and best-single-path losses of `modules` on `windows` (module doc)."""
    model = build_model(config.model, config.seed)
    all_windows = torch.cat(windows.per_path)  # (n, seq_len + 1), path 0's windows first
    scores = []
    for q in range(config.num_paths):  # every window scored on path q
        model.load_state_dict(assemble_path_state(config, q, modules))
        scores.append(window_losses(model, all_windows))
    losses = torch.stack(scores)  # (paths, n)
    routed_to = torch.cat(
        [torch.full((w.shape[0],), p, dtype=torch.long) for p, w in enumerate(windows.per_path)]
    )  # (n,)
    routed = float(losses.gather(0, routed_to[None]).mean())
    oracle = float(losses.min(0).values.mean())
    single = float(losses.mean(1).min())
    return {
        "routed_loss": routed,
        "oracle_loss": oracle,
        "single_path_loss": single,
        "oracle_vs_routed": math.exp(oracle - routed),
        "single_vs_routed": math.exp(single - routed),
        "oracle_agrees_with_router": float((losses.argmin(0) == routed_to).double().mean()),
        "windows": int(losses.shape[1]),
    }


def main(argv: list[str] | None = None) -> int:
    args = quality.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = quality.configs(args)["b-fp32"]
    budget = DataBudget(max_docs=args.max_docs or None)
    data, base = prepare_with_base(
        config, budget, args.work_dir, args.base_steps, batch_size=args.batch
    )
    windows = data.val_windows(config.model.seq_len, args.eval_windows, config.seed)
    run = train_dipaco(config, data, windows, base_state=base)
    report = {
        **oracle_gap(config, run.modules, windows),
        "run_routed_loss": run.rounds[-1].routed_loss,
        "curve": [r.routed_loss for r in run.rounds],
        "command": " ".join(["python", *sys.argv]),
    }
    for name in ("routed", "oracle", "single_path"):
        loss = report[f"{name}_loss"]
        print(f"{name:>11}: loss {loss:.4f}, perplexity {math.exp(loss):.2f}")
    print(
        f"oracle / routed perplexity {report['oracle_vs_routed']:.3f}, single path / routed "
        f"{report['single_vs_routed']:.3f}; the oracle picks the routed path on "
        f"{report['oracle_agrees_with_router']:.0%} of {report['windows']} windows"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
