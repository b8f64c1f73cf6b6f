"""The demo from start to summary: server, tokens, run, workers, baselines, summary.

The run has the paper's two phases unless --phase1-rounds 0 (runs.phases): the workers
train a dense DiLoCo model first; between the phases the server's Celery tasks embed every
document with it, fit the router, write the shards and copy it into every module; then the
workers train DiPaCo. The demo follows the phases through the admin API (``phase``,
``progress``); the dense baselines need phase 2's shards and its starting model, so they
start when phase 2 does.

Every step goes through the product's own interfaces: `dipaco server`, the admin API
with a staff token, `dipaco-worker` processes enrolled with an enrollment token, the
inference API for the sample. After the summary the server keeps serving the dashboard
until Ctrl+C when `DemoOptions.serve` says so (the command line's default on a terminal).
Stopping (Ctrl+C, SIGTERM, an error) always runs the same path: stop the baselines,
cancel the run if it is still going, stop the workers (they release their leases), then
stop the server (it stops its children).
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from dipaco.config import RunConfig
from dipaco.evaluate import perplexity, weighted_mean
from dipaco.inner import StepMetrics
from dipaco_demo import baseline, control, plan, records, summary
from dipaco_demo.control import AdminClient, DemoError, ServerProcess
from dipaco_demo.display import DemoDisplay
from dipaco_demo.workers import WorkerPool

POLL_S = 1.0
LIVE_STATES = ("preparing", "ready", "running", "paused")
SAMPLE_PROMPT = "import os\n\n\ndef "


@dataclass(frozen=True)
class DemoOptions:
    plan: plan.DemoPlan
    data_dir: Path
    port: int | None = None  # None: 8000, or a free port when 8000 is taken
    serve: bool = False  # keep serving the dashboard after the summary, until Ctrl+C
    json_path: Path | None = None
    prompt: str = SAMPLE_PROMPT
    baselines: bool = True  # train the two dense baselines (--no-baselines: skip them)


class BaselineThread(threading.Thread):
    """The dense baselines, one after the other, trained beside the run (they fill the
    cores while rounds close)."""

    def __init__(self, data: baseline.RunData, display: DemoDisplay) -> None:
        super().__init__(name="dense-baselines", daemon=True)
        self.data, self.display = data, display
        self.stop = threading.Event()
        self.results: list[baseline.DenseResult] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        def on_step(m: StepMetrics) -> None:
            self.display.update(dense_step=m.step, dense_loss=m.loss)

        try:
            for dense in baseline.DENSE_BASELINES:
                steps = baseline.dense_steps(self.data.config, dense)
                self.display.update(
                    dense_name=f"equal {dense.equal}", dense_step=0, dense_steps=steps,
                    dense_loss=None,
                )  # fmt: skip
                result = baseline.train_dense(
                    self.data, dense, on_step=on_step, should_stop=self.stop.is_set
                )
                if result is None:
                    return
                self.results.append(result)
        except Exception as exc:  # reported by the main thread, which stops the demo
            self.error = exc


def reset_staff_password() -> str:
    """A fresh password for the demo's staff user, to print: the demo is one person's
    sandbox, and a password nobody was shown would leave the staff pages out of reach."""
    # Django: set up by control.setup_django once the server is up
    from django.contrib.auth import get_user_model
    from django.db import connections

    password = secrets.token_urlsafe(12)
    user = get_user_model().objects.get(username=control.STAFF_USER)
    user.set_password(password)
    user.save(update_fields=["password"])
    connections.close_all()
    return password


def sign_in_line(url: str, password: str, data_dir: Path) -> str:
    """How a person signs in as staff, and adds more staff, on this demo's server."""
    return (
        f"staff sign-in at {url}/login/: user {control.STAFF_USER}, password {password} "
        f"(new each demo; more staff: dipaco admin --data-dir {data_dir} createuser NAME --staff)"
    )


class Demo:
    def __init__(self, options: DemoOptions, console: Console) -> None:
        self.options, self.console = options, console
        self.data_dir = options.data_dir
        self.logs = self.data_dir / "logs"
        self.server: ServerProcess | None = None
        self.workers: WorkerPool | None = None
        self.admin: AdminClient | None = None
        self.baseline: BaselineThread | None = None
        self.run_id: int | None = None
        self.api_token = ""
        self.staff_password = ""
        self.display = DemoDisplay(console)
        # Known once phase 2 opens: its shards, and the losses where it starts.
        self.data: baseline.RunData | None = None
        self.initial: dict[int, float] = {}  # per path, the seeded weights
        self.before: dict[int, float] = {}  # per path, phase 2's start
        self.phase1_losses: dict[int, float] = {}  # round -> the dense model's val loss

    # --- the whole demo -----------------------------------------------------------------

    def run(self) -> int:
        started = time.monotonic()
        try:
            with self.display:
                result = self._train(started)
            result.render(self.console)
            self._save(result)
            if self.options.serve:
                self._serve(result)
            else:
                self._say_how_to_serve_again()
        finally:
            self.display.close()
            self.shutdown()
        return 0

    def _train(self, started: float) -> summary.DemoSummary:
        opts, say = self.options, self.display.log
        url = self._start_server()
        environ = control.embedded_environ(self.data_dir, url)
        control.setup_django(environ)
        label = f"dipaco demo {time.strftime('%Y-%m-%d %H:%M:%S')}"
        self.api_token, enrollment = control.mint_tokens(label, opts.plan.workers)
        self.staff_password = reset_staff_password()
        say("created staff user 'demo' with an API token, and an enrollment token")
        say(self._sign_in(url))
        self.admin = AdminClient(url, self.api_token)
        self._cancel_leftovers()
        size = opts.plan.model_size
        self.display.update(stage="sampling the stdlib corpus")
        corpus = plan.stdlib_sample(self.data_dir / "corpus", plan.CORPUS_CHARS[size])
        dataset = self.admin.dataset(corpus.stem, str(corpus))  # the stem: stdlib-<chars>-<tag>
        name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        config = opts.plan.config(name, corpus)
        run = self.admin.create_run(name, config.model_dump(mode="json"), dataset["id"])
        self.run_id = run["id"]
        self._describe(name, config, corpus)
        self.display.update(
            title=f"dipaco demo: run {name} · {url}/runs/{self.run_id}/",
            rounds=config.total_rounds,
            phase1_rounds=self._phase1_rounds(config),
            units_total=sum(self._units_per_round(config, t) for t in range(config.total_rounds)),
        )
        self.admin.move(self.run_id, "start")
        self._wait_until_ready()
        self.admin.move(self.run_id, "start")
        say("run started: round 1 is queued")
        self.workers = WorkerPool(self.data_dir / "workers", self.logs, opts.plan.workers)
        self.workers.start(url, enrollment, environ)
        say(f"started {opts.plan.workers} dipaco-worker processes (logs: {self.logs})")
        rounds = self._follow(config)
        assert self.data is not None  # phase 2 ran
        dense = []
        if opts.baselines:
            self._wait_for_baseline()
            self.display.update(stage="scoring the dense baselines")
            assert self.baseline is not None
            dense = [
                summary.DenseScore(
                    key=r.baseline.key, equal=r.baseline.equal, name=r.baseline.name,
                    steps=r.steps, tokens=r.tokens, train_loss=r.train_loss, seconds=r.seconds,
                    losses=baseline.path_losses(r.model, self.data),
                )
                for r in self.baseline.results
            ]  # fmt: skip
        self._stop_workers()
        self.display.update(stage="downloading a path and generating a sample")
        sample = summary.sample(
            url, self.run_id, opts.prompt, str(self.data_dir / "paths"), opts.plan.seed, say
        )
        return summary.DemoSummary(
            run_id=self.run_id, run_name=name, server=url, config=config,
            seconds=time.monotonic() - started, workers=opts.plan.workers, rounds=rounds,
            before=self.before, dense=dense, weights=self.data.val_tokens,
            traffic=records.traffic(self.run_id), sample=sample, initial=self.initial,
            phase1_losses=self.phase1_losses, clock=records.phase_clock(self.run_id, config),
            baselines=opts.baselines,
        )  # fmt: skip

    def _describe(self, name: str, config: RunConfig, corpus: Path) -> None:
        paths = (
            f"{config.num_paths} paths of {config.num_params() / 1e6:.2f}M parameters, "
            f"{config.rounds} rounds x {config.inner.steps} inner steps"
        )
        if config.phase1 is None:
            self.display.log(f"run {name} (#{self.run_id}): {paths}, corpus {corpus.name}")
            return
        dense = config.dense_phase
        self.display.log(
            f"run {name} (#{self.run_id}), corpus {corpus.name}: phase 1, a dense DiLoCo model "
            f"x {dense.replicas_per_path} replicas, {dense.rounds} rounds x {dense.inner.steps} "
            f"inner steps; then the router and modules from it; phase 2, DiPaCo: {paths}"
        )

    @staticmethod
    def _phase1_rounds(config: RunConfig) -> int:
        return config.phase1.rounds if config.phase1 is not None else 0

    def _units_per_round(self, config: RunConfig, t: int) -> int:
        if t < self._phase1_rounds(config):
            return config.dense_phase.replicas_per_path
        return config.num_paths * config.replicas_per_path

    # --- steps --------------------------------------------------------------------------

    def _start_server(self) -> str:
        port = self.options.port
        if port is None:
            port = 8000
            if not control.port_is_free("127.0.0.1", port):
                port = control.free_port()
                self.display.log(f"port 8000 is in use; serving on {port} instead (--port)")
        elif not control.port_is_free("127.0.0.1", port):
            raise DemoError(f"port {port} is in use; choose another with --port")
        url = f"http://127.0.0.1:{port}"
        environ = control.embedded_environ(self.data_dir, url)
        self.server = ServerProcess(environ, port, self.logs / "server.log")
        self.display.update(stage=f"starting dipaco server (log: {self.server.log_path})")
        self.server.start()
        self.server.wait_until_healthy()
        self.display.log(f"dipaco server is up at {url} (data dir {self.data_dir})")
        return url

    def _cancel_leftovers(self) -> None:
        """Runs an interrupted demo left live would hand their units to our workers."""
        assert self.admin is not None
        for run in self.admin.items("/runs"):
            if run["state"] in LIVE_STATES and run["name"].startswith("demo-"):
                self.admin.move(run["id"], "cancel")
                self.display.log(
                    f"cancelled run {run['name']}, left {run['state']} by an earlier demo"
                )

    def _wait_until_ready(self) -> None:
        assert self.admin is not None and self.run_id is not None
        while True:
            status = self.admin.run(self.run_id)
            if status["state"] == "ready":
                return
            if status["state"] != "preparing":
                raise DemoError(f"preparing the run failed ({status['state']}): {status['error']}")
            progress = status.get("progress") or {}
            # Before a Celery worker takes the task there is no stage and no detail yet.
            stage = progress.get("stage") or "waiting for a Celery worker"
            detail = f"{stage}: {progress['detail']}" if progress.get("detail") else stage
            self.display.update(stage=f"preparing the run ({detail})")
            time.sleep(POLL_S)

    def _follow(self, config: RunConfig) -> list[dict[str, Any]]:
        """Watch the run through both phases until it finishes; phase 2's validation losses
        of every round (phase 1's go to `phase1_losses`)."""
        assert self.admin is not None and self.run_id is not None and self.workers is not None
        first = self._phase1_rounds(config)
        done_before = [0]  # units of the rounds before round t
        for t in range(config.total_rounds):
            done_before.append(done_before[-1] + self._units_per_round(config, t))
        losses: dict[int, dict[int, float]] = {}  # phase 2: round -> path -> loss
        routed: dict[int, float] = {}  # both phases: round -> (routed) validation loss
        phase = None
        while True:
            status = self.admin.run(self.run_id)
            state, current = status["state"], status["round"]
            if state in ("failed", "cancelled"):
                raise DemoError(f"the run {state}: {status['error'] or 'see the server log'}")
            for worker, code in self.workers.failed():
                raise DemoError(f"{worker.name} exited with code {code}; see {worker.log_path}")
            if self.baseline is not None and self.baseline.error is not None:
                raise DemoError(f"the dense baseline failed: {self.baseline.error}")
            t = status["current_round"]
            done = done_before[t]
            if current is not None:
                per_round = self._units_per_round(config, t)
                done += current["units"].get("done", 0) if current["state"] == "open" else per_round
            for point in self.admin.metrics(self.run_id, "val_loss"):
                if point["round"] < first:  # the dense model's one path
                    self.phase1_losses[point["round"]] = point["value"]
                else:
                    losses.setdefault(point["round"], {})[point["path"]] = point["value"]
            weights = self.data.val_tokens if self.data is not None else None
            for r in sorted(set(self.phase1_losses) | set(losses)):
                if r in routed:
                    continue
                if r < first:
                    routed[r] = self.phase1_losses[r]
                    what = "phase 1, dense: validation loss"
                elif weights is not None and set(weights) <= set(losses[r]):
                    routed[r] = weighted_mean(losses[r], weights)
                    what = "phase 2: routed validation loss" if first else "routed validation loss"
                else:
                    continue
                self.display.log(
                    f"round {r + 1} closed ({what} {routed[r]:.3f}, "
                    f"perplexity {perplexity(routed[r]) or math.nan:.1f})"
                )
            if status["phase"] != phase:  # after the rounds it follows are logged
                phase = status["phase"]
                self._phase_changed(phase, config)
            self.display.update(
                stage=self._stage(status, config), round=t, units_done=done, routed=dict(routed),
                workers=self.workers.snapshots(),
            )  # fmt: skip
            if state == "finished":
                return [
                    {"round": r, "routed": routed[r], "paths": losses[r]}
                    for r in sorted(losses)
                    if r in routed
                ]
            time.sleep(POLL_S)

    def _stage(self, status: dict[str, Any], config: RunConfig) -> str:
        state, phase = status["state"], status["phase"]
        if state != "running":
            return str(state)
        if phase == "1":
            return "phase 1: training the dense model (DiLoCo)"
        if phase == "preparing":
            progress = status.get("progress") or {}
            return f"between the phases: {progress.get('detail') or 'queued'}"
        return "phase 2: training DiPaCo paths" if config.phase1 is not None else "training"

    def _phase_changed(self, phase: str, config: RunConfig) -> None:
        say = self.display.log
        if phase == "preparing":
            say(
                "phase 1 is done; between the phases the server embeds every document's first "
                f"{config.router.prefix_tokens} tokens with the dense model, fits the router, "
                "writes the shards and copies the model into every module"
            )
        elif phase == "2" and self.data is None:
            self._enter_phase2(config)

    def _enter_phase2(self, config: RunConfig) -> None:
        """Phase 2 is open: read its shards and starting model, score where it starts, and
        start the dense baselines (they train from the same start on the same windows)."""
        assert self.run_id is not None
        self.display.update(stage="phase 2: reading its shards")
        work = self.data_dir / "tmp" / f"demo-{self.run_id}"
        self.data = baseline.fetch_run_data(self.run_id, work, units=self.options.baselines)
        self.initial = baseline.initial_losses(self.data)
        self.before = baseline.start_losses(self.data)
        start = weighted_mean(self.before, self.data.val_tokens)
        if config.phase1 is not None:
            first = self._phase1_rounds(config)
            self.display.log(
                f"phase 2 (DiPaCo) opened at round {first + 1}: {config.num_paths} paths, every "
                f"module from the phase-1 model (routed validation loss {start:.3f})"
            )
        if self.options.baselines:
            self.baseline = BaselineThread(self.data, self.display)
            self.baseline.start()

    def _wait_for_baseline(self) -> None:
        assert self.baseline is not None
        self.display.update(stage="finishing the dense baselines")
        self._stop_workers()  # their work is done; the baselines get the cores
        while self.baseline.is_alive():
            self.baseline.join(timeout=POLL_S)
        if self.baseline.error is not None:
            raise DemoError(f"the dense baseline failed: {self.baseline.error}")
        if len(self.baseline.results) != len(baseline.DENSE_BASELINES):
            raise DemoError("the dense baselines stopped before they finished")

    def _save(self, result: summary.DemoSummary) -> None:
        path = self.options.json_path or self.data_dir / "summaries" / f"{result.run_name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_json(), indent=2) + "\n", "utf-8")
        self.console.print(f"[bold]summary[/]: {path}")

    def _serve(self, result: summary.DemoSummary) -> None:
        """Keep the server (and its dashboard) up until Ctrl+C, or until it exits."""
        assert self.server is not None and self.server.process is not None
        self._stop_workers()  # the run is finished; only the dashboard and APIs are left
        self.console.print(
            f"the server keeps running at {self.server.url} (admin API token: "
            f"{self.api_token}); `dipaco generate --run {result.run_id} ...` and "
            f"`dipaco download --run {result.run_id} ...` work meanwhile"
        )
        # soft_wrap: one line even in a pipe, so the password and command copy whole.
        self.console.print(self._sign_in(self.server.url), highlight=False, soft_wrap=True)
        self.console.print(
            f"[bold]Dashboard: {result.dashboard}[/] — press Ctrl-C to stop", highlight=False
        )
        try:
            code = self.server.process.wait()
        except KeyboardInterrupt:
            self.console.print("stopping the server")
            return
        raise DemoError(
            f"dipaco server exited with code {code} while serving; see {self.server.log_path}"
        )

    def _sign_in(self, url: str) -> str:
        return sign_in_line(url, self.staff_password, self.data_dir)

    def _say_how_to_serve_again(self) -> None:
        port = self.server.port if self.server is not None else 8000
        self.console.print(
            "the server stops with the demo; to see the dashboard again: "
            f"DIPACO_DATA_DIR={self.data_dir} dipaco server --port {port}",
            highlight=False,
            soft_wrap=True,
        )
        if self.staff_password:
            line = self._sign_in(f"http://127.0.0.1:{port}")
            self.console.print(line, highlight=False, soft_wrap=True)

    # --- stopping -----------------------------------------------------------------------

    def _stop_workers(self) -> None:
        if self.workers is not None:
            self.workers.stop()

    def shutdown(self) -> None:
        """Stop everything this demo started, in order; safe to call at any point."""
        if self.baseline is not None:
            self.baseline.stop.set()
        if self.admin is not None and self.run_id is not None:
            try:
                if self.admin.run(self.run_id)["state"] in LIVE_STATES:
                    self.admin.move(self.run_id, "cancel")
                    self.console.print(f"cancelled run #{self.run_id}")
            except DemoError:
                pass  # the server is gone: nothing will lease its units
            self.admin.close()
        self._stop_workers()
        if self.server is not None:
            self.server.stop()
