#!/bin/bash
# Re-run one or more methods on archived reproduction cells, on the cells' own uploads, and merge the
# new results into them (the earlier results stay in each cell's `replaced`; the report sets the two
# side by side). For a method whose defaults changed (say Co-Boosting's clips, fifty-ninth session).
#
#   PAPER=fedhydra BUDGET=reduced-t60-g30 METHODS=coboosting bash scripts/rerun-method.sh fmnist:0.5:0 mnist:2c/c:1
#
# Each cell (dataset:setting:seed, or dataset:setting:seed:clients for fedhydra's client-count sweep,
# e.g. fmnist:0.5:0:10 for fedhydra-fmnist-0.5-m10-s0-<budget>) runs `hetfl reproduce` with FedAvg
# and METHODS into OUT and CACHE:
# the clients retrain from the cell's seeds, to byte-identical uploads where the torch thread count
# and the CPU kind are those of the archived run (the archived summary's `environment`; THREADS,
# default 2). `hetfl archive-check` first skips a cell whose archived environment names another
# processor, instruction set (torch's cpu_capability: AVX2 and AVX-512 AMD EPYCs gave other uploads),
# torch or thread count (measured: an AMD EPYC cell retrained on an Intel Xeon gave other uploads,
# found only by the merge after 31 min; FORCE_CPU=1 runs it anyway). A cell that records no
# processor still runs, and only the merge can tell (FedMHO's `reduced` cells as first archived: other
# uploads on an Intel Xeon and on an AVX-512 AMD EPYC, refused after 6 and 3 min, so they were re-run
# whole; archive-check says so; and a FedMHO VGG-9 cell with bf16 clients passed archive-check but
# retrained to other uploads all the same, refused after 44 min). `hetfl archive-merge` then refuses
# a cell whose uploads differ (digests, else FedAvg and the ensemble to the last digit), and the loop
# goes on with the next cell.
# Two of these side by side on 2 cores: OMP_WAIT_POLICY=PASSIVE (set here) keeps the waiting OpenMP
# threads of one from spinning on the cores the other needs (without it, measured: one of the two
# ran 6x slower). A cell whose folder exists in OUT is skipped (another loop started it) unless
# FORCE=1 (to resume a stopped one from its checkpoint).
#
# Environment: PAPER (fedhydra or fedmho; default fedhydra), BUDGET (required), METHODS (required,
# comma-separated), FOLDER (archive subfolder of the cells: default one-cache for fedhydra, none for
# fedmho), OUT (default runs/rerun-<budget>), CACHE (default cache/rerun), THREADS, FORCE, FORCE_CPU, HETFL (the
# command; default .venv/bin/hetfl; run from the repository root).
set -u
HETFL=${HETFL:-.venv/bin/hetfl}
PAPER=${PAPER:-fedhydra}
: "${BUDGET:?BUDGET is required}" "${METHODS:?METHODS is required}"
if [ "$PAPER" = fedhydra ]; then FOLDER=${FOLDER-one-cache}; else FOLDER=${FOLDER-}; fi
OUT=${OUT:-runs/rerun-$BUDGET}
CACHE=${CACHE:-cache/rerun}
export OMP_NUM_THREADS=${THREADS:-2} OMP_WAIT_POLICY=PASSIVE
for cell in "$@"; do
  IFS=: read -r ds setting seed clients <<< "$cell"
  tag=$setting; [ "$setting" = "2c/c" ] && tag=2cc
  sweep=()
  if [ -n "$clients" ] && [ "$clients" != 5 ]; then
    if [ "$PAPER" != fedhydra ]; then echo "$(date +%T) skip $cell (a client count is for fedhydra's sweep only)"; continue; fi
    tag=$tag-m$clients; sweep=(--clients "$clients")
  fi
  [ "$PAPER" = fedmho ] && tag=a$setting
  name=$PAPER-$ds-$tag-s$seed-$BUDGET
  if [ -z "${FORCE:-}" ] && [ -e "$OUT/$name" ]; then echo "$(date +%T) skip $cell ($OUT/$name exists)"; continue; fi
  if [ -z "${FORCE_CPU:-}" ] && ! $HETFL archive-check "$PAPER" "$name" --folder "$FOLDER"; then
    echo "$(date +%T) skip $cell (clients retrained here would not give its uploads; FORCE_CPU=1 runs it anyway)"
    continue
  fi
  echo "$(date +%T) start $cell"
  $HETFL reproduce "$PAPER" --budget "$BUDGET" --datasets "$ds" --settings "$setting" --seeds "$seed" "${sweep[@]}" \
    --methods "fedavg,$METHODS" --device cpu --out "$OUT" --cache-dir "$CACHE" \
    --results "$OUT/$PAPER.md" --quiet || { echo "$(date +%T) failed $cell"; continue; }
  $HETFL archive-merge "$PAPER" "$OUT/$name" --methods "$METHODS" --folder "$FOLDER" \
    || echo "$(date +%T) not merged: $cell"
  echo "$(date +%T) done $cell"
done
