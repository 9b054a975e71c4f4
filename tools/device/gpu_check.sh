#!/usr/bin/env bash
# Everything a lent GPU should measure, in two device calls of at most 5 minutes each, by priority (issue 42):
#   call 1: (a) trainer step MFU and peak memory at the 1.5B shape (bench_train plain, decoupled)
#           (b) the decode grid (bench_kernels, which writes profiles/<gpu>.json) and the sampling kernels
#               (bench_sampling); (d) compare_cost_model reads that profile (~1 s, so right after (b))
#           (c) the one-GPU end-to-end run (tools/gpu_e2e.sh: bf16, FlashInfer, CUDA graphs, overlap)
#   call 2: (e) pytest -m gpu   (f) the rest: bench_rollout, bench_fused, bench_host_overhead
# Both start with the carried wheels and prebuilt FlashInfer modules (tools/device/prepare_device_wheels.sh fills
# .whl/ here first) and the versions. Each stage runs under its own cap and the call's deadline (BUDGET_S,
# default 290 s); a stage cut off or failed is recorded and the next one runs. As it goes, every stage's
# figures land in $OUT: gpu_check.log (all output), gpu_results.json (machine-readable, updated after each
# stage: tools/device/gpu_results.py), pytest.log, summary.txt and the profile.
#   run(command="bash tools/device/gpu_check.sh --call 1", carry=[".whl"], timeout_s=300)
#   run(command="bash tools/device/gpu_check.sh --call 2", carry=[".whl"], timeout_s=300)
#   bash tools/device/gpu_check.sh --rehearse [--call N]   # on CPU: the same script, each stage's command in its
#       smallest CPU form (or its argument parsing where a CPU cannot run it): no typo, missing file or flag
# STAGES="train e2e" runs a subset of the call's stages (names: wheels versions train kernels compare sampling
# e2e pytest rollout fused overlap). Without CUDA (and without --rehearse) it refuses in one line.
set -uo pipefail
cd "$(dirname "$0")/../.."
CALL=1 REHEARSE=0
while (( $# )); do
  case $1 in
    --call) CALL=${2:-}; shift 2 ;;
    --rehearse) REHEARSE=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (--call 1|2, --rehearse)"; exit 2 ;;
  esac
done
[[ $CALL == 1 || $CALL == 2 ]] || { echo "gpu_check: --call must be 1 or 2, got '$CALL'"; exit 2; }
OUT=${OUT:-/tmp/gpu_check_out}
STAGES=${STAGES:-all}
BUDGET_S=${BUDGET_S:-290}
PY=${PYTHON:-python3}
START=$(date +%s)
SUMMARY=()
mkdir -p "$OUT" profiles
if (( ! REHEARSE )) && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): run it on the GPU machine, or --rehearse"
  exit 2
fi
RESULTS=$OUT/gpu_results.json
STAGE_LOG=$OUT/.stage.log

elapsed() { echo $(( $(date +%s) - START )); }
want() { [[ $STAGES == all || " $STAGES " == *" $1 "* ]]; }

# stage NAME CAP_S CMD...: run CMD under min(CAP_S, time left), log it, record its outcome and its figures
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$(( BUDGET_S - $(elapsed) - 5 ))
  (( cap > left )) && cap=$left
  if (( cap < 10 )); then
    SUMMARY+=("$(printf '%-8s %-22s %s' SKIPPED "$name" "(out of time)")")
    echo "=== $name: skipped, out of time ==="
    "$PY" tools/device/gpu_results.py stage "$RESULTS" "$name" SKIPPED 0 /dev/null
    return 1
  fi
  echo
  echo "=== $name (cap ${cap}s, at $(elapsed)s) ==="
  local t0 rc status
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$STAGE_LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=OK ;;
    124|137) status=TIMEOUT ;;
    *) status="FAIL($rc)" ;;
  esac
  local took=$(( $(date +%s) - t0 ))
  SUMMARY+=("$(printf '%-8s %-22s %4ds' "$status" "$name" "$took")")
  echo "--- $name: $status in ${took}s; $(elapsed)s of the ${BUDGET_S}s budget used ---"
  "$PY" tools/device/gpu_results.py stage "$RESULTS" "$name" "$status" "$took" "$STAGE_LOG"
  [[ $status == OK ]]
}

rehearse_wheels() {  # a CPU cannot install CUDA wheels usefully: parse the scripts, list the modules
  bash -n tools/device/prepare_device_wheels.sh && "$PY" tools/device/flashinfer_aot.py --help >/dev/null \
    && echo "rehearsal: prepare_device_wheels.sh parses; flashinfer_aot.py runs" \
    && if "$PY" -c "import flashinfer" 2>/dev/null; then "$PY" tools/device/flashinfer_aot.py list; fi
}

show_versions() {
  nvidia-smi || echo "nvidia-smi failed"
  "$PY" - <<'EOF'
import importlib, torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for name in ("flashinfer", "tvm_ffi", "zmq", "highspy", "transformers"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), "import ok")
    except Exception as e:  # report, don't stop: the stages that need it will fail on their own
        print(name, "IMPORT FAILED:", repr(e))
EOF
}

# pick DEVICE_FORM REHEARSAL_FORM: the stage's command on the GPU, or its smallest CPU form; a rehearsal also
# checks the device form: its tool exists and declares every --flag the form passes
pick() {
  if (( ! REHEARSE )); then eval "CMD=($1)"; return; fi
  eval "CMD=($2)"
  local dev tool= word
  eval "dev=($1)"
  for word in "${dev[@]}"; do [[ $word == *.py || $word == *.sh ]] && { tool=$word; break; }; done
  [[ -z $tool ]] && return
  [[ -f $tool ]] || { echo "gpu_check: the device form names $tool, which does not exist"; exit 3; }
  for word in "${dev[@]}"; do
    if [[ $word == --* ]] && ! grep -q -- "[\"]${word%%=*}[\"]" "$tool"; then
      echo "gpu_check: the device form passes $word, which $tool does not declare"
      exit 3
    fi
  done
}

call1() {
  local B=tools/bench CMD
  pick "$PY $B/bench_train.py --configs plain,decoupled --steps 2" \
       "$PY $B/bench_train.py --shape tiny --seqs 2 --prompt-len 8 --completion-len 8 --micro-batch-tokens 64 --steps 1 --configs plain,decoupled"
  want train && stage bench_train 75 "${CMD[@]}"
  local marker profile=
  marker=$(mktemp)  # profiles written after this are this run's
  pick "$PY $B/bench_kernels.py --out profiles/" "$PY $B/bench_kernels.py --grid cpu --out $OUT/profiles"
  want kernels && stage bench_kernels 90 "${CMD[@]}"
  profile=$(find profiles "$OUT/profiles" -maxdepth 1 -name '*.json' -newer "$marker" 2>/dev/null | head -1)
  rm -f "$marker"
  if want compare && [[ -n $profile ]]; then
    stage compare_cost_model 20 "$PY" $B/compare_cost_model.py "$profile"
    cp "$profile" "$OUT/"
  elif want compare; then
    SUMMARY+=("$(printf '%-8s %-22s %s' SKIPPED compare_cost_model '(no profile written by this run)')")
  fi
  pick "$PY $B/bench_sampling.py" "$PY $B/bench_sampling.py --batch 1"
  want sampling && stage bench_sampling 30 "${CMD[@]}"
  pick "bash tools/gpu_e2e.sh" "bash tools/gpu_e2e.sh --cpu --rehearse"
  want e2e && stage e2e 200 "${CMD[@]}"
}

call2() {
  local B=tools/bench CMD
  pick "bash -c 'set -o pipefail; $PY -m pytest -m gpu -q -p no:cacheprovider -rfEs 2>&1 | tee $OUT/pytest.log'" \
       "bash -c 'set -o pipefail; $PY -m pytest -m gpu -q -p no:cacheprovider --collect-only 2>&1 | tee $OUT/pytest.log'"
  want pytest && stage "pytest -m gpu" 150 "${CMD[@]}"
  pick "$PY $B/bench_rollout.py --batch 1 --batch 64 --batch 256 --output-len 1024 --hf-runs 1x128,64x256" \
       "$PY $B/bench_rollout.py --batch 1 --batch 2 --prompt-len 4 --output-len 4 --no-hf"
  want rollout && stage bench_rollout 90 "${CMD[@]}"
  pick "$PY $B/bench_fused.py" "$PY $B/bench_fused.py --batch 1 --context 8"
  want fused && stage bench_fused 80 "${CMD[@]}"
  pick "$PY $B/bench_host_overhead.py --model qwen2.5-1.5b --batch 64 --context 1024 --steps 40 --repeats 2" \
       "$PY $B/bench_host_overhead.py --model tiny --batch 2 --context 8 --steps 3 --repeats 1"
  want overlap && stage bench_host_overhead 60 "${CMD[@]}"
}

main() {
  echo "gpu_check: call $CALL$( (( REHEARSE )) && echo ' (REHEARSAL on CPU: smallest forms, no GPU figures)')" \
       "STAGES=$STAGES BUDGET_S=$BUDGET_S OUT=$OUT ($(date -u +%FT%TZ))"
  export PY PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # tests/conftest.py would otherwise turn the interpreter on
  "$PY" tools/device/gpu_results.py init "$RESULTS" --call "$CALL" $( (( REHEARSE )) && echo --rehearse)
  if want wheels; then
    if (( REHEARSE )); then
      stage wheels 60 bash -c rehearse_wheels
    elif ! stage wheels 60 bash tools/device/install_wheels.sh; then
      echo "gpu_check: the wheels stage failed: every later stage needs flashinfer, pyzmq and highspy; stopping"
      return 1
    fi
  fi
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  want versions && stage versions 30 bash -c show_versions
  if (( CALL == 1 )); then call1; else call2; fi
  {
    echo "gpu_check call $CALL summary ($(elapsed)s of a ${BUDGET_S}s budget$( (( REHEARSE )) && echo '; REHEARSAL'))"
    printf '  %s\n' "${SUMMARY[@]}"
    [[ -f $OUT/pytest.log ]] && echo "  pytest: $(tail -1 "$OUT/pytest.log")"
    grep -hE "^planner keys|median error|^targets:" "$OUT/gpu_check.log" 2>/dev/null | sed 's/^/  /'
  } > "$OUT/summary.txt"
  rm -f "$STAGE_LOG"
  echo
  cat "$OUT/summary.txt"
  [[ ! "${SUMMARY[*]}" =~ FAIL|TIMEOUT ]]  # exit status: 0 only if every stage that ran passed
}

export -f rehearse_wheels show_versions
main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
