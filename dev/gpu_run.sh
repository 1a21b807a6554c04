#!/usr/bin/env bash
# One device call: build the kernels, run the GPU tests, benchmark.  Logs go to $OUT.
# COMMIT=<hash> names the commit in gpu.txt (the device copy's git metadata can lag the work tree).
#   bash dev/gpu_run.sh [tests|bench|peers|zoo|modes|fuzz|hardening|engines|demo|profile|sanitize|ab|aot|all][,mode...] [extra args]
# Several modes, comma-separated, run in one call in the order given.
set -o pipefail
modes=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the JIT build in the repo's ignored build/ folder, so a warm machine reuses it across calls
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
# FlashInfer peers: flashinfer-python 0.7.2.post1 + apache-tvm-ffi wheels carried in .whl-fi/ (and tqdm),
# or in .whl-fi-slim/ (dev/slim_flashinfer_wheel.py: what fits a call's 64 MiB with the repo)
for wheels in .whl-fi .whl-fi-slim; do
  if ls $wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    break
  fi
done
# FlashInfer modules built ahead of time (dev/prebuild_flashinfer.py --aot-out .fi-aot; carry ".fi-aot"):
# FlashInfer loads them from its data/aot/ instead of building them
if [ -d .fi-aot ] && [ -d /tmp/site/flashinfer ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && cp -r .fi-aot/. /tmp/site/flashinfer/data/aot/
  echo "FlashInfer AOT modules: $(ls .fi-aot | wc -l)"
fi
# the dense prefill's FA3 modules (FlashInfer builds each on first use): side by side, in the background,
# while the kernels build and the other tests run; the dense mode waits for them
if [[ $modes == *dense* || $modes == *step* || $modes == *zoo* ]] && python3 -c "import flashinfer" 2>/dev/null; then
  # PREBUILD_ONLY: indices into its MODULES (each FA3 module takes minutes of all 16 cores: build few,
  # or build them ahead of time and carry .fi-aot; an FA2 one takes about 20 s); PREBUILD_JOBS side by side
  FLASHINFER_CUDA_ARCH_LIST=9.0a python3 dev/prebuild_flashinfer.py ${PREBUILD_ONLY:+--only $PREBUILD_ONLY} --jobs ${PREBUILD_JOBS:-4} \
    > "$OUT/prebuild_flashinfer.log" 2>&1 &
  prebuild=$!
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
# run_variants "<nvcc flags;...>" <log name> <lines shown> <command...>: the command once per variant, each its own
# build (NVFP4_BACKEND_NVCC_FLAGS), then the tree again to bound the drift; lines prefixed by the variant
run_variants() {
  local list=$1 log=$2 shown=$3 v; shift 3
  [ -n "$list" ] || return 0
  IFS=';' read -ra variants <<< "$list"
  for v in "${variants[@]}" ""; do
    NVFP4_BACKEND_NVCC_FLAGS="$v" "$@" 2>&1 | grep -v "INFO" | sed "s/^/[${v:-tree}] /" | tee -a "$OUT/$log" | tail -"$shown"
  done
}
python3 -c "import torch, nvfp4_backend.jit as j; j.load(torch.device('cuda')); print('kernels built')" 2>&1 | tail -5
echo "build: $(( $(date +%s) - t0 )) s"
for mode in ${modes//,/ }; do
echo "== $mode ($(date -u +%T))"
case $mode in
  tests|all|final) python3 -m pytest -q --maxfail=20 tests/gpu tests/test_eval.py::test_gpu_kernel_path_agrees_with_reference_path -rs \
                     ${prebuild:+--deselect tests/gpu/test_dense.py --deselect tests/gpu/test_decode.py::test_fuzz_fixed_seeds} \
                     2>&1 | tee "$OUT/gpu_tests.log" | tail -30
                   fuzz_deferred=$prebuild ;;
esac
case $mode in
  dense|step|zoo) [ -z "$prebuild" ] || { wait $prebuild; cat "$OUT/prebuild_flashinfer.log"; prebuild=
    # the fixed fuzz seeds the tests mode left for now: their dense draws need FlashInfer's modules
    [ -z "$fuzz_deferred" ] || python3 -m pytest -q tests/gpu/test_decode.py::test_fuzz_fixed_seeds 2>&1 \
      | tee "$OUT/gpu_fuzz_seeds.log" | tail -3; } ;;
esac
case $mode in
  dense)  # issue 34: the dense prefill path's tests, then --prefill (plain rows with FlashInfer BF16 and NVFP4,
          # the feature rows with BF16)
    python3 -m pytest -q tests/gpu/test_dense.py -rs ${DENSE_K:+-k "$DENSE_K"} 2>&1 | tee "$OUT/gpu_dense_tests.log" | tail -15
    python3 -m nvfp4_backend.tools.cli bench --prefill ${PREFILL_GRID:-1x0x4096,1x12288x4096,8x2048x512,4x0x16384} \
      --peer-kv ${PEER_KV:-bf16,nvfp4} --page-sizes 16 --iters ${ITERS:-10} --out "$OUT/bench_prefill.json" 2>&1 \
      | grep -v "INFO" | tee "$OUT/bench_prefill.log" | tail -14
    [ "$PREFILL_FEATURES" = none ] || python3 -m nvfp4_backend.tools.cli bench --prefill ${PREFILL_FEATURES:-1x0x16384,1x0x16384:w4096+sinks,4x0x4096,4x0x4096:cap50} \
      --peer-kv bf16 --page-sizes 16 --iters ${ITERS:-10} --out "$OUT/bench_prefill_features.json" 2>&1 \
      | grep -v "INFO" | tee "$OUT/bench_prefill_features.log" | tail -12 ;;
  step)  # issue 34: the engine-step mixes, ours (prefill kernel in graphs, dense path eagerly) and FlashInfer's
    python3 -m nvfp4_backend.tools.cli bench --step ${STEP_MIXES:-all} --iters ${ITERS:-10} --out "$OUT/bench_step.json" 2>&1 \
      | grep -v "INFO" | tee "$OUT/bench_step.log" | tail -12
    # STEP_VARIANTS: nvcc flags per variant, ';'-separated, ours only, e.g. STEP_VARIANTS="-DNVFP4_PREFILL_MIN_BLOCKS_HD64=3"
    run_variants "$STEP_VARIANTS" bench_step_variants.log 8 python3 -m nvfp4_backend.tools.cli bench --step ${STEP_MIXES:-all} \
      --no-peers --iters ${ITERS:-10} --out "$OUT/bench_step_variant.json" ;;
esac
case $mode in
  bench|all) [ -n "$SKIP_MAIN_BENCH" ] || python3 -m nvfp4_backend.tools.cli bench --no-peers --grid 64x8192,1x131072,128x512,256x2048 --page-sizes 16,64 \
               --out "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -24
             for v in "$@"; do  # variants: "nvcc flags|bench args", each its own build
               NVFP4_BACKEND_NVCC_FLAGS="${v%%|*}" python3 -m nvfp4_backend.tools.cli bench $( [[ $v == *"|"* ]] && echo "${v#*|}" ) --no-peers --grid ${VARIANT_GRID:-64x8192,1x131072,128x512} \
                 --page-sizes 16 --spec-q-len 0 --out "$OUT/bench_variant.json" --plot /dev/null 2>&1 | grep "^B=" | awk -v p="[$v] " '{print p $0}'
             done ;;
  peers|final) python3 -m nvfp4_backend.tools.cli bench ${PEER_GRID:+--grid $PEER_GRID} ${PEER_PAGES:+--page-sizes $PEER_PAGES} --out "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
esac
case $mode in
  zoo)  # issue 36: decode at model shapes against FlashInfer; ZOO_ROWS (no spaces, e.g. D128 or 7,8,9,10) a subset
    python3 -m nvfp4_backend.tools.cli bench --zoo ${ZOO_ROWS:+--zoo-rows $ZOO_ROWS} --out "$OUT/bench_zoo.json" \
      --plot "$OUT/bench_zoo.png" 2>&1 | tee "$OUT/bench_zoo.log" | tail -30
    # ZOO_VARIANTS: nvcc flags per variant, ';'-separated, ours only
    run_variants "$ZOO_VARIANTS" bench_zoo_variants.log 14 python3 -m nvfp4_backend.tools.cli bench --zoo \
      ${ZOO_ROWS:+--zoo-rows $ZOO_ROWS} --no-peers --out "$OUT/bench_zoo_variant.json" ;;
esac
case $mode in
  modes) python3 -m pytest -q tests/gpu -k "6or4 or modes_end_to_end" 2>&1 | tee "$OUT/gpu_modes_tests.log" | tail -4
         python3 -m nvfp4_backend.tools.cli bench --no-peers --grid ${MODES_GRID:-64x8192,8x32768,128x512} --page-sizes 16 \
           --spec-q-len 0 --iters 30 --modes plain,6or4,hadamard,hadamard-6or4 --out "$OUT/bench_modes.json" \
           --plot "$OUT/bench_modes.png" 2>&1 | tee "$OUT/bench_modes.log" | tail -20 ;;
esac
case $mode in
  fuzz)  # issue 8: FUZZ_CONFIGS configurations from FUZZ_SEED (500 fit one call; run two seeds ranges for 1000)
    python3 -m nvfp4_backend.tools.cli fuzz --configs ${FUZZ_CONFIGS:-500} --seed ${FUZZ_SEED:-0} --time-limit ${FUZZ_TIME_LIMIT:-400} --out "$OUT/fuzz.json" 2>&1 \
      | tr '\r' '\n' | grep -v "it/s" | tee "$OUT/fuzz.log" | tail -6 ;;
  hardening)  # issue 8: long contexts, bad values, streams, fixed fuzz seeds, long-context bandwidth
    python3 -m pytest -q tests/gpu -k "long_contexts or bad_values or stream or fuzz_fixed or determinism" \
      2>&1 | tee "$OUT/gpu_hardening_tests.log" | tail -4
    python3 -m nvfp4_backend.tools.cli bench --no-peers --grid 1x262144,8x131072,4x262144 --page-sizes 16 --spec-q-len 0 \
      --out "$OUT/bench_long.json" --plot "$OUT/bench_long.png" 2>&1 | tee "$OUT/bench_long.log" | tail -6 ;;
esac
case $mode in
  engines)  # issue 4 / 6: the plugins' call patterns on the GPU, prefill vs FlashInfer
    python3 plugins/vllm/scripts/gpu_check.py 2>&1 | tee "$OUT/vllm_gpu_check.log" | tail -6
    python3 -m nvfp4_backend.tools.cli bench --prefill ${PREFILL_GRID:-1x0x4096,1x12288x4096,8x2048x512,4x0x16384} \
      --page-sizes 16 --iters 20 --out "$OUT/bench_prefill.json" 2>&1 | tee "$OUT/bench_prefill.log" | tail -12 ;;
esac
case $mode in
  demo)  # issue 6: the README's main job on the GPU (model halves from dev/split_default_model.sh)
    # the first half: carried in this call, or copied to /tmp by the previous call (a call's carried
    # folders are removed from the repo copy when the next call carries others)
    half_a=.model-a/part; [ -f "$half_a" ] || half_a=/tmp/model-a-part
    cat "$half_a" .model-b/part > /tmp/smollm2.gguf
    echo "$(cat .model-b/sha256)  /tmp/smollm2.gguf" | sha256sum -c - || exit 1
    python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .model-b/gguf-*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    python3 -m nvfp4_backend.tools.cli demo --device cuda --model /tmp/smollm2.gguf --no-progress --out "$OUT/demo_gpu.json" \
      2>&1 | tee "$OUT/demo_gpu.log" | tail -40 ;;
esac
case $mode in
  profile)  # Nsight Compute on the decode (64x8192, 128x512) and write kernels; PROFILE_ARGS: profile_kernels.py's
            # (another shape: "--q-heads 64 --kv-heads 8 --head-dim 64 --grid 64x8192 --no-write"); per SASS line in the csv
    ncu --set full --import-source yes -k regex:"paged_decode_kernel|write_kv_kernel|merge_splits" -f -o "$OUT/profile" \
      python3 dev/profile_kernels.py $PROFILE_ARGS 2>&1 | tail -3
    ncu --import "$OUT/profile.ncu-rep" --page details > "$OUT/profile.txt" 2>&1
    ncu --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass > "$OUT/profile_sass.csv" 2>&1
    grep -E "paged_decode_kernel|write_kv_kernel|merge_splits|^    Duration|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|Registers Per|Theoretical Occupancy|Block Limit|L1/TEX Hit|Executed Ipc A|Warp Cycles Per Issued|One or More Eligible" "$OUT/profile.txt" | head -80 ;;
esac
case $mode in
  profile-step)  # issue 34: one engine step's host time, kernel times and Nsight Compute of its prefill and
                 # decode kernels (STEP_MIXES: indices into bench_step.MIXES)
    python3 dev/profile_step.py --mixes ${STEP_MIXES:-1,5} 2>&1 | tee "$OUT/profile_step.log" | grep -E "^\[|paged_|write_kv|Self CUDA time"
    ncu --set full --import-source yes --profile-from-start off -k regex:"paged_prefill|paged_decode" -f \
      -o "$OUT/profile_step" python3 dev/profile_step.py --mixes ${STEP_MIXES:-1,5} --ncu 2>&1 | tail -3
    ncu --import "$OUT/profile_step.ncu-rep" --page details > "$OUT/profile_step.txt" 2>&1
    ncu --import "$OUT/profile_step.ncu-rep" --page source --csv --print-source sass > "$OUT/profile_step_sass.csv" 2>&1
    grep -E "paged_prefill|paged_decode|^    Duration|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Stall" \
      "$OUT/profile_step.txt" | head -80 ;;
esac
case $mode in
  ab)  # the tree against the revisions in ab/ (dev/ab_export.sh; carry ["ab"]), each its own build,
       # AB_ROUNDS rounds of tree, revisions... (builds are kept between rounds), then the tree again:
       # in one call the order alone moves a result 1-3 %, so alternate and compare rounds.
       # AB_CLOCKS=<loads of benchmarks/bench_clock_under_load.py>: also the clock, power and sustained time of
       # each build (the decode runs at the card's power cap: a variant that draws less is faster there)
       # AB_CMD=<command>: run it for each build instead of the benchmark (from the build's folder, with
       # its PYTHONPATH; the tree's scripts are under $REPO), its output lines prefixed by the build's name,
       # e.g. AB_CMD='python3 $REPO/benchmarks/bench_nhd_views.py --combos HND/HND,NHD/NHD'
    abbench() { if [ -n "$AB_CMD" ]; then eval "$AB_CMD" 2>&1 | grep -v "^\[nvfp4-backend\]" | sed "s/^/[$1] /"; return; fi
                cli=nvfp4_backend.tools.cli; [ -f nvfp4_backend/tools/cli.py ] || cli=nvfp4_backend.cli  # revisions before tools/
                python3 -m $cli bench --no-peers --page-sizes 16 --plot /dev/null \
                  --grid ${AB_GRID:-64x8192,256x2048,1x131072,128x512} ${AB_ARGS:---spec-q-len 4} --out "$OUT/ab_$1.json" 2>&1 \
                  | grep "^B=\|^write_kv" | sed "s/^/[$1] /"
                [ -z "$AB_CLOCKS" ] || {  # an exported revision gets the tree's script
                  [ "$PWD" = "$REPO" ] || { mkdir -p benchmarks && cp "$REPO/benchmarks/bench_clock_under_load.py" benchmarks/; }
                  python3 benchmarks/bench_clock_under_load.py --seconds 3 --loads "$AB_CLOCKS" --out /dev/null 2>&1 \
                  | grep "us/call" | sed "s/^/[$1] /"; }; }
    REPO=$PWD
    cat ab/REFS
    for round in $(seq "${AB_ROUNDS:-1}"); do
      abbench "tree_r$round"
      for d in ab/*/; do
        n=$(basename "$d"); [ -d "/tmp/ab_$n" ] && [ "$round" -gt 1 ] || { rm -rf "/tmp/ab_$n" && cp -r "$d" "/tmp/ab_$n"; }
        (cd "/tmp/ab_$n" && PYTHONPATH="/tmp/ab_$n" TORCH_EXTENSIONS_DIR="/tmp/te_ab_$n" abbench "${n}_r$round")
      done
    done
    abbench tree_again ;;
esac
case $mode in
  aot)  # the ahead-of-time build (setup.py) for this GPU's arch as a wheel, installed apart, and GPU tests on it
    arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    rm -rf /tmp/aot /tmp/aot_wheel
    python3 -c "import setuptools; print('setuptools', setuptools.__version__)"  # --no-build-isolation: >= 70.1 or the wheel package
    NVFP4_BACKEND_AOT=1 TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-16} python3 -m pip wheel -q --no-build-isolation \
      --no-deps -w /tmp/aot_wheel . > "$OUT/aot_build.log" 2>&1 || { tail -5 "$OUT/aot_build.log"; echo "aot: the wheel build failed"; continue; }
    python3 -m pip install -q --no-deps --no-index --target /tmp/aot /tmp/aot_wheel/*.whl
    repo=$PWD
    (cd /tmp && export PYTHONPATH=/tmp/aot:/tmp/site
     python3 -c "import sys, torch, nvfp4_backend.jit as j; p = j._prebuilt(torch.cuda.get_device_capability()); print('prebuilt:', p); sys.exit(p is None)" &&
     python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu" \
       -k "(test_decode_matrix and -16-4-1) or (test_write_kv_bit_exact and dtype0 and -HND) or binding_rejects" 2>&1 \
       | tee "$OUT/aot_tests.log" | tail -3) ;;
esac
case $mode in
  sanitize)
    # SANITIZE_TOOLS (default all three); the argument: a pytest -k expression. The default covers
    # every kernel path (writer, decode single/split/merge, spec rows, each head dim, window, sinks,
    # soft-cap, bad values, the prefill kernel, packed kv heads); the whole suite is far past one call under racecheck.
    sel=${1:-"(test_write_kv_bit_exact and dtype0 and -HND) or (test_decode_matrix and (-16-4-1 or -16-8-4 or -1-1-1)) or (test_decode_features and dtype0-NHD and (True or 37)) or test_long_context_split or (test_many_splits and 128) or bad_values or (test_prefill_matrix and 128-4) or (test_prefill_features and 37-50.0-True) or (test_decode_packed_heads and (128-16-3-2-5 or 64-1-1-4-3 or 256-64-2-4-5)) or (test_decode_packed_heads_features and 100 and dtype0) or (test_modes_end_to_end and packed-dtype0-128-mode1) or (test_decode_fused and (128-16-4-1-8 or 128-16-4-4-4 or 64-1-5-3-4)) or (test_decode_fused_features and 100 and dtype0) or (test_modes_end_to_end and fused-dtype0-128-mode1) or (test_modes_end_to_end and fused_one_tile-dtype0-128-mode1)"}
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
      compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -x tests/gpu -k "$sel" 2>&1 \
        | tee "$OUT/sanitizer_$tool.log" | tail -8
    done ;;
esac
done
