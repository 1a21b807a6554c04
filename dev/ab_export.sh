#!/usr/bin/env bash
# Export other revisions' kernels and core for an A/B device call: ab/<name>/{csrc,nvfp4_backend} per
# git ref (name: the ref with / -> _).  Then, in one device call (ab/ is git-ignored, so carry it):
#   bash dev/ab_export.sh main gpu-pending/qk-two-chains
#   run: AB_ROUNDS=2 bash dev/gpu_run.sh ab        carry: ["ab"]   (rounds alternate tree and revisions)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf ab && mkdir ab
for ref in "$@"; do
  name=${ref//\//_}
  mkdir "ab/$name"
  git archive "$ref" csrc nvfp4_backend | tar -x -C "ab/$name"
  echo "ab/$name <- $ref ($(git rev-parse --short "$ref"))" | tee -a ab/REFS
done
