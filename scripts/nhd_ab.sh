# scripts/nhd_probe.py for the tree and each revision in ab/ (scripts/ab_export.sh), alternating rounds
export PYTHONUNBUFFERED=1
REPO=$PWD
ARGS=${NHD_AB_ARGS:---page-sizes 16 --combos HND/HND,NHD/NHD --grid 64x8192,1x131072,128x512 --hpb 0,1,2}
for r in $(seq "${AB_ROUNDS:-2}"); do
  PYTHONPATH=$REPO TORCH_EXTENSIONS_DIR=$REPO/build/torch_extensions python3 scripts/nhd_probe.py $ARGS 2>&1 | grep "^Hq" | sed "s/^/[tree_r$r] /"
  for d in ab/*/; do
    n=$(basename "$d"); [ -d "/tmp/ab_$n" ] || cp -r "$d" "/tmp/ab_$n"
    PYTHONPATH=/tmp/ab_$n TORCH_EXTENSIONS_DIR=/tmp/te_ab_$n python3 scripts/nhd_probe.py $ARGS 2>&1 | grep "^Hq" | sed "s/^/[${n}_r$r] /"
  done
done
