#!/usr/bin/env bash
# The worker on a GPU, checked in one short lease: the tests that exercise CUDA, then the
# agent's throughput against the best bare loop (bench/agent_overhead.py) at the 150M path
# with a realistic batch, written to docs/figures/gpu.json.
#
#   bench/gpu_check.sh                      # on the GPU machine, from the repository root
#   DEVICE=cpu bench/gpu_check.sh           # the dry run: tiny preset, CPU, /tmp output
#
# Needs only a CUDA build of torch and the worker's dependencies (pyproject's base list:
# transformers, safetensors, pydantic, tenacity, zstandard, httpx, rich...), plus pytest and
# hypothesis; nothing of the server. The package is imported from this checkout
# (PYTHONPATH), not installed. A machine with no package index takes the missing ones as
# wheels in .whl/ (installed into /tmp/site first), for example, here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection tenacity zstandard
#
# Time: the whole script fits BUDGET_S seconds (360 on a GPU: 6 minutes of a 15-minute
# lease, leaving the machine's start and a rerun). The CUDA tests take about a minute; the
# bench warms each side up (compiling), measures their speed and sizes H to what the rest
# of the budget holds (bench/agent_overhead.py --time-budget), at most STEPS. At the
# goal's 40% MFU a 64 x 1,024-token step of the 150M path takes about 0.17 s, so 500 steps
# a side take about 3 minutes. A figure from fewer than MIN_STEPS steps (500, the papers'
# H) is not written where the committed one goes: it lands beside it as *.short.json.
#
# Settings (environment): DEVICE (cuda), PRESET (150m; tiny on the CPU), BATCH (sequences
# per step: 64; 4 on the CPU), STEPS (the most: 1000; 40 on the CPU), MIN_STEPS (500; 2 on
# the CPU), BUDGET_S (360; 150 on the CPU), WARMUP (steps: 20; 3 on the CPU),
# CHECKPOINT_INTERVAL (seconds: 30, so a 500-step unit writes a few and their blocking
# time is measured; the agent's default is longer), JSON (docs/figures/gpu.json;
# /tmp/gpu_check_cpu.json on the CPU: a CPU figure is never written where a GPU one goes;
# on a lent machine whose output folder is $OUT, JSON=$OUT/gpu.json).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
device=${DEVICE:-cuda}
if [ "$device" = cpu ]; then
    preset=${PRESET:-tiny} batch=${BATCH:-4} steps=${STEPS:-40} warmup=${WARMUP:-3}
    min_steps=${MIN_STEPS:-2} budget=${BUDGET_S:-150} out=${JSON:-/tmp/gpu_check_cpu.json}
else
    preset=${PRESET:-150m} batch=${BATCH:-64} steps=${STEPS:-1000} warmup=${WARMUP:-20}
    min_steps=${MIN_STEPS:-500} budget=${BUDGET_S:-360} out=${JSON:-docs/figures/gpu.json}
fi
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

"$py" - "$device" <<'PY'
import sys, torch
device = sys.argv[1]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("DEVICE=cuda but torch sees no GPU (torch %s); DEVICE=cpu for the dry run" % torch.__version__)
name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
print(f"torch {torch.__version__} on {name}")
PY

echo "== the tests that exercise CUDA (skipped on the CPU)"
"$py" -m pytest -q -p no:cacheprovider -o addopts="" --timeout 120 \
    tests/test_inner_cuda.py tests/test_codecs.py -k "cuda or gpu"
echo "tests: $(($(date +%s) - started)) s"

left=$((budget - ($(date +%s) - started) - 10))
echo "== the agent against the best bare loop: $preset, batch $batch, H <= $steps in $left s"
"$py" bench/agent_overhead.py --device "$device" --preset "$preset" --batch "$batch" \
    --steps "$steps" --time-budget "$left" --warmup-steps "$warmup" --repeats 1 \
    --checkpoint-interval "${CHECKPOINT_INTERVAL:-30}" --json "$out"
h=$("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['steps'])" "$out")
if [ "$h" -lt "$min_steps" ]; then
    mv "$out" "${out%.json}.short.json"
    out="${out%.json}.short.json"
    echo "H = $h < $min_steps: not the committed figure's H"
fi
echo "total: $(($(date +%s) - started)) s (budget $budget s); figures in $out (H = $h)"
