#!/usr/bin/env bash
# The CPU demo: a tiny model, warm-started on arithmetic, trained by asynchronous GRPO with
# 2 trainer ranks + 1 rollout rank under torchrun on this machine. Writes runs/demo/.
# HEXRL_SKIP_SETUP=1: use the environment as it is (PYTHON=... to name its python), install nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${HEXRL_SKIP_SETUP:-0}" = 1 ] || bash tools/setup.sh
source tools/python.sh
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1  # progress as it happens, also through a pipe
if [ "${1:-}" = agentic ]; then  # the calculator environment vs no tool, briefly (docs/agentic.md)
  exec "$PY" tools/experiments/agentic_study.py "${RUN:-runs/agentic}" --quick
fi
RUN=${RUN:-runs/demo}
mkdir -p "$RUN"
if [ ! -f "$RUN/model/config.json" ]; then
  echo "== warm start: short supervised phase on the synthetic task (progress, time left: $RUN/warm_start.log)"
  "$PY" tools/warm_start.py "$RUN/model" 2>&1 | tee "$RUN/warm_start.log"
fi
if [[ " $* " != *" --resume "* ]]; then  # a fresh demo run each time (the warm start is kept)
  rm -rf "$RUN/metrics.jsonl" "$RUN/eval.jsonl" "$RUN/checkpoints" "$RUN/final" "$RUN/eval_model"
fi
echo "== plan"
# the demo job, pointed at this run directory's model (cpu_demo.json names runs/demo's)
"$PY" - "$RUN" <<'PYEOF'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1]).resolve()
job = json.loads(pathlib.Path("tools/configs/cpu_demo.json").read_text())
job["model"]["path"], job["out_dir"] = str(run / "model"), str(run)
(run / "job.json").write_text(json.dumps(job, indent=1) + "\n")
PYEOF
"$PY" -m hexrl.plan "$RUN/job.json" -o "$RUN/plan.json"
echo "== run: torchrun, 3 processes (2 trainer, 1 rollout)"
START=$(date +%s)
"$PY" -m torch.distributed.run --standalone --nproc_per_node 3 -m hexrl.main "$RUN/plan.json" --run-dir "$RUN" "$@"
echo "== done"
"$PY" -m hexrl.control.summary "$RUN" --launch-s $(( $(date +%s) - START ))
echo "try it: $PY -m hexrl.generate $RUN --prompt 37+45= --temperature 0 --max-new-tokens 5"
