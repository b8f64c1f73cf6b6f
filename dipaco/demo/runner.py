"""The demo from start to summary: server, tokens, run, workers, baselines, summary.

Every step goes through the product's own interfaces: `dipaco server`, the admin API
with a staff token, `dipaco-worker` processes enrolled with an enrollment token, the
inference API for the sample. After the summary the server keeps serving the dashboard
until Ctrl+C when `DemoOptions.serve` says so (the command line's default on a terminal).
Stopping (Ctrl+C, SIGTERM, an error) always runs the same path: stop the baselines,
cancel the run if it is still going, stop the workers (they release their leases), then
stop the server (it stops its children).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from dipaco.demo import baseline, control, plan, summary
from dipaco.demo.control import AdminClient, DemoError, ServerProcess
from dipaco.demo.display import DemoDisplay
from dipaco.demo.workers import WorkerPool
from dipaco.inner import StepMetrics

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
        self.display = DemoDisplay(console)

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
        say("created staff user 'demo' with an API token, and an enrollment token")
        self.admin = AdminClient(url, self.api_token)
        self._cancel_leftovers()
        size = opts.plan.model_size
        self.display.update(stage="sampling the stdlib corpus")
        corpus = plan.stdlib_sample(self.data_dir / "corpus", plan.CORPUS_CHARS[size])
        dataset = self.admin.dataset(f"stdlib-{corpus.stem}", str(corpus))
        name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        config = opts.plan.config(name, corpus)
        run = self.admin.create_run(name, config.model_dump(mode="json"), dataset["id"])
        self.run_id = run["id"]
        say(
            f"run {name} (#{self.run_id}): {config.num_paths} paths of "
            f"{config.num_params() / 1e6:.2f}M parameters, {config.rounds} rounds x "
            f"{config.inner.steps} inner steps, corpus {corpus.name}"
        )
        self.display.update(
            title=f"dipaco demo: run {name} · {url}/runs/{self.run_id}/",
            rounds=config.rounds,
            units_per_round=config.num_paths * config.replicas_per_path,
        )
        self.admin.move(self.run_id, "start")
        self._wait_until_ready()
        data = baseline.fetch_run_data(self.run_id, self.data_dir / "tmp" / f"demo-{self.run_id}")
        before = baseline.initial_losses(data)
        self.admin.move(self.run_id, "start")
        say("run started: round 0 is queued")
        self.workers = WorkerPool(self.data_dir / "workers", self.logs, opts.plan.workers)
        self.workers.start(url, enrollment, environ)
        say(f"started {opts.plan.workers} dipaco-worker processes (logs: {self.logs})")
        self.baseline = BaselineThread(data, self.display)
        self.baseline.start()
        rounds = self._follow(data.val_tokens)
        self._wait_for_baseline()
        self.display.update(stage="scoring the dense baselines")
        dense = [
            summary.DenseScore(
                key=r.baseline.key, equal=r.baseline.equal, name=r.baseline.name,
                steps=r.steps, tokens=r.tokens, train_loss=r.train_loss, seconds=r.seconds,
                losses=baseline.path_losses(r.model, data),
            )
            for r in self.baseline.results
        ]  # fmt: skip
        self.display.update(stage="downloading a path and generating a sample")
        sample = summary.sample(
            url, self.run_id, opts.prompt, str(self.data_dir / "paths"), opts.plan.seed, say
        )
        return summary.DemoSummary(
            run_id=self.run_id, run_name=name, server=url, config=config,
            seconds=time.monotonic() - started, workers=opts.plan.workers, rounds=rounds,
            before=before, dense=dense, weights=data.val_tokens,
            traffic=summary.traffic(self.run_id), sample=sample,
        )  # fmt: skip

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
            detail = f"{progress.get('stage', 'queued')}: {progress.get('detail', '')}"
            self.display.update(stage=f"preparing the run ({detail})")
            time.sleep(POLL_S)

    def _follow(self, weights: dict[int, int]) -> list[dict[str, Any]]:
        """Watch the run until it finishes; the validation losses of every round."""
        assert self.admin is not None and self.run_id is not None and self.workers is not None
        per_round = self.display.state.units_per_round
        seen_rounds: set[int] = set()
        losses: dict[int, dict[int, float]] = {}
        while True:
            status = self.admin.run(self.run_id)
            state, current = status["state"], status["round"]
            if state in ("failed", "cancelled"):
                raise DemoError(f"the run {state}: {status['error'] or 'see the server log'}")
            for worker, code in self.workers.failed():
                raise DemoError(f"{worker.name} exited with code {code}; see {worker.log_path}")
            if self.baseline is not None and self.baseline.error is not None:
                raise DemoError(f"the dense baseline failed: {self.baseline.error}")
            done = per_round * status["current_round"]
            if current is not None:
                done += current["units"].get("done", 0) if current["state"] == "open" else per_round
            for point in self.admin.metrics(self.run_id, "val_loss"):
                losses.setdefault(point["round"], {})[point["path"]] = point["value"]
            routed = {
                t: baseline.routed(paths, weights)
                for t, paths in losses.items()
                if set(weights) <= set(paths)
            }
            for t in sorted(set(routed) - seen_rounds):
                seen_rounds.add(t)
                self.display.log(
                    f"round {t} closed: routed validation loss {routed[t]:.3f} "
                    f"(perplexity {math.exp(routed[t]):.1f})"
                )
            stage = "training" if state == "running" else state
            self.display.update(
                stage=stage, round=status["current_round"], units_done=done, routed=routed,
                workers=self.workers.snapshots(),
            )  # fmt: skip
            if state == "finished":
                return [
                    {"round": t, "routed": routed[t], "paths": losses[t]} for t in sorted(routed)
                ]
            time.sleep(POLL_S)

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
        import json

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

    def _say_how_to_serve_again(self) -> None:
        port = self.server.port if self.server is not None else 8000
        self.console.print(
            "the server stops with the demo; to see the dashboard again: "
            f"DIPACO_DATA_DIR={self.data_dir} dipaco server --port {port}",
            highlight=False,
        )

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
