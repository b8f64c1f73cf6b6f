#!/usr/bin/env bash
# The whole platform on one GPU machine, in one short lease: an embedded `dipaco server`
# (SQLite, filesystem broker, local blobs; Celery on the CPU cores, its evaluation and
# scoring on the GPU), one `dipaco-worker --device cuda`, and a run of 150M paths
# (RunConfig.paper_150m() on a 2-level grid of 2 x 1 modules: 2 paths), 3 rounds of units
# of 60 s of training at 64 x 1,024 tokens a step, outer.overlap delayed. Figures in
# docs/figures/platform_gpu.json (bench/platform_gpu.py and bench/platform_gpu_figures.py
# say what each one is and how it is measured).
#
#   bench/platform_gpu.sh                  # on the GPU machine, from the repository root
#   DEVICE=cpu bench/platform_gpu.sh       # the dry run: tiny preset, CPU, /tmp output
#
# What the GPU machine needs: a CUDA build of torch with transformers and tokenizers (its
# image has them), and the rest as wheels in .whl/ (an ignored folder, carried there),
# installed into /tmp/site first; then this checkout itself is installed there (--no-deps,
# for its entry points: `dipaco server` is found through them) while the code is imported
# from the checkout (PYTHONPATH). Nothing is fetched at run time. The wheels, downloaded
# here once (after `echo /.whl/ >> .git/info/exclude`) for the machine's Python 3.12, at
# the versions `make setup` installed (about 43 MB; setuptools builds the checkout's
# metadata without an index):
#   PYTHON=.venv/bin/python bench/platform_gpu.sh wheels     # into .whl/ (WHEELS: another)
# which is `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation
# cp --platform manylinux_2_28_x86_64 (and _2_27, _2_17, 2014, 1) -d .whl` of WHEELS_NEEDED
# below, each pinned to the version PYTHON has (WHEELS_PYTHON: another Python than 3.12).
# The same path, rehearsed on the CPU: a fresh venv with only torch, transformers and
# their needs, the wheels for its Python in .whl/, then DEVICE=cpu PYTHON=that venv's.
#
# Time: the goal is BUDGET seconds (480: 8 minutes of a 15-minute lease, setup included).
# 6 units x 60 s is 360 s of training; the rest is the corpus (MAX_CHARS of this Python's
# site-packages, bench/corpus_jsonl.py), the server's start, the probe (compiling the path
# once and timing it, beside the server's start: it sizes H to 60 s of training and fills
# torch's compile cache for the worker), the run's preparation (tokenizer, router, shards,
# modules), the worker's start, its first fetch and step, and the gaps between rounds. A
# run not finished STOP_AFTER seconds after the start (BUDGET + 80: inside a 10-minute
# call) is stopped, its figures written with "ended" saying so; "seconds" is the whole
# script's time, to hold against the goal.
#
# Settings (environment; the dry run's defaults after the semicolons): DEVICE (cuda; cpu),
# PRESET (150m; tiny), ROUNDS (3), PATHS (2), BATCH (sequences a step: 64; 4), UNIT_S (a
# unit's training seconds: 60; 4), PROBE_STEPS (30; 8), BUDGET (480; 900), STOP_AFTER
# (BUDGET + 80), MAX_CHARS (the corpus: 60000000; 2000000), OVERLAP (delayed), TASKS
# (Celery tasks at once: half the cores), SERVER_DEVICE (DIPACO_SERVER_DEVICE: DEVICE; cpu
# keeps the server's forward passes off the GPU), WORKER_THREADS (the worker's own; 1),
# JSON (docs/figures/platform_gpu.json; /tmp/platform_gpu_cpu.json: a CPU figure never
# goes where the GPU one does), WORK (/tmp/platform-gpu: corpus, server data and logs),
# LOGS (a folder: the run's logs go there as platform_gpu_logs.tgz), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS_NEEDED="django asgiref sqlparse django-ninja dj-database-url gunicorn celery kombu amqp
    vine billiard click-didyoumean click-plugins click-repl prompt-toolkit wcwidth tzlocal redis
    boto3 botocore s3transfer jmespath psycopg psycopg-binary psycopg-pool pydantic
    pydantic-core annotated-types typing-inspection tenacity zstandard setuptools"
if [ "${1:-}" = wheels ]; then
    pins=()
    for name in $WHEELS_NEEDED; do
        pins+=("$name==$("${PYTHON:-python3}" -c 'import importlib.metadata as m, sys
print(m.version(sys.argv[1]))' "$name")")
    done
    platforms=()
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version "${WHEELS_PYTHON:-3.12}" "${platforms[@]}" -d "${WHEELS:-.whl}" \
        "${pins[@]}"
    ls "${WHEELS:-.whl}"/*.whl | wc -l
    exit 0
fi
started=$(date +%s.%N)
device=${DEVICE:-cuda}
if [ "$device" = cpu ]; then
    preset=${PRESET:-tiny} batch=${BATCH:-4} unit_s=${UNIT_S:-4} probe_steps=${PROBE_STEPS:-8}
    budget=${BUDGET:-900} max_chars=${MAX_CHARS:-2000000} threads=${WORKER_THREADS:-1}
    out=${JSON:-/tmp/platform_gpu_cpu.json}
else
    preset=${PRESET:-150m} batch=${BATCH:-64} unit_s=${UNIT_S:-60}
    probe_steps=${PROBE_STEPS:-30}
    budget=${BUDGET:-480} max_chars=${MAX_CHARS:-60000000} threads=${WORKER_THREADS:-}
    out=${JSON:-docs/figures/platform_gpu.json}
fi
work=${WORK:-/tmp/platform-gpu}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The checkout's packages first, then its metadata (entry points) where it has none.
export PYTHONPATH=$PWD:$PWD/platform:$PWD/web${PYTHONPATH:+:$PYTHONPATH}
if ! "$py" -c 'import importlib.metadata as m; m.version("dipaco")' 2>/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
"$py" -c 'import torch, transformers, django, celery; print(f"torch {torch.__version__}, "
    f"transformers {transformers.__version__}, django {django.__version__}, "
    f"celery {celery.__version__}, cuda {torch.cuda.is_available()}")'
if [ "$device" != cpu ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi

mkdir -p "$work"
corpus=$work/corpus-$max_chars.jsonl
if [[ ! -s $corpus ]]; then
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$py" bench/corpus_jsonl.py "$site" --max-chars "$max_chars" --out "$corpus"
fi
echo "setup and corpus: $(date +%s.%N | awk -v s="$started" '{printf "%.0f", $1 - s}') s"

status=0
"$py" bench/platform_gpu.py --device "$device" --preset "$preset" --rounds "${ROUNDS:-3}" \
    --paths "${PATHS:-2}" --batch "$batch" --unit-seconds "$unit_s" \
    --probe-steps "$probe_steps" --overlap "${OVERLAP:-delayed}" --corpus "$corpus" \
    --budget "$budget" --started-at "$started" --work-dir "$work" --json "$out" \
    ${STOP_AFTER:+--stop-after "$STOP_AFTER"} ${TASKS:+--task-concurrency "$TASKS"} \
    ${SERVER_DEVICE:+--server-device "$SERVER_DEVICE"} \
    ${threads:+--worker-threads "$threads"} || status=$?
if [ -n "${LOGS:-}" ]; then
    mkdir -p "$LOGS"
    run=$(ls -td "$work"/run-* | head -1)
    tar czf "$LOGS/platform_gpu_logs.tgz" -C "$run" logs
fi
seconds=$(date +%s.%N | awk -v s="$started" '{printf "%.0f", $1 - s}')
echo "total: $seconds s (budget $budget s); $out"
exit "$status"
