#!/usr/bin/env bash
# Everything a lent GPU should run, in one device call (issue 8):
#   install the carried wheels -> versions -> bench_kernels (writes profiles/<gpu>.json)
#   -> compare_cost_model -> pytest -m gpu -> bench_sampling -> bench_train (if present) -> bench_rollout -> bench_fused -> bench_host_overhead.
# Here, once: `bash tools/prepare_device_wheels.sh` (fills .whl/). On the device:
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Every stage runs under its own cap and a global deadline (BUDGET_S, default 300 s, so one short
# GPU slot also fits the end-to-end run): a stage that fails or times out is reported and the rest
# still run; each stage prints its time and the budget left. Expected on an H100 (2026-11-26 log,
# 338 s then): kernels ~70 s, pytest -m gpu ~80 s, train ~50 s, rollout ~75 s, the rest ~20 s.
# A follow-up call can run what was cut off: STAGES="wheels pytest rollout" bash tools/gpu_check.sh
# QUICK=1 shrinks every grid (a smoke run). Grids are small on purpose: bench_kernels' decode grid
# is 4 batches x 3 contexts (~1-2 min plus FlashInfer's JIT), bench_rollout runs 1024 output
# tokens at batch 1, 64, 256 and HF generate only on short runs (batch 1 x 128, batch 64 x 256,
# ours beside each: HF's 1024-token runs took 186 s), bench_train runs plain, decoupled and
# checkpointing in one process.
# Logs and the profile land in $OUT (the device returns at most 8 files): gpu_check.log (all
# output), pytest.log, summary.txt, and the profile JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
QUICK=${QUICK:-0}
STAGES=${STAGES:-all}  # or a subset: "wheels versions kernels compare pytest sampling train rollout fused overlap e2e"
BUDGET_S=${BUDGET_S:-300}
PY=${PYTHON:-python3}
START=$(date +%s)
SUMMARY=()
mkdir -p "$OUT" profiles

elapsed() { echo $(( $(date +%s) - START )); }

# stage NAME CAP_S CMD...: run CMD under min(CAP_S, time left before the deadline); record the outcome
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$(( BUDGET_S - $(elapsed) - 10 ))
  (( cap > left )) && cap=$left
  if (( cap < 15 )); then
    SUMMARY+=("$(printf '%-8s %-22s %s' SKIPPED "$name" "(out of time)")")
    echo "=== $name: skipped, out of time ==="
    return
  fi
  echo
  echo "=== $name (cap ${cap}s, at $(elapsed)s) ==="
  local t0 rc status
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@"
  rc=$?
  case $rc in
    0) status=OK ;;
    124|137) status=TIMEOUT ;;
    *) status="FAIL($rc)" ;;
  esac
  SUMMARY+=("$(printf '%-8s %-22s %4ds' "$status" "$name" $(( $(date +%s) - t0 )))")
  echo "--- $name: $status in $(( $(date +%s) - t0 ))s; $(elapsed)s of the ${BUDGET_S}s budget used ---"
}

install_wheels() {
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no .whl/*.whl carried (run tools/prepare_device_wheels.sh here and carry .whl): flashinfer, pyzmq, highspy missing"
    return 1
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}

show_versions() {
  nvidia-smi || echo "nvidia-smi failed"
  $PY - <<'EOF'
import importlib, torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for name in ("flashinfer", "zmq", "highspy", "transformers"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), "import ok")
    except Exception as e:  # report, don't stop: the stages that need it will fail on their own
        print(name, "IMPORT FAILED:", repr(e))
EOF
}

want() { [[ $STAGES == all || " $STAGES " == *" $1 "* ]]; }

main() {
  echo "gpu_check: QUICK=$QUICK STAGES=$STAGES BUDGET_S=$BUDGET_S OUT=$OUT ($(date -u +%FT%TZ))"
  export PY PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # tests/conftest.py would otherwise turn the interpreter on
  local marker
  marker=$(mktemp)  # profiles written after this are this run's
  want wheels && stage wheels 90 bash -c "$(declare -f install_wheels); install_wheels"
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  want versions && stage versions 60 bash -c "$(declare -f show_versions); show_versions"
  local quick=() train=(--configs plain,decoupled,checkpointing --steps 2)
  local rollout=(--batch 1 --batch 64 --batch 256 --output-len 1024 --hf-runs 1x128,64x256)
  if [[ $QUICK == 1 ]]; then
    quick=(--quick); train=(--seqs 8 --steps 2); rollout=(--batch 1 --batch 64 --output-len 128 --no-hf)
  fi
  # FlashInfer JIT-compiles its kernels on first use (minutes on a fresh machine): bench_kernels
  # goes first, so the profile is written even if later stages run out of time
  want kernels && stage bench_kernels 100 $PY tools/bench/bench_kernels.py --out profiles/ "${quick[@]}"
  local profile
  profile=$(find profiles -maxdepth 1 -name '*.json' -newer "$marker" 2>/dev/null | head -1)
  if want compare && [[ -n $profile ]]; then
    stage compare_cost_model 60 $PY tools/bench/compare_cost_model.py "$profile"
  elif want compare; then
    SUMMARY+=("$(printf '%-8s %-22s %s' SKIPPED compare_cost_model '(no profile written by this run)')")
  fi
  want pytest && stage "pytest -m gpu" 100 bash -c \
    "set -o pipefail; $PY -m pytest -m gpu -q -p no:cacheprovider -rfEs 2>&1 | tee '$OUT/pytest.log'"
  want sampling && stage bench_sampling 60 $PY tools/bench/bench_sampling.py
  if want train && [[ -f tools/bench/bench_train.py ]]; then
    stage bench_train 75 $PY tools/bench/bench_train.py "${train[@]}"
  fi
  want rollout && stage bench_rollout 90 $PY tools/bench/bench_rollout.py "${rollout[@]}"
  # issue 34: split vs fused weights vs fused + FlashInfer kernels, per decode step (last: runs if time is left)
  want fused && stage bench_fused 150 $PY tools/bench/bench_fused.py
  # issue 34: engine loop without / with host-GPU overlap, host vs wall ms per decode step (1.5B, random weights)
  want overlap && stage bench_host_overhead 120 $PY tools/bench/bench_host_overhead.py --model qwen2.5-1.5b \
    --batch 64 --context 1024 --steps 40 --repeats 2
  # issue 33: one GPU runs the whole loop (trainer and rollout colocated), <= 240 s; alone: STAGES="wheels e2e"
  want e2e && stage e2e 240 bash tools/gpu_e2e.sh

  [[ -n $profile ]] && cp "$profile" "$OUT/"
  rm -f "$marker"
  {
    echo "gpu_check summary ($(elapsed)s in all of a ${BUDGET_S}s budget: $( (( $(elapsed) <= BUDGET_S )) && echo within || echo OVER); QUICK=$QUICK STAGES=$STAGES)"
    printf '  %s\n' "${SUMMARY[@]}"
    [[ -n $profile ]] && echo "  profile: $profile (copied to \$OUT)"
    [[ -f $OUT/pytest.log ]] && echo "  pytest: $(tail -1 "$OUT/pytest.log")"
    grep -hE "^planner keys|median error|^targets:" "$OUT/gpu_check.log" 2>/dev/null | sed 's/^/  /'
  } > "$OUT/summary.txt"
  echo
  cat "$OUT/summary.txt"
  [[ ! "${SUMMARY[*]}" =~ FAIL|TIMEOUT ]]  # exit status: 0 only if every stage that ran passed
}

main "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
