#!/usr/bin/env bash
# The CUDA checks of one short lease on a GPU machine, in priority order, each step time-boxed so a slow or failing
# step leaves the others their time. The whole log goes to $OUT/checks.log (default /tmp/cuda-checks), each step's
# last lines to stdout. Run from the repository root:
#
#     bash bench/cuda_checks.sh            # all steps
#     STEPS="packed validate" bash bench/cuda_checks.sh
#     DEVICE=cpu FORWARD="--blocks 1,1 --tokens 64 --text 16" STEPS="packed validate" bash bench/cuda_checks.sh  # dry run
#
# Wheels the machine lacks travel in .whl/ (pure-Python ones, pip download --no-deps); .whl/alt/ holds newer
# transformers / huggingface_hub, installed only if the machine's own cannot import the pipeline.
#   1. packed:   the demo's klein-wide model, its SVDQuant int4 file run packed on cuda (generate, w4a16 and w4a4,
#                against the bf16 folder; the same model written in diffusers' Nunchaku layout, run packed)
#   2. forward:  bench/svdquant.py's forward at klein-9B widths on cuda
#   3. validate: port validate --device cuda against the CPU golden, the bf16 folder and the packed file
#   4. offload:  bench/offload.py at klein-4B size, offload none and model, t2i
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/cuda-checks}
STEPS=${STEPS:-"packed forward validate offload"}
DEVICE=${DEVICE:-cuda}
FORWARD=${FORWARD:-"--blocks 2,6 --tokens 4096 --text 512"}
ROOT=$(pwd)
W=${WORK:-/tmp/fp-cuda}
mkdir -p "$OUT" "$W"

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$ROOT
    if ! python3 -c "from diffusers import Flux2KleinPipeline; import porting.cli.app" 2>>"$OUT/checks.log"; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/alt/*.whl
    fi
else
    export PYTHONPATH=$ROOT
fi
PORT=(python3 -m porting)

step() {  # step NAME SECONDS CMD...: one time-boxed step; all of its output in checks.log, its end on stdout
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/checks.log"
    timeout "$limit" "$@" >"$W/step.log" 2>&1
    rc=$?
    cat "$W/step.log" >>"$OUT/checks.log"
    tail -n 8 "$W/step.log" | cut -c 1-400
    echo "== $name: exit $rc in $(($(date +%s) - t0)) s" | tee -a "$OUT/checks.log"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, diffusers, transformers, huggingface_hub as h; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available(), '| diffusers', diffusers.__version__, '| transformers', transformers.__version__, \
'| huggingface_hub', h.__version__)"
    nproc
} 2>&1 | tee -a "$OUT/checks.log"

cd "$W" || exit 1
if [[ " $STEPS " == *" packed "* || " $STEPS " == *" validate "* ]]; then
    step demo 180 "${PORT[@]}" demo --family klein-wide
    step svdq-convert 120 "${PORT[@]}" convert demo-out/klein-wide/transformer --quantize svdq-int4 --out svdq
fi
SVDQ=$(ls svdq/*.safetensors 2>/dev/null | head -n 1)
BASE=demo-out/klein-wide/published

if [[ " $STEPS " == *" packed "* ]]; then
    step gen-bf16 120 "${PORT[@]}" generate "$BASE" --device "$DEVICE" --prompt "a red fox" -o bf16.png --json
    for c in w4a16 w4a4; do
        step "gen-$c" 120 "${PORT[@]}" generate "$BASE" --device "$DEVICE" --transformer "$SVDQ" --svdq-compute "$c" \
            --prompt "a red fox" -o "$c.png" --json
    done
    step lite-convert 120 "${PORT[@]}" convert demo-out/klein-wide/transformer --quantize svdq-int4 \
        --layout diffusers --out lite
    step gen-lite 120 "${PORT[@]}" generate "$BASE" --device "$DEVICE" --transformer lite --svdq-compute w4a16 \
        --prompt "a red fox" -o lite.png --json
fi
if [[ " $STEPS " == *" forward "* ]]; then
    # shellcheck disable=SC2086
    step svdq-forward 300 python3 "$ROOT/bench/svdquant.py" --device "$DEVICE" $FORWARD --workdir "$W"
fi

if [[ " $STEPS " == *" validate "* ]]; then
    step validate-bf16 150 "${PORT[@]}" validate demo-out/klein-wide/transformer --device "$DEVICE" -o val-bf16
    step validate-fp16 150 "${PORT[@]}" validate demo-out/klein-wide/transformer --device "$DEVICE" --dtype fp16 \
        -o val-fp16
    for c in w4a16 w4a4; do
        step "validate-$c" 150 "${PORT[@]}" validate "$SVDQ" --device "$DEVICE" --svdq-compute "$c" -o "val-$c"
    done
fi

if [[ " $STEPS " == *" offload "* ]]; then
    step offload 300 python3 "$ROOT/bench/offload.py" --model klein-4b --device "$DEVICE" --offload none,model \
        --task t2i --steps 4 --runs 1 --work "$W/offload"
fi
