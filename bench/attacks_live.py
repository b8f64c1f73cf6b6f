"""Attacks the way a user meets them: real `dipaco-worker` processes, some with a patched
encoder, against an embedded `dipaco server` at the run's defaults. Over 600 lines: the
runs, the figures read from each run's database and their summary stay in one script.

    .venv/bin/python bench/attacks_live.py --seeds 0 1 2 --json docs/figures/attacks_live.json
    .venv/bin/python bench/attacks_live.py --seeds 0 --rounds 2 --attack colluders   # a smoke

Per seed, a clean run and one run per attack, each on a fresh embedded server (SQLite,
filesystem broker, local blobs; bench/platform_run.py's machinery): `RunConfig.tiny()` 2x2
paths, one replica each, tf-idf router, random start, `--rounds` rounds of `--inner-steps`
steps, `--workers` workers enrolled with one ordinary enrollment token (so every one starts
on probation, workers.probation), every trust and replication setting at its default (the
bench strips DIPACO_* trust settings from its environment). Worker 0 attacks (the first half
of the workers, at least 2, for `colluders`): a `sitecustomize` module on its PYTHONPATH wraps the agent's
`worker_agent.handin.encode_deltas`, so the shipped agent trains honestly and uploads:

- `sign_flip`: -Δ; `colluders`: every attacker -Δ (identical bytes whenever they train
  the same unit from the same state: what copying each other's would upload);
- `lazy_x0.1`: 0.1 x Δ, claiming the whole unit's tokens; `zeros`: a zero Δ;
- `bias_0.5`: Δ plus a fixed unit direction per module (the same every unit) at 0.5 x
  the Δ's norm;
- `sleeper_bias_0.5`, `sleeper_flip`: honest for its first SLEEPER_HONEST (4) hand-ins,
  then `bias_0.5` or `sign_flip` (trust earned once must keep being earned):
  `credited_after_turn_share` is what it was credited beyond its first hand-ins' claims
  ÷ what its later ones claimed;
- `sleeper_rule_aware`: the sleeper who knows the rules: after SLEEPER_HONEST honest
  hand-ins, `bias_0.5` on every unit whose lease says `cold: false` (not replicated: no
  copy is compared with it), honest on the replicated ones;
- `scored_windows`: every step on the unit's first `score_windows` windows, the ones the old
  rule scored (the agent's unit source patched; the Δ handed in as trained, claiming the
  unit), and `sleeper_scored`, the same after SLEEPER_HONEST honest units. The lazy
  variants, a tenth of the steps rescaled to an honest norm, are in bench/attacks.py only:
  the agent trains every step of its unit.

Reported per attack, each per seed: `ratio` (final routed validation loss ÷ the clean
run's of that seed, the mean of its two with `--repeat-clean`; mean and spread), `credited_tokens` and `claimed_tokens` of the
attacker(s) (Worker.tokens_processed; the tokens its completed units claimed), and
`accepted` / `rejected` (the attackers' Δs) and `honest_rejected` (the honest workers'
rejected Δs), `reasons` (rejected Δs by side and code), `honest_refusals` (each honest
refusal in full: round, worker, role, module, reason), `honest_held` (the same for honest
Δs held, not refused: two agreeing copies that both bought nothing, rules.AGREED_NO_GAIN,
left out of the step and not counted against their workers, so not in `honest_rejected`); `first_round_seconds`: round 0's
wall time (open to the next round's open).
With `--json` the file is rewritten after each run, so a bench stopped early leaves what it
measured (`missing`: the runs asked for and not done; each attack's `seeds`).
Over every run: `max_honest_probation_rounds` (the most rounds an honest worker was seen on
probation, polled once a second: the rounds of its work while held) and
`honest_credit_held_share` (honest workers' credit still held at the end, on probation or
doubted, ÷ their credit held or granted: their accepted tokens x useful fraction).
From the clean runs: `replication_share`, tokens trained on check copies over all tokens
trained, and `steady_replication_share`, the same over the rounds that opened after every
worker had left probation (null when some never did); `clean.first_round_seconds`.

Two controls, since one run's loss moves with its schedule (which worker trains which path,
which units are replicated and so train cold):
- `--repeat-clean`: a second clean run per seed (`clean-repeat`); `clean_repeat_ratio`, the
  second ÷ the first, is the noise floor every ratio sits on.
- the honest-only baseline (`--honest-only`, default `colluders`): a stopped attacker takes
  its share of the work with it, and the honest workers left train every path of every
  round alone. Per seed a clean run with only that many workers (`clean-<n>w`, losses under
  `clean_honest_only`) measures what losing them costs by itself, and the attack's
  `ratio_vs_honest_only` what is left for the attack.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from platform_run import (
    corpus_file,
    default_config,
    mint_tokens,
    platform_modules,
    prepared_from_blobs,
    wait_for_state,
)

from dipaco.config import RunConfig
from dipaco.evaluate import routed_mean
from dipaco.flops import score_windows
from dipaco.simulate.train import evaluate_paths
from dipaco_demo.control import (
    AdminClient,
    DemoError,
    ServerProcess,
    embedded_environ,
    free_port,
)
from dipaco_demo.workers import WorkerProcess
from dipaco_server.rounds.verification import rules

ATTACKS = [
    "bias_0.5", "sign_flip", "colluders", "lazy_x0.1", "zeros",
    "sleeper_bias_0.5", "sleeper_flip", "scored_windows", "sleeper_scored",
    "sleeper_rule_aware",
]  # fmt: skip
# Trained every step on the windows the old rule scored (the unit's first score_windows):
# the agent's unit source is patched, its Δ handed in as trained.
SCORED = ("scored_windows", "sleeper_scored")
# A sleeper hands in this many units honestly, then attacks.
SLEEPER_HONEST = 4
CHECK_OFFSET = 1_000_000  # rounds' check copies' replica indices start here
# Trust and replication settings: unset, so the server runs at its defaults.
TRUST_SETTINGS = (
    "DIPACO_REPLICATION_RATE", "DIPACO_TRUST_REPLICATE_ALL", "DIPACO_MIN_TRUST",
    "DIPACO_TRUST_PENALTY", "DIPACO_TRUST_REWARD", "DIPACO_PROBATION_PARTNERS",
    "DIPACO_COLD_SHARE",
)  # fmt: skip
POLL_S = 1.0
DISTRUSTED = 8  # dipaco-worker's exit code when the server gives it no more work

# The patched encoder: the agent's own code, its Δ changed just before it is encoded.
SITECUSTOMIZE = """
import os
ATTACK = os.environ.get("DIPACO_LIVE_ATTACK", "")
if ATTACK:
    import zlib
    import torch
    import worker_agent.handin as _handin

    _encode = _handin.encode_deltas

    def _norm(delta):
        return float(sum(t.double().pow(2).sum() for t in delta.values()) ** 0.5)

    def _bias(module_id, delta):
        seed = int(os.environ.get("DIPACO_LIVE_SEED", "0")) * 1000 + zlib.crc32(module_id.encode())
        g = torch.Generator().manual_seed(seed)
        v = {k: torch.randn(t.shape, generator=g) for k, t in delta.items()}
        scale = 0.5 * _norm(delta) / max(_norm(v), 1e-30)
        return {k: t + scale * v[k].to(t.dtype) for k, t in delta.items()}

    def _attacked(module_id, delta):
        if ATTACK in ("sign_flip", "colluders", "sleeper_flip"):
            return {k: -t for k, t in delta.items()}
        if ATTACK == "lazy_x0.1":
            return {k: 0.1 * t for k, t in delta.items()}
        if ATTACK == "zeros":
            return {k: torch.zeros_like(t) for k, t in delta.items()}
        if ATTACK in ("bias_0.5", "sleeper_bias_0.5", "sleeper_rule_aware"):
            return _bias(module_id, delta)
        raise SystemExit(f"unknown DIPACO_LIVE_ATTACK {ATTACK!r}")

    HONEST_FIRST = int(os.environ.get("DIPACO_LIVE_HONEST_FIRST", "0"))
    _handed_in = [0]
    SCORED = ATTACK in ("scored_windows", "sleeper_scored")

    if SCORED:
        import worker_agent.unit as _unit

        _unit_source = _unit.unit_source
        _units = [0]

        class _ScoredOnly:
            # the unit's first K windows (what the old rule scored), over and over
            def __init__(self, source, k):
                self.source, self.k, self.rows = source, k, None

            def batch(self, position, batch_size, seq_len):
                inner = getattr(self.source, "source", self.source)  # SlowSource wraps it
                if self.rows is None:
                    self.rows = inner.batch(inner.first, self.k, seq_len)
                picks = (position - inner.first + torch.arange(batch_size)) % self.k
                return self.rows[picks]

            def close(self):
                self.source.close()

        def unit_source(*args, **kwargs):
            source = _unit_source(*args, **kwargs)
            _units[0] += 1
            if _units[0] <= HONEST_FIRST:  # a sleeper: honest for its first units
                return source
            return _ScoredOnly(source, int(os.environ["DIPACO_LIVE_SCORE_WINDOWS"]))

        _unit.unit_source = unit_source
        import worker_agent.agent as _agent  # it imported the name: patched there too

        _agent.unit_source = unit_source

    # The attacker who knows the rules: a lease's `cold` says its unit is replicated
    # (both copies train from fresh moments), so it biases only the units that say
    # otherwise, which no copy is compared with.
    _cold = [False]
    if ATTACK == "sleeper_rule_aware":
        _encode_unit = _handin._encode

        def _encode_with_lease(unit, data_dir):
            _cold[0] = bool(unit.grant.cold)
            return _encode_unit(unit, data_dir)

        _handin._encode = _encode_with_lease

    def encode_deltas(deltas, *args, **kwargs):
        if SCORED:  # trained on the scored windows, handed in as trained
            return _encode(deltas, *args, **kwargs)
        _handed_in[0] += 1
        if _handed_in[0] <= HONEST_FIRST:  # a sleeper: honest for its first hand-ins
            return _encode(deltas, *args, **kwargs)
        if _cold[0]:  # the rule-aware sleeper: a replicated unit, trained honestly
            return _encode(deltas, *args, **kwargs)
        changed = {m: _attacked(m, d) for m, d in deltas.items()}
        return _encode(changed, *args, **kwargs)

    _handin.encode_deltas = encode_deltas
"""


def attackers(attack: str | None, workers: int = 4) -> set[int]:
    """The attacking workers' indices: half of them (at least 2) for `colluders`, else 0."""
    if attack is None:
        return set()
    return set(range(max(2, workers // 2))) if attack == "colluders" else {0}


def one_run(
    config: RunConfig,
    attack: str | None,
    corpus: Path,
    root: Path,
    args: argparse.Namespace,
    workers_count: int | None = None,
) -> dict[str, Any]:
    """One run on a fresh embedded server, `workers_count` workers (default --workers); its
    figures (`figures`)."""
    count = args.workers if workers_count is None else workers_count
    data_dir = root / "server"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    environ = embedded_environ(data_dir, url)
    for name in TRUST_SETTINGS:
        environ.pop(name, None)
    if args.cold_share is not None:  # the server's DIPACO_COLD_SHARE (workers.trust)
        environ["DIPACO_COLD_SHARE"] = str(args.cold_share)
    environ["DIPACO_DATA_ROOTS"] = str(corpus.resolve().parent)
    patch = root / "patch"
    patch.mkdir(parents=True, exist_ok=True)
    (patch / "sitecustomize.py").write_text(SITECUSTOMIZE)
    server = ServerProcess(environ, port, root / "logs" / "server.log")
    workers: list[WorkerProcess] = []
    admin: AdminClient | None = None
    try:
        server.start()
        server.wait_until_healthy()
        api_token, enrollment = mint_tokens(environ, "attacks_live bench", count)
        admin = AdminClient(url, api_token)
        dataset = admin.dataset(f"corpus-{corpus.stem}", str(corpus))
        run_id = int(
            admin.create_run(config.name, config.model_dump(mode="json"), dataset["id"])["id"]
        )
        admin.move(run_id, "start")
        deadline = time.monotonic() + args.timeout
        wait_for_state(admin, run_id, "ready", ("draft", "preparing"), deadline)
        admin.move(run_id, "start")
        bad = attackers(attack, count)
        for i in range(count):
            env = dict(environ)
            if i in bad:
                path = f"{patch}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(patch)
                env.update(PYTHONPATH=path, DIPACO_LIVE_ATTACK=str(attack),
                           DIPACO_LIVE_SEED=str(config.seed),
                           DIPACO_LIVE_HONEST_FIRST=str(honest_first(attack)),
                           DIPACO_LIVE_SCORE_WINDOWS=str(score_windows(config)))  # fmt: skip
            worker = WorkerProcess(f"live-{i}", root / f"worker-{i}", root / "logs" / f"w{i}.log")
            worker.start(url, enrollment, env)
            workers.append(worker)
        on_probation: dict[str, set[int]] = {}
        probation_over, stopped = watch(admin, run_id, workers, deadline, on_probation)
        result = figures(data_dir, run_id, config, bad, probation_over, root, args, attack)
        honest = {f"live-{i}" for i in range(count) if i not in bad}
        rounds = [len(on_probation.get(name, ())) for name in sorted(honest)]
        return {
            **result,
            "stopped_as_distrusted": stopped,
            # rounds each honest worker was seen on probation (polled once a second)
            "honest_probation_rounds": rounds,
            "max_honest_probation_rounds": max(rounds, default=0),
        }
    finally:
        for worker in workers:
            worker.signal_stop()
        for worker in workers:
            worker.wait()
        if admin is not None:
            admin.close()
        server.stop()


def honest_first(attack: str | None) -> int:
    """The hand-ins an attacker makes honestly before it attacks: SLEEPER_HONEST for a
    sleeper, else 0."""
    return SLEEPER_HONEST if attack and attack.startswith("sleeper_") else 0


def watch(
    admin: AdminClient,
    run_id: int,
    workers: list[WorkerProcess],
    deadline: float,
    on_probation: dict[str, set[int]] | None = None,
) -> tuple[int | None, list[str]]:
    """Wait for the run to finish: (the first round that opened with no worker on
    probation, the workers the server stopped as distrusted, exit code 8). An attacker
    the server stops is the checks working; any other exit is the bench's failure.
    `on_probation` gathers, per worker name, the rounds in which it was seen on probation."""
    over: int | None = None
    stopped: set[str] = set()
    while True:
        try:
            status = admin.run(run_id)
        except DemoError as exc:  # a busy embedded server answers 503: ask again
            print(f"asking again: {exc}", file=sys.stderr)
            time.sleep(POLL_S)
            continue
        if status["state"] == "finished":
            return over, sorted(stopped)
        if status["state"] not in ("ready", "running"):
            raise RuntimeError(f"run {run_id} is {status['state']}: {status.get('error')}")
        for worker in workers:
            code = worker.exit_code()
            if code == DISTRUSTED:
                stopped.add(worker.name)
            elif code is not None:
                raise RuntimeError(f"{worker.name} exited with {code}; see {worker.log_path}")
        if len(stopped) == len(workers):
            raise RuntimeError("every worker was stopped as distrusted")
        try:
            rows = admin.call("GET", "/workers", params={"limit": 100})["items"]
        except DemoError as exc:  # a busy embedded server answers 503: ask again
            print(f"asking again: {exc}", file=sys.stderr)
            rows = []
        current = int(status.get("current_round") or 0)
        for row in rows:
            if row["probation"] and on_probation is not None:
                on_probation.setdefault(row["name"], set()).add(current)
        if (
            over is None
            and rows
            and not any(r["probation"] for r in rows if r["name"] not in stopped)
        ):
            over = current + 1  # opened from then on
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} did not finish in time; logs in its data dir")
        time.sleep(POLL_S)


def refusal_lines(rows: list[Any], attacker_ids: set[int]) -> list[str]:
    """Each honest worker's refused Δ in full: what a reader of the figure asks next."""
    return [
        f"round {t} worker {w} {'check copy' if replica >= CHECK_OFFSET else 'original'} "
        f"{module}: {reason}"
        for t, w, replica, module, reason in rows
        if w not in attacker_ids
    ]


def _run_rows(data_dir: Path, run_id: int, bad: set[int]) -> dict[str, Any]:
    """What `figures` reads from a finished run's database."""
    with sqlite3.connect(data_dir / "db.sqlite3") as db:
        names = dict(db.execute("SELECT id, name FROM workers_worker").fetchall())
        attacker_ids = {w for w, n in names.items() if int(n.split("-")[-1]) in bad}
        per_worker = db.execute(
            "SELECT l.worker_id, c.status, COUNT(*) FROM rounds_contribution c JOIN "
            "rounds_lease l ON l.id = c.lease_id GROUP BY l.worker_id, c.status"
        ).fetchall()
        why = db.execute(
            "SELECT l.worker_id, c.reason FROM rounds_contribution c JOIN rounds_lease l "
            "ON l.id = c.lease_id WHERE c.status = 'rejected'"
        ).fetchall()
        honest_why = db.execute(
            "SELECT r.t, l.worker_id, u.replica, m.module_id, c.reason FROM rounds_contribution c "
            "JOIN rounds_lease l ON l.id = c.lease_id JOIN rounds_workunit u ON u.id = l.unit_id "
            "JOIN rounds_round r ON r.id = u.round_id JOIN runs_module m ON m.id = c.module_id "
            "WHERE c.status = 'rejected' ORDER BY r.t"
        ).fetchall()
        # A completed lease's claim: the smallest token count among its contributions.
        leases = db.execute(
            "SELECT l.worker_id, u.replica, r.t, MIN(c.tokens) FROM rounds_lease l "
            "JOIN rounds_contribution c ON c.lease_id = l.id JOIN rounds_workunit u "
            "ON u.id = l.unit_id JOIN rounds_round r ON r.id = u.round_id GROUP BY l.id"
        ).fetchall()
        credited = dict(db.execute("SELECT id, tokens_processed FROM workers_worker").fetchall())
        held_of = dict(db.execute("SELECT id, held_tokens FROM workers_worker").fetchall())
        # each attacker lease's claim in the order it was granted: a sleeper's first ones
        # were honest
        ordered = db.execute(
            "SELECT l.worker_id, MIN(c.tokens) FROM rounds_lease l JOIN rounds_contribution c "
            "ON c.lease_id = l.id GROUP BY l.id ORDER BY l.id"
        ).fetchall()
        opened = dict(db.execute(
            "SELECT t, opened_at FROM rounds_round WHERE run_id = ?", (run_id,)
        ).fetchall())  # fmt: skip
    return {"names": names, "attacker_ids": attacker_ids, "per_worker": per_worker, "why": why,
            "honest_why": honest_why, "leases": leases, "credited": credited,
            "held_of": held_of, "ordered": ordered, "opened": opened}  # fmt: skip


def figures(
    data_dir: Path,
    run_id: int,
    config: RunConfig,
    bad: set[int],
    probation_over: int | None,
    root: Path,
    args: argparse.Namespace,
    attack: str | None = None,
) -> dict[str, Any]:
    blobs = data_dir / "blobs"
    data = prepared_from_blobs(blobs, run_id, root / "prepared")
    windows = data.val_windows(config.model.seq_len, args.eval_windows)
    final = platform_modules(blobs, run_id, config, config.rounds)
    loss = routed_mean(evaluate_paths(config, final, windows))
    rows = _run_rows(data_dir, run_id, bad)
    names, attacker_ids, per_worker = rows["names"], rows["attacker_ids"], rows["per_worker"]
    why, honest_why, leases = rows["why"], rows["honest_why"], rows["leases"]
    credited, held_of, ordered, opened = (
        rows["credited"],
        rows["held_of"],
        rows["ordered"],
        rows["opened"],
    )
    reasons: dict[str, int] = {}  # "<attacker|honest> <code>" -> rejected Δs
    for worker_id, reason in why:
        key = f"{'attacker' if worker_id in attacker_ids else 'honest'} {reason.split(':')[0]}"
        reasons[key] = reasons.get(key, 0) + 1
    held = [row for row in honest_why if row[4].startswith(f"{rules.AGREED_NO_GAIN}:")]
    honest_held = refusal_lines(held, attacker_ids)
    counts: dict[tuple[bool, str], int] = {}
    for worker_id, status, n in per_worker:
        side = (worker_id in attacker_ids, status)
        counts[side] = counts.get(side, 0) + n
    check = [t for _, replica, _, t in leases if replica >= CHECK_OFFSET]
    steady = [(replica, t) for _, replica, rnd, t in leases
              if probation_over is not None and rnd >= probation_over]  # fmt: skip
    honest_ids = set(names) - attacker_ids
    honest_held_tokens = sum(held_of.get(w, 0) for w in honest_ids)
    honest_earned = sum(credited.get(w, 0) for w in honest_ids) + honest_held_tokens
    turned = _after_turn(ordered, attacker_ids, honest_first(attack))
    return {
        "loss": loss,
        "credited_tokens": sum(credited.get(w, 0) for w in attacker_ids),
        # a sleeper's claims after its first SLEEPER_HONEST hand-ins, and at most what it
        # was credited beyond the claims of those (its honest units' credit is at most
        # what they claimed)
        **turned,
        # honest workers' credit still held at the end (probation, doubt), and their
        # credit held or granted (accepted tokens x useful fraction)
        "honest_held_tokens": honest_held_tokens,
        "honest_earned_tokens": honest_earned,
        "claimed_tokens": sum(t for w, _, _, t in leases if w in attacker_ids),
        "accepted": counts.get((True, "accepted"), 0),
        "rejected": counts.get((True, "rejected"), 0),
        # Held Δs (rules.AGREED_NO_GAIN: two agreeing copies that both bought nothing) are
        # left out of the step but not counted against their workers: listed apart.
        "honest_rejected": counts.get((False, "rejected"), 0) - len(honest_held),
        "reasons": reasons,
        "honest_refusals": refusal_lines(
            [row for row in honest_why if row not in held], attacker_ids
        ),
        "honest_held": honest_held,
        "replication_share": sum(check) / max(1, sum(t for *_, t in leases)),
        "steady_replication_share": (
            sum(t for r, t in steady if r >= CHECK_OFFSET) / sum(t for _, t in steady)
            if steady
            else None
        ),
        "probation_over_round": probation_over,
        "first_round_seconds": _seconds_between(opened.get(0), opened.get(1)),
    }


def _after_turn(ordered: list[Any], attacker_ids: set[int], honest: int) -> dict[str, int]:
    """{} for an attacker that attacks from its first hand-in; else the tokens its first
    `honest` leases claimed (`claimed_before_turn`) and those its later ones claimed
    (`claimed_after_turn`); `summary` takes what it was credited beyond the first as its
    credit after it turned (an upper bound: its honest units earn at most their claims)."""
    if not honest or not attacker_ids:
        return {}
    seen: dict[int, int] = {}
    before = after = 0
    for worker_id, tokens in ordered:
        if worker_id not in attacker_ids:
            continue
        seen[worker_id] = seen.get(worker_id, 0) + 1
        if seen[worker_id] <= honest:
            before += tokens
        else:
            after += tokens
    return {"claimed_before_turn": before, "claimed_after_turn": after}


def _seconds_between(start: Any, end: Any) -> float | None:
    from datetime import datetime

    if not start or not end:
        return None
    return round(
        (datetime.fromisoformat(str(end)) - datetime.fromisoformat(str(start))).total_seconds(), 1
    )


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "mean": round(statistics.mean(values), 4),
        "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "per_seed": [round(v, 4) for v in values],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--attack", action="append", choices=ATTACKS, help="default: all")
    parser.add_argument("--corpus-chars", type=int, default=2_000_000)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument(
        "--cold-share", type=float, default=None, metavar="SHARE",
        help="the server's DIPACO_COLD_SHARE: the share of unreplicated units that train cold "
        "too (1: every unit, so a lease's `cold` hides which are audited); default: unset",
    )  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep each run's server folder")
    parser.add_argument("--no-clean", action="store_true",
                        help="skip the clean runs: the attack runs' counts and refusals only")  # fmt: skip
    parser.add_argument(
        "--honest-only",
        action="append",
        choices=ATTACKS,
        help="also run a clean run with only the honest workers of this attack (the workers "
        "left once its attackers are stopped) and report the attack's ratio to it too "
        "(`ratio_vs_honest_only`); default: colluders, where half the workers are stopped",
    )
    parser.add_argument(
        "--repeat-clean",
        action="store_true",
        help="run each seed's clean run twice: the attacks' ratios are to the mean of the "
        "two, and `clean_repeat_ratio` (the second ÷ the first) is the bench's noise floor",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    names: list[str | None] = [*([] if args.no_clean else [None]), *(args.attack or ATTACKS)]
    if not args.no_clean:  # the repeat, then the honest-only clean runs (one per count)
        names += [*(["clean-repeat"] if args.repeat_clean else []), *honest_labels(args)]
    done: dict[tuple[int, str], dict[str, Any]] = {}
    if args.work_dir is not None:  # a folder that does not exist yet is made, not refused
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="attacks-live-", dir=args.work_dir))
    try:  # a failed run's folder stays for its logs
        corpus = corpus_file("stdlib", root / "corpus", args.corpus_chars)
        for seed in args.seeds:
            config = default_config(rounds=args.rounds, inner_steps=args.inner_steps, seed=seed,
                                    name=f"attacks-live-{seed}")  # fmt: skip
            config = config.model_copy(update={"data": config.data.model_copy(
                update={"corpus": str(corpus)})})  # fmt: skip
            for name in names:
                label = name or "clean"
                clock = time.perf_counter()
                if label.startswith("clean-"):  # clean-repeat, or clean-<n>w: n workers
                    count = int(label[6:-1]) if label.endswith("w") else args.workers
                    result = one_run(config, None, corpus, root / f"{seed}-{label}", args, count)
                else:
                    result = one_run(config, name, corpus, root / f"{seed}-{label}", args)
                result["seconds"] = round(time.perf_counter() - clock, 1)
                done[(seed, label)] = result
                print(f"seed {seed} {label:10s} " + json.dumps(result), flush=True)
                if not args.keep:
                    shutil.rmtree(root / f"{seed}-{label}", ignore_errors=True)
                if args.json:  # what is done so far, should the bench be stopped early
                    write(args.json, summary(done, args), started, argv)
    except Exception:
        print(f"a run failed; its logs are kept in {root}", file=sys.stderr)
        raise
    if args.keep:
        print(f"the runs' folders are kept in {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    out = write(args.json, summary(done, args), started, argv)
    print(json.dumps(out, indent=2))
    return 0


def _after_turn_share(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A sleeper's credit after it turned ÷ what it claimed after it turned, over the seeds
    (the goal: at most 0.25); {} for other attacks."""
    if not rows or "claimed_after_turn" not in rows[0]:
        return {}
    credited = [max(0, r["credited_tokens"] - r["claimed_before_turn"]) for r in rows]
    claimed = [r["claimed_after_turn"] for r in rows]
    return {
        "credited_after_turn": credited,
        "claimed_after_turn": claimed,
        "credited_after_turn_share": round(sum(credited) / max(1, sum(claimed)), 4),
    }


def honest_counts(args: argparse.Namespace) -> list[int]:
    """The worker counts of the honest-only clean runs (`--honest-only`), ascending."""
    chosen = ["colluders"] if args.honest_only is None else args.honest_only
    asked = set(args.attack or ATTACKS)
    return sorted({args.workers - len(attackers(a, args.workers)) for a in chosen if a in asked})


def honest_labels(args: argparse.Namespace) -> list[str]:
    return [f"clean-{n}w" for n in honest_counts(args)]


def clean_loss(done: dict[tuple[int, str], dict[str, Any]], seed: int) -> float:
    """The seed's clean loss: the mean of its clean runs (two with --repeat-clean)."""
    return statistics.mean(
        done[(seed, label)]["loss"] for label in ("clean", "clean-repeat") if (seed, label) in done
    )


def write(
    path: Path | None, out: dict[str, Any], started: float, argv: list[str] | None
) -> dict[str, Any]:
    out["seconds"] = round(time.perf_counter() - started, 1)
    out["command"] = "bench/attacks_live.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if path:
        path.write_text(json.dumps(out, indent=2) + "\n")
    return out


def honest_only_ratio(
    done: dict[tuple[int, str], dict[str, Any]],
    name: str,
    seeds: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The attack's loss ÷ the clean run's with only its honest workers (`--honest-only`),
    over the seeds where both are done; {} where none is."""
    count = args.workers - len(attackers(name, args.workers))
    label = f"clean-{count}w"
    if count not in honest_counts(args):
        return {}
    pairs = [(done[(s, name)], done[(s, label)]) for s in seeds if (s, label) in done]
    if not pairs:
        return {}
    return {
        "honest_only_workers": count,
        "ratio_vs_honest_only": spread([r["loss"] / c["loss"] for r, c in pairs]),
    }


def controls(
    done: dict[tuple[int, str], dict[str, Any]], seeds: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """The honest-only clean runs' losses (`clean_honest_only`, by label) and the repeated
    clean runs' (`clean_repeat_loss`, `clean_repeat_ratio`), where any was run."""
    out: dict[str, Any] = {}
    honest_only = {
        label: spread([done[(s, label)]["loss"] for s in seeds if (s, label) in done])
        for label in honest_labels(args)
        if any((s, label) in done for s in seeds)
    }
    if honest_only:  # the loss of the clean runs with fewer workers, by label
        out["clean_honest_only"] = honest_only
    repeated = [s for s in seeds if (s, "clean-repeat") in done]
    if repeated:  # one seed's clean run against itself: the noise floor of every ratio
        out["clean_repeat_loss"] = spread([done[(s, "clean-repeat")]["loss"] for s in repeated])
        out["clean_repeat_ratio"] = spread(
            [done[(s, "clean-repeat")]["loss"] / done[(s, "clean")]["loss"] for s in repeated]
        )
    return out


# Each run's figures listed per seed in the summary: an attack's, and the clean runs'.
ATTACK_KEYS = (
    "credited_tokens", "claimed_tokens", "honest_rejected", "honest_held", "accepted",
    "rejected", "reasons", "honest_refusals", "stopped_as_distrusted", "first_round_seconds",
    "max_honest_probation_rounds", "seconds",
)  # fmt: skip
CLEAN_KEYS = (
    "honest_rejected", "honest_held", "reasons", "honest_refusals", "first_round_seconds",
    "probation_over_round", "max_honest_probation_rounds", "honest_probation_rounds",
    "honest_held_tokens", "honest_earned_tokens", "seconds", "replication_share",
    "steady_replication_share",
)  # fmt: skip


def summary(
    done: dict[tuple[int, str], dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """The figures of the runs done: each attack over the seeds whose clean run and its
    run are done (`missing`: the runs asked for that are not, when the bench stopped early)."""
    seeds = [s for s in args.seeds if (s, "clean") in done]
    clean_of = {s: done[(s, "clean")] for s in seeds}
    out: dict[str, Any] = {"seeds": seeds, "rounds": args.rounds, "inner_steps": args.inner_steps,
                           "workers": args.workers, "cold_share": args.cold_share,
                           "attacks": {}}  # fmt: skip
    repeat = ["clean-repeat"] if args.repeat_clean else []
    labels = ["clean", *(args.attack or ATTACKS), *repeat, *honest_labels(args)]
    asked = [(s, n) for s in args.seeds for n in labels]
    if any(key not in done for key in asked):
        out["missing"] = [f"seed {s} {n}" for s, n in asked if (s, n) not in done]
    for name in args.attack or ATTACKS:
        with_seed = [s for s in seeds if (s, name) in done]
        if not with_seed:
            continue
        rows = [done[(s, name)] for s in with_seed]
        out["attacks"][name] = {
            "seeds": with_seed,
            "ratio": spread([done[(s, name)]["loss"] / clean_loss(done, s) for s in with_seed]),
            **honest_only_ratio(done, name, with_seed, args),
            # credited ÷ claimed over the seeds (the bias goal's figure)
            "credited_share": round(
                sum(r["credited_tokens"] for r in rows)
                / max(1, sum(r["claimed_tokens"] for r in rows)),
                4,
            ),
            **_after_turn_share(rows),
            **{k: [r[k] for r in rows] for k in ATTACK_KEYS},
        }
    runs = list(done.values()) or [{}]
    # over every run done, clean and attacked: the most rounds an honest worker was seen on
    # probation, and the honest workers' credit still held at the end over their credit
    # held or granted (their accepted tokens x useful fraction)
    out["max_honest_probation_rounds"] = max(r.get("max_honest_probation_rounds", 0) for r in runs)
    out["honest_credit_held_share"] = round(
        sum(r.get("honest_held_tokens", 0) for r in runs)
        / max(1, sum(r.get("honest_earned_tokens", 0) for r in runs)),
        4,
    )
    clean = list(clean_of.values())
    if not clean:
        return out
    out["clean"] = {
        "loss": spread([c["loss"] for c in clean]),
        **{k: [c[k] for c in clean] for k in CLEAN_KEYS},
    }
    out.update(controls(done, seeds, args))
    out["replication_share"] = round(statistics.mean(c["replication_share"] for c in clean), 4)
    steady = [c["steady_replication_share"] for c in clean]
    out["steady_replication_share"] = (
        round(statistics.mean(steady), 4) if all(v is not None for v in steady) else None
    )
    out["replication_share_per_seed"] = [round(c["replication_share"], 4) for c in clean]
    out["steady_replication_share_per_seed"] = [None if v is None else round(v, 4) for v in steady]
    return out


if __name__ == "__main__":
    sys.exit(main())
