#!/usr/bin/env bash
# A 150M run through S3, end to end, on this machine's CPU: an embedded `dipaco server` whose
# blob store is moto's S3 server behind a link of 30 ms a request and 200 MB/s
# (bench/s3_link.py), two paths of RunConfig.paper_150m() (174M parameters each) on a
# 2-level grid of 2 x 1 modules, 2 rounds of units of a few steps at batch 1, and a round's
# evaluation cut to EVAL_FLOPS (58 windows of the 150M path at 2e13). One `dipaco-worker
# --device cpu` trains every unit: its chunks of training rows, module weights and Δs all
# go through the S3 server by presigned URLs. Figures: docs/figures/platform_150m_cpu.json
# ("ended", "params", "store", "rounds" with each round's stage seconds and validation loss,
# S3 requests and bytes per unit, the server's and the worker's peak memory, summed RSS and
# summed PSS: bench/platform_gpu.py and bench/platform_gpu_figures.py say how).
#
#   bench/platform_150m.sh            # ~25-45 min on 2 cores; needs ~20 GB of memory
#
# Settings (environment): ROUNDS (2), PATHS (2), BATCH (1), UNIT_S (a unit's training
# seconds: 40), PROBE_STEPS (4), EVAL_FLOPS (2e13), LATENCY_MS (30), BANDWIDTH_MBS (200),
# MAX_CHARS (the corpus: 20000000 characters of this Python's site-packages), STOP_AFTER
# (2700: a run not finished by then is stopped, its figures written with "ended" saying so),
# JSON (docs/figures/platform_150m_cpu.json), WORK (/tmp/platform-150m), PYTHON (.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${WORK:-/tmp/platform-150m}
JSON=${JSON:-docs/figures/platform_150m_cpu.json}
MAX_CHARS=${MAX_CHARS:-20000000}
STOP_AFTER=${STOP_AFTER:-2700}
mkdir -p "$WORK"
started=$(date +%s.%N)
corpus="$WORK/corpus-$MAX_CHARS.jsonl"
if [ ! -s "$corpus" ]; then
    site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" bench/corpus_jsonl.py "$site" --max-chars "$MAX_CHARS" --out "$corpus"
fi
exec "$PYTHON" bench/platform_gpu.py --device cpu --server-device cpu --preset 150m \
    --rounds "${ROUNDS:-2}" --paths "${PATHS:-2}" --batch "${BATCH:-1}" \
    --unit-seconds "${UNIT_S:-40}" --probe-steps "${PROBE_STEPS:-4}" \
    --eval-flops "${EVAL_FLOPS:-2e13}" --store s3 --latency-ms "${LATENCY_MS:-30}" \
    --bandwidth-mbs "${BANDWIDTH_MBS:-200}" --corpus "$corpus" --work-dir "$WORK" \
    --budget "$STOP_AFTER" --stop-after "$STOP_AFTER" --started-at "$started" --json "$JSON"
