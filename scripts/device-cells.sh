#!/bin/bash
# Several `hetfl reproduce` cells side by side on one lent accelerator, under a deadline, for the
# device tool's `run` (which copies the working tree, runs one command and brings back $OUT).
#
#   CELLS="fmnist:0.1:1 mnist:0.5:0" PAPER=fedmho BUDGET=vgg9-e10 DL=560 bash scripts/device-cells.sh
#
# Each cell (dataset:setting:seed) gets its own process, runs folder and upload cache, and runs its
# methods one after another (METHODS, comma-separated; default: the paper's own list), so a cell
# killed at the deadline keeps the methods it finished (each is written to summary.json as it ends).
# A method whose worker finished just before the deadline stopped the cell is merged at the end.
# A client still in local training at the deadline saves its step on SIGTERM (within 30 s), and the
# same command on the same warm machine (its work folder kept) goes on from there: a long client job
# (the `paper` budgets) can span two calls.
# A GPU is saturated by about seven such processes (nvidia-smi showed 99-100 % busy). At the end,
# the summaries, metrics and partitions and every log go to $OUT/cells.tgz. To archive the cells
# (a cell that lacks some of its archived copy's methods goes to partial/<folder>/, named after the
# folder they are gathered in, e.g. the GPU):
#
#   mkdir -p /tmp/u /tmp/cells/gpu-h200 && tar xzf cells.tgz -C /tmp/u
#   cp -r /tmp/u/device-work/runs/*/* /tmp/cells/gpu-h200/
#   .venv/bin/python -c "from pathlib import Path; from hetfl.reproduce.common import archive_cell
#   r = Path('/tmp/cells/gpu-h200')
#   for c in sorted(r.iterdir()): print(archive_cell(r, c.name, Path('docs/results/fedmho-runs')))"
#   .venv/bin/hetfl reproduce fedmho --report-only --out /tmp/empty --results docs/results/fedmho.md
#
# Environment: CELLS (required), PAPER (fedmho or fedhydra; default fedmho), BUDGET (default
# vgg9-e10), METHODS, DL (seconds from start when running cells are stopped; default 540), DEV
# (default cuda), THREADS (torch CPU threads per process; default 2), JOBS (a cell's `--jobs`: its
# clients once, then one worker per method on the cached uploads; a cell's setting may then be a
# comma list, e.g. fmnist:0.5,0.3:0, one process for both), CLIENT_JOBS (with JOBS: a cell's clients
# trained first by this many processes side by side, each a round-robin shard, `--client-jobs`), TESTS (1: also run the GPU tolerance test
# beside the cells), PACK_CACHE (1: also pack the upload caches, to run more methods on the same
# uploads elsewhere; small models only), OUT (default ./device-out), PY (default python3), WORK (the
# working folder, default device-work: two invocations side by side, e.g. with different METHODS,
# need different ones), BATCH (1: `--batch-clients`, each cell's equal classifier clients trained as
# one vectorised batch; time it first with scripts/bench_batch_clients.py), UPLOADS (a folder of
# archived upload caches, one subfolder per cell name, e.g. docs/results/fedhydra-runs/uploads: a cell
# found there has them imported into its cache first, re-keyed for DEV with `hetfl cache import`, so
# that its methods run on the archived cell's byte-identical uploads instead of training new clients).
set -u
T0=$(date +%s)
CELLS=${CELLS:?"CELLS='dataset:setting:seed ...' is required"}
PAPER=${PAPER:-fedmho}; BUDGET=${BUDGET:-vgg9-e10}; DL=${DL:-540}; DEV=${DEV:-cuda}
OUT=${OUT:-$PWD/device-out}; PY=${PY:-python3}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-2} MPLBACKEND=Agg
work=${WORK:-device-work}
mkdir -p "$work/logs" "$OUT"
{ command -v nvidia-smi >/dev/null && nvidia-smi; $PY -c "import sys, torch; print(sys.version); print(torch.__version__, torch.cuda.is_available())"; nproc; } \
  > "$work/logs/env.txt" 2>&1
left() { echo $(( DL - ($(date +%s) - T0) )); }

cell() { # index dataset setting seed
  local log=$work/logs/cell$1.log l
  l=$(left)
  if [ "$l" -le 30 ]; then echo "skip $2 $3 $4: deadline" >> "$log"; return 0; fi
  echo "cell $2 $3 $4 start at $(( $(date +%s) - T0 ))s" >> "$log"
  if [ -n "${UPLOADS:-}" ]; then
    local name
    name=$($PY -c "import sys; from hetfl.reproduce.$PAPER import cell_config
print(cell_config(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])['name'])" "$2" "$3" "$4" "$BUDGET" 2>> "$log")
    if [ -n "$name" ] && [ -d "$UPLOADS/$name" ]; then
      $PY -c "import sys; from hetfl.cli import main; sys.exit(main())" cache import --device "$DEV" \
        --cache-dir "$work/cache/$1" "$UPLOADS/$name" >> "$log" 2>&1
    else
      echo "no archived uploads for ${name:-this cell} in $UPLOADS: its clients are trained here" >> "$log"
    fi
  fi
  timeout -k 30 "$l" $PY -c "import sys; from hetfl.cli import main; sys.exit(main())" reproduce "$PAPER" \
    --budget "$BUDGET" --datasets "$2" --settings "$3" --seeds "$4" ${METHODS:+--methods "$METHODS"} ${JOBS:+--jobs "$JOBS"} ${CLIENT_JOBS:+--client-jobs "$CLIENT_JOBS"} ${BATCH:+--batch-clients} \
    --device "$DEV" --data-root data --cache-dir "$work/cache/$1" --out "$work/runs/$1" \
    --results "$work/res/$1.md" --quiet >> "$log" 2>&1
  echo "cell $2 $3 $4 rc=$? at $(( $(date +%s) - T0 ))s" >> "$log"
}

command -v nvidia-smi >/dev/null && { nvidia-smi dmon -s u -d 15 > "$work/logs/dmon.txt" 2>&1 & }
pids=()
i=0
for spec in $CELLS; do
  IFS=: read -r dataset setting seed <<< "$spec"
  i=$((i + 1))
  cell "$i" "$dataset" "$setting" "$seed" & pids+=($!)
done
if [ "${TESTS:-0}" = 1 ]; then
  (nice -n 10 timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_oneshot.py -k channels_last \
     > "$work/logs/pytest.log" 2>&1; echo "pytest rc=$?" >> "$work/logs/pytest.log") & pids+=($!)
fi
wait "${pids[@]}"
pkill -f "nvidia-smi dmon" 2>/dev/null
# a worker that finished while the deadline stopped its cell's process is joined to the cell here
for root in "$work"/runs/*/; do
  [ -d "$root" ] && $PY -c "import sys; from pathlib import Path; from hetfl.reproduce.common import merge_finished_parts
for p in merge_finished_parts(Path(sys.argv[1])): print('merged after the deadline:', p)" "$root" >> "$work/logs/env.txt" 2>&1
done
echo "done at $(( $(date +%s) - T0 ))s" >> "$work/logs/env.txt"
find "$work/runs" \( -name summary.json -o -name metrics.jsonl -o -name partition.json -o -name "*.log" \) \
  > "$work/logs/files.txt" 2>/dev/null
[ "${PACK_CACHE:-0}" = 1 ] && find "$work/cache" -type f >> "$work/logs/files.txt" 2>/dev/null
tar czf "$OUT/cells.tgz" "$work/logs" -T "$work/logs/files.txt"
grep -h "rc=\|skip" "$work"/logs/cell*.log
