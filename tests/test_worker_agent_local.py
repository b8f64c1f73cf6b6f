"""The agent's files and options: the 0600 config file, the lease state, sizes, devices, --help."""

from __future__ import annotations

import ast
import io
import json
import os
import signal
import stat
import threading
from pathlib import Path

import pytest
import torch
from rich.console import Console

from worker_agent import cli
from worker_agent.config import (
    CONFIG_NAME,
    WorkerIdentity,
    default_data_dir,
    load_identity,
    save_identity,
)
from worker_agent.device import detect_device, select_gpus
from worker_agent.errors import ExitCode, UsageError
from worker_agent.progress import JsonReporter, RichReporter
from worker_agent.state import LeaseRecord, LeaseStateFile

IDENTITY = WorkerIdentity("http://127.0.0.1:8000", 7, "dpw_secret", "box")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_worker_token_is_saved_readable_by_its_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a usual umask would make a plain file 0644
    try:
        path = save_identity(tmp_path / "agent", IDENTITY)
    finally:
        os.umask(old)
    assert path.name == CONFIG_NAME and mode(path) == 0o600
    assert load_identity(tmp_path / "agent") == IDENTITY
    assert not [p for p in path.parent.iterdir() if p.name != CONFIG_NAME], "no temporary left"


def test_a_config_file_readable_by_others_is_tightened_when_loaded(tmp_path: Path) -> None:
    path = save_identity(tmp_path, IDENTITY)
    path.chmod(0o644)
    assert load_identity(tmp_path) == IDENTITY
    assert mode(path) == 0o600


def test_without_enrollment_the_message_says_how_to_enroll(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--server URL --enroll TOKEN") as missing:
        load_identity(tmp_path)
    assert missing.value.exit_code == ExitCode.USAGE
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(UsageError, match="damaged"):
        load_identity(tmp_path)


def test_the_data_dir_comes_from_the_environment_or_xdg() -> None:
    assert default_data_dir({"DIPACO_WORKER_DIR": "/srv/w"}) == Path("/srv/w")
    assert default_data_dir({"XDG_DATA_HOME": "/x"}) == Path("/x/dipaco-worker")


def test_the_lease_state_round_trips_privately_and_a_damaged_one_is_ignored(
    tmp_path: Path,
) -> None:
    state = LeaseStateFile(tmp_path)
    assert state.load() is None
    record = LeaseRecord("http://s", {"lease_id": 3, "lease_secret": "dpl_x"}, step=4)
    state.save(record)
    assert mode(state.path) == 0o600
    loaded = state.load()
    assert loaded is not None and (loaded.lease_id, loaded.step) == (3, 4)
    state.path.write_text(json.dumps({"unexpected": 1}))
    assert state.load() is None
    state.clear()
    assert not state.path.exists()


def test_the_lease_in_hand_in_stays_in_the_state_file_until_it_is_in_then_the_next_is_written(
    tmp_path: Path,
) -> None:
    state = LeaseStateFile(tmp_path)
    handed = LeaseRecord("http://s", {"lease_id": 3}, step=5, phase="uploading")
    state.save(handed)
    state.hold(3)  # its Δ is being handed in while lease 4 trains
    training = LeaseRecord("http://s", {"lease_id": 4})
    state.save(training)
    training.step = 2
    state.save(training)
    saved = state.load()
    assert saved is not None and (saved.lease_id, saved.phase) == (3, "uploading"), (
        "a restart hands 3 in"
    )
    state.clear(4)  # 4 was lost meanwhile: nothing of it is written later
    state.save(LeaseRecord("http://s", {"lease_id": 5}, step=1))
    state.clear(3)  # handed in: the record that waited is written
    saved = state.load()
    assert saved is not None and (saved.lease_id, saved.step) == (5, 1)
    state.clear(3)  # a late clear of the handed-in lease leaves the next one's record alone
    assert state.load() is not None
    state.save(LeaseRecord("http://s", {"lease_id": 6}))  # nothing held: written at once
    saved = state.load()
    assert saved is not None and saved.lease_id == 6


def test_sizes_read_binary_and_decimal_units() -> None:
    assert cli.parse_size("24GiB") == 24 * 1024**3
    assert cli.parse_size("24") == 24 * 1024**3
    assert cli.parse_size("800MB") == 800 * 1000**2
    assert cli.parse_size("1.5G") == int(1.5 * 1024**3)
    with pytest.raises(Exception, match="not a size"):
        cli.parse_size("lots")


def test_help_lists_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for code in ExitCode:
        assert f"\n  {int(code)} " in text, f"exit code {int(code)} is not documented"


def test_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    reporter_args = ["--json-logs", "--data-dir", str(tmp_path)]
    assert cli.main([*reporter_args, "--max-units", "0"]) == ExitCode.USAGE
    assert cli.main([*reporter_args, "--checkpoint-interval", "0"]) == ExitCode.USAGE
    assert cli.main([*reporter_args, "--checkpoint-interval", "nan"]) == ExitCode.USAGE
    assert cli.main([*reporter_args, "--enroll", "dpe_x"]) == ExitCode.USAGE, "needs --server"
    assert cli.main(reporter_args) == ExitCode.USAGE, "not enrolled yet"
    save_identity(tmp_path, IDENTITY)
    assert cli.main([*reporter_args, "--device", "tpu"]) == ExitCode.USAGE
    assert cli.main([*reporter_args, "--server", "http://other:8000"]) == ExitCode.USAGE


def test_auto_picks_the_cpu_here_and_cuda_is_refused_with_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    info = detect_device("auto")
    assert info.device.type == "cpu" and info.describe()["kind"] == "cpu"
    with pytest.raises(UsageError, match="--device cuda"):
        detect_device("cuda")


def test_gpus_must_be_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    select_gpus("0, 2")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,2"
    with pytest.raises(UsageError, match="--gpus"):
        select_gpus("all")


def test_without_a_terminal_the_panel_becomes_plain_progress_lines() -> None:
    out = io.StringIO()
    reporter = RichReporter(Console(file=out, force_terminal=False, width=120))
    assert reporter.live is None
    reporter.event("lease", "lease 4: run tiny round 1 path 1, 20 steps", run="tiny", round=0)
    reporter.status(step=20, steps=20, loss=3.25, tokens_per_second=1234.0)
    reporter.close()
    text = out.getvalue()
    assert "lease 4: run tiny round 1 path 1" in text
    assert "step 20/20" in text and "3.2500" in text and "1,234 tokens/s" in text
    panel = Console(file=io.StringIO(), width=100)
    panel.print(reporter._render())
    rendered = panel.file.getvalue()  # type: ignore[attr-defined]
    # People count rounds from 1 (the event's field is the 0-based index).
    assert "20/20" in rendered and "tiny  round 1" in rendered


def test_json_logs_are_one_object_per_line_with_time_and_event() -> None:
    out = io.StringIO()
    reporter = JsonReporter(out)
    reporter.event("idle", "no work queued", wait_s=1.0)
    for step in range(1, 4):
        reporter.status(step=step, steps=3, loss=1.0)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "idle" and lines[0]["time"].endswith("Z")
    steps = [line["step"] for line in lines if line["event"] == "step"]
    assert steps[0] == 1 and steps[-1] == 3, "the first and the last step are always logged"


def test_a_first_signal_asks_to_stop_and_a_second_exits_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    stop, out = threading.Event(), io.StringIO()
    with cli._process_state():
        cli._install_signals(stop, JsonReporter(out))
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        handler(signal.SIGTERM, None)
        assert stop.is_set() and exits == []
        assert json.loads(out.getvalue())["event"] == "stopping"
        handler(signal.SIGINT, None)
        assert exits == [ExitCode.INTERRUPTED]
    assert signal.getsignal(signal.SIGTERM) is not handler, "the old handlers are restored"


def test_the_agent_and_the_library_code_it_imports_never_import_django() -> None:
    root = Path(__file__).resolve().parent.parent
    todo = sorted((root / "worker_agent").glob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert not name.startswith(("django", "dipaco_server")), f"{path} imports {name}"
                if name.startswith(("dipaco.", "worker_agent.")) or name == "dipaco":
                    module = root / name.replace(".", "/")
                    todo += [p for p in (module.with_suffix(".py"), module / "__init__.py")
                             if p.exists()]  # fmt: skip
    assert len(seen) > 20, "the walk followed the library's imports"


def test_the_checkpoint_interval_in_help_is_the_librarys_and_compile_can_be_switched_off() -> None:
    from dipaco.inner import DEFAULT_CHECKPOINT_INTERVAL_S

    assert cli.CHECKPOINT_INTERVAL_S == DEFAULT_CHECKPOINT_INTERVAL_S
    args = cli.build_parser().parse_args([])
    assert (args.checkpoint_interval, args.checkpoint_every, args.compile) == (
        DEFAULT_CHECKPOINT_INTERVAL_S, None, None,
    )  # fmt: skip
    assert cli.build_parser().parse_args(["--no-compile"]).compile is False
