"""The layout's boundaries, checked so they cannot rot (docs/design.md §2).

The library (``dipaco``) and the volunteer agent (``worker_agent``) never load Django or the
control plane, lazily or not; and an install without the server extra has a working
``dipaco --help`` (with a hint for the server's commands) and ``dipaco-worker --help``.
"""

from __future__ import annotations

import os
import pkgutil
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import dipaco
import worker_agent

ROOT = Path(__file__).resolve().parent.parent
IMPORT = re.compile(r"^\s*(import|from) (django|dipaco_server|dipaco_demo|dipaco_web)\b", re.M)


def _modules() -> list[str]:
    names = []
    for package in (dipaco, worker_agent):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            names.append(info.name)
    return names


def test_no_server_import_in_the_library_or_agent_sources() -> None:
    offenders = []
    for folder in ("dipaco", "worker_agent"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in IMPORT.finditer(path.read_text("utf-8")):
                line = path.read_text("utf-8")[: match.start()].count("\n") + 1
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0).strip()}")
    assert not offenders, "the library and the agent must not import the server:\n" + "\n".join(
        offenders
    )


def test_importing_every_library_and_agent_module_loads_no_django() -> None:
    modules = _modules()
    assert len(modules) > 30 and "dipaco.client" in modules and "worker_agent.agent" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('django', 'dipaco_server', 'dipaco_demo', 'dipaco_web', 'celery'))\n"
        "print('LOADED', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cli_offers_server_commands_only_with_the_server_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib import metadata

    from dipaco.cli import build_parser, discover, missing_requirements

    assert missing_requirements("server") == []  # this venv has the extra
    names = [entry.name for entry in discover()[0]]
    assert names[:4] == ["demo", "server", "simulate", "admin"]
    real = metadata.requires("dipaco") or []
    # As if the extra named a package this machine lacks.
    fake_requires = [*real, 'no-such-package-xyz>=1; extra == "bigger"']
    monkeypatch.setattr(metadata, "requires", lambda name: fake_requires)
    assert missing_requirements("bigger") == ["no-such-package-xyz"]
    fake = [
        metadata.EntryPoint("demo", "dipaco_demo.cli:register [bigger]", "dipaco.commands"),
        metadata.EntryPoint("simulate", "dipaco.cli.simulate:register", "dipaco.commands"),
    ]
    ready, missing = discover(fake)
    assert [e.name for e in ready] == ["simulate"]
    assert [m.name for m in missing] == ["demo"]
    parser, _ = build_parser(fake)
    assert "pip install 'dipaco[bigger]'" in parser.format_help()


@pytest.mark.slow
def test_a_worker_only_install_has_working_help(tmp_path: Path) -> None:
    """pip installs dipaco without the server extra into a fresh venv (torch from the local
    wheel first, as the Makefile does); `dipaco --help` hints at the extra, `dipaco server`
    says how to get it, and `dipaco-worker --help` works."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # --no-compile: no .pyc for torch's thousands of files (half the install's time here).
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    torch = os.environ.get("DIPACO_TEST_TORCH", "torch==2.13.0")
    subprocess.run([*pip, torch], check=True, timeout=900, capture_output=True)
    # From a copy of the sources, so the build leaves nothing (build/) in the checkout.
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "node_modules", "build", "*.egg-info", "test-artifacts", "__pycache__"
        ),
    )
    subprocess.run([*pip, str(source)], check=True, timeout=900, capture_output=True)
    run = {"capture_output": True, "text": True, "timeout": 300, "cwd": tmp_path}
    listed = subprocess.run([str(python), "-m", "pip", "list"], **run).stdout.lower()
    assert "django" not in listed and "celery" not in listed
    helped = subprocess.run([str(env_dir / "bin" / "dipaco"), "--help"], **run)
    assert helped.returncode == 0, helped.stderr
    commands = helped.stdout.split("commands:")[1]
    for present in ("simulate", "download", "route", "generate"):
        assert re.search(rf"^\s+{present}\s", commands, re.M), helped.stdout
    for absent in ("demo", "server", "admin"):
        assert not re.search(rf"^\s+{absent}\s", commands, re.M), helped.stdout
    assert "pip install 'dipaco[server]'" in helped.stdout
    server = subprocess.run([str(env_dir / "bin" / "dipaco"), "server"], **run)
    assert server.returncode == 2 and "pip install 'dipaco[server]'" in server.stderr
    assert "Traceback" not in server.stderr
    worker = subprocess.run([str(env_dir / "bin" / "dipaco-worker"), "--help"], **run)
    assert worker.returncode == 0 and "--server" in worker.stdout, worker.stderr


def test_the_servers_urls_and_celery_app_load_without_torch() -> None:
    """`migrate`, `check` and every management command import the URLs (system checks) and
    the Celery app; torch (seconds to import) is loaded only where it is used, and by
    gunicorn's own preload (dipaco_server.core.preload) for the inference views."""
    script = (
        "import sys, django\n"
        "django.setup()\n"
        "import dipaco_server.urls, dipaco_server.celery\n"
        "from django.core.management import call_command\n"
        "call_command('check', verbosity=0)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        "print('LOADED', heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "dipaco_server.settings"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_server_process_trains_scores_and_steps_paths_without_importing_transformers() -> None:
    """What gunicorn preloads and what a Celery worker imports before its pool forks, then
    a path built, scored and trained a step: transformers (seconds of CPU per process) is
    not among them; only the consumers of a downloaded path import it (dipaco.hf)."""
    script = (
        "import sys, django\n"
        "django.setup()\n"
        "from dipaco_server.core.preload import import_heavy_libraries\n"
        "import_heavy_libraries()\n"
        "import dipaco_server.rounds.lifecycle.tasks as tasks\n"
        "tasks.preload()\n"
        "import torch\n"
        "from dipaco.config import RunConfig\n"
        "from dipaco.inference import generation_config_json, hf_config_json\n"
        "from dipaco.model import build_model\n"
        "config = RunConfig.tiny()\n"
        "model = build_model(config.model, 0)\n"
        "ids = torch.zeros((1, 8), dtype=torch.long)\n"
        "model(ids).logits.sum().backward()\n"
        "hf_config_json(config, 0), generation_config_json(0)\n"
        "print('LOADED', 'transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "dipaco_server.settings"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LOADED False True" in done.stdout, done.stdout + done.stderr
