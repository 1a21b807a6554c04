#!/usr/bin/env bash
# Issue 36's weak rows under other decode plans: each line of PLANS is "q/kv heads/D BxL|bench flags"
# (bench's planner overrides: --fused, --blocks-per-sm, --heads-per-block), run on one GPU in one process
# per line, ours only, one query token.  The planner's own choice is the line with no flags; compare
# lines of one call only.  Run on the device: bash dev/sweep_plans.sh > $OUT/sweep_plans.log
set -o pipefail
PLANS=${PLANS:-"28/4/128 1x131072|
28/4/128 1x131072|--fused off
28/4/128 1x131072|--fused off --blocks-per-sm 8
64/8/128 1x131072|
64/8/128 1x131072|--fused off
64/8/128 1x131072|--fused off --blocks-per-sm 8
128/8/128 1x131072|
128/8/128 1x131072|--fused on
128/8/128 1x131072|--blocks-per-sm 8
128/8/128 32x8192|
128/8/128 32x8192|--fused off
128/8/128 32x8192|--fused on --heads-per-block 1
16/8/256 32x8192|
16/8/256 32x8192|--blocks-per-sm 8
16/8/256 1x131072|
16/8/256 1x131072|--blocks-per-sm 8"}
while IFS='|' read -r shape flags; do
  [ -n "$shape" ] || continue
  IFS='/ ' read -r hq hkv d grid <<< "$shape"
  python3 -m nvfp4_backend.tools.cli bench --no-peers --q-heads "$hq" --kv-heads "$hkv" --head-dim "$d" --grid "$grid" \
    --page-sizes 16 --spec-q-len 0 --iters ${ITERS:-30} $flags --out /dev/null --plot /dev/null 2>&1 \
    | grep "^B=" | sed "s|^|[$shape ${flags:-planner}] |"
done <<< "$PLANS"
