#!/usr/bin/env bash
# One command for a GPU owner: install memcalc's three dependencies from .whl/ if given,
# run the live validation within a time budget, and leave the results in
# validation/results/<gpu>-<torch>.json (and in $OUT when that is set). Rerun to resume.
#
#   bash validation/run_gpu.sh [MAX_SECONDS] [extra memcalc validate options]
#
# MAX_SECONDS (default 500) bounds the cases started; the one in flight finishes.
set -u
cd "$(dirname "$0")/.."
max_seconds="${1:-500}"
shift || true
python=${PYTHON:-python3}

if ls .whl/*.whl >/dev/null 2>&1; then
  # pydantic and rich (with their dependencies) as wheels, into a private folder;
  # numpy only if the host has none (torch's wheels do not pull it in)
  wheels=$(ls .whl/*.whl | grep -v '/numpy-')
  "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $wheels || exit 2
  if ! "$python" -c "import numpy" 2>/dev/null && ls .whl/numpy-*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy-*.whl || exit 2
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

"$python" -c "import memcalc, pydantic, numpy, rich, torch; print('memcalc from', memcalc.__file__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())" || exit 2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true

mkdir -p validation/results
log="${OUT:-/tmp}/validate.log"
COLUMNS=200 "$python" -m memcalc.cli validate --backend cuda --out validation/results/ \
  --max-seconds "$max_seconds" "$@" > "$log" 2>&1
status=$?
tail -n 60 "$log"
if [ -n "${OUT:-}" ]; then
  cp validation/results/*.json "$OUT"/ 2>/dev/null || true
fi
# 0: every configuration agrees; 1: some differ (the report says where and why); 2: error
exit $status
