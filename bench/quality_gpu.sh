#!/usr/bin/env bash
# bench/quality.py at a scale a CPU cannot reach: issue 17's figures on one GPU, in one go
# (docs/benchmarks.md, "Quality on a GPU"). The same code and tiny model as the CPU figures,
# with 16x the batch, 6x the rounds and a corpus of ~40M tokens, so that data-parallel's
# 4x batch is no longer 4x the progress and a path-size dense model meets its capacity.
#
#   bench/quality_gpu.sh OUT_DIR CORPUS.jsonl [QUALITY_ARGS...]
#
# QUALITY_ARGS go last to every bench/quality.py call (a dry run on a CPU: DEVICE=cpu and
# small --rounds, --inner-steps, ...).
# CORPUS: `bench/corpus_jsonl.py .venv/lib/python3.11/site-packages --max-chars 150000000
# --out corpus.jsonl.gz`, gunzipped. Needs a CUDA build of torch and dipaco importable.
# Runs at once, all on the one GPU:
#   smoke  bench/quality.py --quick on the stdlib: the CUDA path end to end; if it fails,
#          everything stops (the failure costs a minute, not the run);
#   main   every key but platform_vs_simulate -> OUT_DIR/quality_gpu.json;
#   b128   DiLoCo and data-parallel at twice the batch -> OUT_DIR/quality_gpu_diloco_b128.json;
#   paper  DiLoCo with the papers' outer step (lr 0.7, momentum 0.9), against main's
#          data-parallel -> OUT_DIR/quality_gpu_diloco_paper_outer.json.
set -uo pipefail
out=${1:?usage: bench/quality_gpu.sh OUT_DIR CORPUS.jsonl}
corpus=${2:?usage: bench/quality_gpu.sh OUT_DIR CORPUS.jsonl}
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
q=("$py" bench/quality.py --device "${DEVICE:-cuda}" --no-platform --codec-seeds 1 --threads 2)
scale=(--corpus "$corpus" --work-dir /tmp/dipaco-quality-gpu --base-steps 500
       --rounds 30 --inner-steps 50 --batch 64
       --diloco-rounds 30 --diloco-inner-steps 50 --diloco-batch 64)
all=a/diloco,a/data-parallel,b/dipaco-fp32,b/dense,b/dense-steps,b/data-parallel
all+=,c/dipaco-int8,c/dipaco-int4

"${q[@]}" --quick --work-dir /tmp/dipaco-quality-smoke "$@" \
    >"$out/smoke.log" 2>&1 &
smoke=$!
"${q[@]}" "${scale[@]}" --jobs 8 --only "$all" --json "$out/quality_gpu.json" "$@" \
    >"$out/main.log" 2>&1 &
main=$!
"${q[@]}" "${scale[@]}" --diloco-batch 128 --diloco-rounds 20 --jobs 2 \
    --only a/diloco,a/data-parallel --json "$out/quality_gpu_diloco_b128.json" "$@" \
    >"$out/b128.log" 2>&1 &
b128=$!
"${q[@]}" "${scale[@]}" --diloco-outer-lr 0.7 --diloco-outer-momentum 0.9 --jobs 1 \
    --only a/diloco --json "$out/quality_gpu_diloco_paper_outer.json" "$@" \
    >"$out/paper.log" 2>&1 &
paper=$!

if ! wait "$smoke"; then
    echo "smoke run failed: stopping the others"
    kill "$main" "$b128" "$paper" 2>/dev/null
    tail -60 "$out/smoke.log"
    exit 1
fi
echo "smoke run passed"
rc=0
for name in main b128 paper; do
    wait "${!name}" || { rc=1; echo "$name failed"; }
    echo "== $name"; tail -30 "$out/$name.log"
done
exit $rc
