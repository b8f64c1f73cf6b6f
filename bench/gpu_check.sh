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
# Budget, on one H100 (about 8 minutes): the tests about 1; each side's warm-up with its
# compilation about 1; H = 500 steps of 64 x 1,024 tokens, about 100 s a side at 40% MFU.
#
# Settings (environment): DEVICE (cuda), PRESET (150m; tiny on the CPU), BATCH (sequences
# per step: 64; 4 on the CPU), STEPS (H: 500; 20 on the CPU), WARMUP (steps: 20; 3 on the
# CPU), CHECKPOINT_INTERVAL (seconds: 30, so a 500-step unit writes a few and their
# blocking time is measured; the agent's default is longer), JSON (docs/figures/gpu.json;
# /tmp/gpu_check_cpu.json on the CPU: a CPU figure is never written where a GPU one goes;
# on a lent machine whose output folder is $OUT, JSON=$OUT/gpu.json).
set -euo pipefail
cd "$(dirname "$0")/.."
device=${DEVICE:-cuda}
if [ "$device" = cpu ]; then
    preset=${PRESET:-tiny} batch=${BATCH:-4} steps=${STEPS:-20} warmup=${WARMUP:-3}
    out=${JSON:-/tmp/gpu_check_cpu.json}
else
    preset=${PRESET:-150m} batch=${BATCH:-64} steps=${STEPS:-500} warmup=${WARMUP:-20}
    out=${JSON:-docs/figures/gpu.json}
fi
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

"$py" - "$device" <<'EOF'
import sys, torch
device = sys.argv[1]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("DEVICE=cuda but torch sees no GPU (torch %s); DEVICE=cpu for the dry run" % torch.__version__)
name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
print(f"torch {torch.__version__} on {name}")
EOF

echo "== tests that need no server (the CUDA ones run on a GPU)"
started=$(date +%s)
"$py" -m pytest -q -p no:cacheprovider -o addopts="" --timeout 300 \
    tests/test_codecs.py tests/test_flops.py tests/test_inner*.py tests/test_worker_agent_train.py
echo "tests: $(($(date +%s) - started)) s"

echo "== the agent against the best bare loop: $preset, batch $batch, H = $steps"
started=$(date +%s)
"$py" bench/agent_overhead.py --device "$device" --preset "$preset" --batch "$batch" \
    --steps "$steps" --warmup-steps "$warmup" --repeats 1 \
    --checkpoint-interval "${CHECKPOINT_INTERVAL:-30}" --json "$out"
echo "bench: $(($(date +%s) - started)) s; figures in $out"
