#!/bin/bash
# Several `hetfl run` trials of one config side by side on one lent accelerator, each with its own
# `--set` overrides, all on one (carried) upload cache, under a deadline; for the device tool's `run`
# (which copies the working tree, runs one command and brings back a few files from $OUT).
#
#   CONFIG=configs/fedhydra-fmnist-paper.yaml METHOD=fedhydra_dense_log1p CACHE=cache/gpu-paper \
#     TRIALS="g30a: g30b: g10a:methods.fedhydra_dense_log1p.generator_steps=10 a03:partition.alpha=0.3" \
#     DL=300 bash scripts/device-trials.sh
#
# A trial is name:overrides, the overrides comma-separated KEY=VALUE pairs, each passed as
# `--set KEY=VALUE` (empty: the config as it is). Carry the cache (`carry: ["data",
# "cache/gpu-paper"]`): a trial whose client requests hit it trains no client, so every trial distils
# from the same uploads (`uploads_sha256` in each summary); with a cold cache every trial trains the
# clients itself, side by side and not shared, so run one trial first to fill it. Trials still
# running at the deadline are stopped (SIGTERM; a data-free server stage first finishes its epoch and
# saves a checkpoint, SIGKILL after 30 s); their per-epoch log is kept, since the simulator appends to
# it at every evaluation. At the end each trial's METHOD log (metrics.jsonl), summary.json and final
# global model (when it finished) go to $OUT/trials.tgz as <name>.jsonl, <name>.summary.json and
# <name>.safetensors (the server model: keep it small), with every trial's console log. To read them here:
#
#   mkdir -p /tmp/t && tar xzf trials.tgz -C /tmp/t && ls /tmp/t/device-work/trials/out
#
# A trial's curve is kept beside its archived cell (runs.json; `--change` names the setting it changes):
#
#   .venv/bin/hetfl archive-run fedhydra /tmp/t/device-work/trials/out/<name>.summary.json \
#     --method <method> --change "<setting> (H200)" --label "<what, where, which session>" --curve <file>.jsonl
#
# A trial run as configured (no overrides of the method) on an archived cell's uploads can join that
# cell (checked: same setting, same uploads_sha256, same method config; say where it ran in the note):
#
#   .venv/bin/python -c "import json; from pathlib import Path; from hetfl.reproduce.common import merge_methods
#   print(merge_methods(Path('docs/results/fedhydra-runs/<cell>.json'),
#         json.load(open('/tmp/t/device-work/trials/out/<name>.summary.json')), ['<method>']))"
#
# Environment: TRIALS, METHOD (required), CONFIG (required unless CELL), CACHE (default cache), DL
# (seconds from start when running trials are stopped; default 300), DEV (default cuda), THREADS
# (torch CPU threads per process; default 2), OUT (default ./device-out), PY (default python3), WORK
# (default device-work/trials), CELL (dataset:setting:seed, with PAPER and BUDGET: instead of CONFIG,
# the reproduction's own config of that cell, `cell_config(...)` of hetfl.reproduce.<PAPER> written to
# $WORK/cell.json; `--set` cannot remove keys, so this is how a 2c/c cell is tried), UPLOADS (a folder
# of archived upload caches, one subfolder per cell name, e.g. docs/results/fedhydra-runs/uploads:
# the config's cell found there is imported into CACHE first, re-keyed for DEV with `hetfl cache
# import`, so the trials distil from the archived cell's byte-identical uploads).
#
#   CELL=mnist:2c/c:0 PAPER=fedhydra BUDGET=paper METHOD=fedhydra_dense_log1p CACHE=cache/m2cc \
#     UPLOADS=docs/results/fedhydra-runs/uploads TRIALS="cfg: lr5:methods.fedhydra_dense_log1p.lr=0.005" \
#     DL=540 bash scripts/device-trials.sh
set -u
T0=$(date +%s)
TRIALS=${TRIALS:?"TRIALS='name:KEY=VALUE,KEY=VALUE ...' is required"}
[ -n "${CELL:-}" ] || CONFIG=${CONFIG:?"CONFIG (the config file every trial runs) or CELL is required"}
METHOD=${METHOD:?"METHOD (the config's method the trials run) is required"}
CACHE=${CACHE:-cache}; DL=${DL:-300}; DEV=${DEV:-cuda}; OUT=${OUT:-$PWD/device-out}; PY=${PY:-python3}
work=${WORK:-device-work/trials}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-2} MPLBACKEND=Agg
mkdir -p "$work/logs" "$work/out" "$OUT"

if [ -n "${CELL:-}" ]; then
  PAPER=${PAPER:?"PAPER (fedhydra or fedmho) is required with CELL"}
  IFS=: read -r cell_dataset cell_setting cell_seed <<< "$CELL"
  CONFIG=$work/cell.json
  $PY -c "import json, sys; from hetfl.reproduce.$PAPER import cell_config
cfg = cell_config(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], methods=(sys.argv[5],))
json.dump(cfg, open(sys.argv[6], 'w'), indent=1)" "$cell_dataset" "$cell_setting" "$cell_seed" \
    "${BUDGET:?"BUDGET is required with CELL"}" "$METHOD" "$CONFIG" 2>> "$work/logs/setup.log" \
    || { echo "CELL=$CELL (PAPER=$PAPER): no config, see $work/logs/setup.log" >&2; exit 1; }
fi
if [ -n "${UPLOADS:-}" ]; then
  name=$($PY -c "import sys; from hetfl.config import load_config
print(load_config(sys.argv[1])['name'])" "$CONFIG" 2>> "$work/logs/setup.log")
  if [ -n "$name" ] && [ -d "$UPLOADS/$name" ]; then
    $PY -c "import sys; from hetfl.cli import main; sys.exit(main())" cache import --device "$DEV" \
      --cache-dir "$CACHE" "$UPLOADS/$name" >> "$work/logs/setup.log" 2>&1
  else
    echo "no archived uploads for ${name:-this config} in $UPLOADS: the trials train their clients" \
      >> "$work/logs/setup.log"
  fi
fi

trial() { # name overrides
  local log=$work/logs/$1.log l sets=()
  local IFS=,
  for kv in $2; do sets+=(--set "$kv"); done
  unset IFS
  l=$(( DL - ($(date +%s) - T0) ))
  if [ "$l" -le 10 ]; then echo "skip $1: deadline" >> "$log"; return 0; fi
  echo "trial $1 (${2:-as configured}) start at $(( $(date +%s) - T0 ))s" >> "$log"
  timeout -k 30 "$l" $PY -c "import sys; from hetfl.cli import main; sys.exit(main())" run "$CONFIG" \
    --device "$DEV" --cache-dir "$CACHE" --methods "$METHOD" "${sets[@]}" --out "$work/runs/$1" --quiet \
    >> "$log" 2>&1
  echo "trial $1 rc=$? at $(( $(date +%s) - T0 ))s" >> "$log"
}

pids=()
for spec in $TRIALS; do
  name=${spec%%:*}
  overrides=${spec#*:}
  [ "$overrides" = "$spec" ] && overrides=""
  trial "$name" "$overrides" & pids+=($!)
done
wait "${pids[@]}"
for spec in $TRIALS; do
  name=${spec%%:*}
  f=$(find "$work/runs/$name" -path "*/$METHOD/metrics.jsonl" 2>/dev/null | head -1)
  [ -n "$f" ] && cp "$f" "$work/out/$name.jsonl"
  s=$(find "$work/runs/$name" -name summary.json 2>/dev/null | head -1)
  [ -n "$s" ] && cp "$s" "$work/out/$name.summary.json"
  m=$(find "$work/runs/$name" -path "*/$METHOD/$METHOD.safetensors" 2>/dev/null | head -1)
  [ -n "$m" ] && cp "$m" "$work/out/$name.safetensors"
done
tar czf "$OUT/trials.tgz" "$work/logs" "$work/out"
grep -h "rc=\|skip" "$work"/logs/*.log
