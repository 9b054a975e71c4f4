#!/usr/bin/env bash
# One GPU runs the whole loop (issue 33), in one command of at most 240 s on an H100:
#   warm-start the tiny model on the GPU -> plan the colocated job (tools/configs/one_gpu.json:
#   the CPU demo's task and settings, trainer rank 0 and rollout rank 1 sharing device 0) ->
#   40 asynchronous GRPO steps through `torchrun --nproc_per_node 2 -m hexrl.main` -> held-out
#   accuracy before/after, step time, decode tokens/s, trainer MFU, weight-sync seconds and the
#   trajectory accounting -> `python -m hexrl.plan simulate` on the same plan (with profiles/<gpu>.json
#   when bench_kernels wrote one) -> predicted vs measured step time, and each target's verdict.
#
#   bash tools/gpu_e2e.sh          # on the GPU machine (tools/device/gpu_check.sh's `e2e` stage runs it)
#   bash tools/gpu_e2e.sh --cpu    # the same pipeline on CPU as a smoke run: two ranks declaring one device,
#                                  # a short warm start, 4 steps of a small batch (one_gpu.py job --small);
#                                  # it checks the pipeline, not the GPU targets
#   bash tools/gpu_e2e.sh --cpu --rehearse   # gpu_check.sh --rehearse: a 5-step warm start, the job and its plan
# The model: tools/warm_start.py's recipe in the shape `one_gpu.py warm-shape` gives (head_dim 64, so the bf16
# rollout runs FlashInfer, CUDA graphs, the split sampler and overlap), trained in fp32 on the device (a
# 0.4M-parameter model, ~1000 steps: seconds on a GPU, unmeasured), then run in bf16 as one_gpu.json says.
# Environment: RUN (run directory), STEPS (GRPO steps), PYTHON; PROFILE=1 first measures the warm-started
# model's own shape with bench_kernels --quick (its fixed per-pass costs dominate a tiny model's step) and
# plans and simulates with that profile (RUN/profiles), at the price of the bench's time.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
CPU=0 REHEARSE=0
[[ " $* " == *" --cpu "* ]] && CPU=1
[[ " $* " == *" --rehearse "* ]] && REHEARSE=1
for a in "$@"; do [[ $a == --cpu || $a == --rehearse ]] || { echo "gpu_e2e: unknown argument '$a'"; exit 2; }; done
if (( CPU )); then
  source tools/python.sh
  DEVICE=cpu GPU=cpu
  RUN=${RUN:-runs/one_gpu_cpu} STEPS=${STEPS:-4}
  WARM=(--steps 100 --eval-every 100 --target-acc 0 --n-heldout 100)  # a smoke run: short, small
  (( REHEARSE )) && WARM=(--steps 5 --eval-every 5 --target-acc 0 --n-heldout 20 --n-dev 10 --threads 1)
else
  PY=${PYTHON:-python3}
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}  # where gpu_check.sh installs the carried wheels
  if ! "$PY" -c "import flashinfer, zmq, highspy" 2>/dev/null; then  # run alone: install the carried wheels
    PY=$PY bash tools/device/install_wheels.sh || exit 1
  fi
  DEVICE=cuda GPU=$("$PY" tools/one_gpu.py gpu)
  RUN=${RUN:-runs/one_gpu} STEPS=${STEPS:-40}
  WARM=()
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
rm -rf "$RUN"
mkdir -p "$RUN"
echo "== warm start on $DEVICE ($(( $(date +%s) - START ))s)"
# shellcheck disable=SC2046
"$PY" tools/warm_start.py "$RUN/model" --device "$DEVICE" $("$PY" tools/one_gpu.py warm-shape) "${WARM[@]}" | tail -3
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== profile the model's own shape: bench_kernels --quick ($(( $(date +%s) - START ))s)"
  "$PY" -m tools.bench.bench_kernels --config "$RUN/model" --quick --out "$RUN/profiles" | tail -2
  export HEXRL_PROFILES=$RUN/profiles
fi
echo "== plan: trainer and rollout colocated on one $GPU ($(( $(date +%s) - START ))s)"
"$PY" tools/one_gpu.py job tools/configs/one_gpu.json "$RUN" "$GPU" $( (( CPU )) && echo --small) >/dev/null
"$PY" -m hexrl.plan "$RUN/job.json" -o "$RUN/plan.json"
if (( REHEARSE )); then
  echo "gpu_e2e: rehearsal: warm start, job and plan made; the run itself is not started ($(( $(date +%s) - START )) s)"
  exit 0
fi
echo "== run: torchrun, 2 ranks on one device, $STEPS steps ($(( $(date +%s) - START ))s)"
T0=$(date +%s)
"$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m hexrl.main "$RUN/plan.json" --run-dir "$RUN" \
  --steps "$STEPS"
LAUNCH=$(( $(date +%s) - T0 ))
echo "== simulate the same plan ($(( $(date +%s) - START ))s)"
"$PY" -m hexrl.plan simulate "$RUN/plan.json" --steps 24 --warmup 2 --json "$RUN/simulate.json"
echo "== report"
"$PY" tools/one_gpu.py report "$RUN" --launch-s "$LAUNCH" --total-s $(( $(date +%s) - START ))
echo "gpu_e2e: $(( $(date +%s) - START )) s in all"
if (( CPU )); then
  echo "gpu_e2e: a CPU smoke run checks the pipeline (warm start, plan, run, report), not the GPU targets: the" \
       "verdicts above are for a GPU run"
fi
