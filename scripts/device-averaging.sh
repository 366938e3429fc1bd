#!/bin/bash
# scripts/averaging_gap.py with one process per client, side by side on one lent accelerator, then one
# evaluation of every snapshot, under a deadline; for the device tool's `run` (result in $OUT).
#
#   CONFIG=configs/fedmho-fmnist-vgg9-e10.yaml CLIENTS="0 1 2 3 4 5 6 7 8 9" SNAPS=10,50,100,200 \
#     SETS='client.epochs=200 seed=2023 partition={"kind":"feddf_dirichlet","alpha":0.5}' \
#     DL=540 bash scripts/device-averaging.sh
#
# SETS: space-separated KEY=VALUE overrides (no spaces inside one; JSON for mappings), each passed as
# `--set`. Training stops at DL - EVAL_S seconds from the start (default EVAL_S 60), leaving time for the
# evaluation. If a client has not reached the last snapshot by then, the evaluation drops snapshots from
# the end of SNAPS until every averaged client has them (the vote needs the other architectures' last
# epoch: give them time, or VOTE=0). $OUT/averaging.json is the result; $OUT/logs.tgz holds every log.
#
# Environment: CONFIG, CLIENTS (required), SNAPS (default: the last epoch), SETS, VOTE (default 1),
# DEV (default cuda), DL (default 540), EVAL_S (default 60), THREADS (torch CPU threads per process;
# default 1), PY (default python3), OUT (default ./device-out), SNAP_DIR (default device-work/snaps).
set -u
T0=$(date +%s)
CONFIG=${CONFIG:?"CONFIG (the config whose clients train) is required"}
CLIENTS=${CLIENTS:?"CLIENTS='0 1 ...' (client ids, one process each) is required"}
SNAPS=${SNAPS:-}; SETS=${SETS:-}; VOTE=${VOTE:-1}; DEV=${DEV:-cuda}; DL=${DL:-540}; EVAL_S=${EVAL_S:-60}
PY=${PY:-python3}; OUT=${OUT:-$PWD/device-out}; SNAP_DIR=${SNAP_DIR:-device-work/snaps}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-1} MPLBACKEND=Agg
mkdir -p "$SNAP_DIR" device-work/logs "$OUT"
args=("$CONFIG" --set "device=$DEV" --snap-dir "$SNAP_DIR")
for kv in $SETS; do args+=(--set "$kv"); done
[ "$VOTE" = 1 ] && args+=(--vote)

evaluate() { # snapshots
  local which=()
  [ -n "$1" ] && which=(--snapshots "$1")
  $PY scripts/averaging_gap.py "${args[@]}" "${which[@]}" --evaluate-only --out "$OUT/averaging.json" \
    > device-work/logs/evaluate.log 2>&1
}

train=$(( DL - EVAL_S ))
pids=()
for c in $CLIENTS; do
  every=(); [ -n "$SNAPS" ] && every=(--snapshots "$SNAPS")
  timeout -k 5 "$train" $PY scripts/averaging_gap.py "${args[@]}" "${every[@]}" --clients "$c" \
    > "device-work/logs/client$c.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "training done at $(( $(date +%s) - T0 ))s" > device-work/logs/times.txt

# all the snapshots, else the longest list of the first ones that every averaged client reached
snaps=$SNAPS
until evaluate "$snaps"; do
  [[ "$snaps" == *,* ]] || { echo "no snapshot every client reached" >> device-work/logs/times.txt; break; }
  snaps=${snaps%,*}
  echo "evaluating snapshots $snaps" >> device-work/logs/times.txt
done
echo "done at $(( $(date +%s) - T0 ))s" >> device-work/logs/times.txt
tar czf "$OUT/logs.tgz" device-work/logs
