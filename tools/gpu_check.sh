#!/usr/bin/env bash
# gpu_check.sh OUTDIR: on a GPU machine with no network, build amp8 with CMake, run the whole
# test suite (the _CUDA cases included) and every benchmark, and write logs and results to
# OUTDIR:
#   OUTDIR/gpu_check.log            build + test + benchmark log (also on stdout)
#   OUTDIR/ctest.xml                JUnit report of ctest
#   OUTDIR/<benchmark>.jsonl        one JSON object per benchmark case (with gpt_stack_bench,
#                                   OUTDIR/pytorch_gpt_stack.jsonl: the PyTorch baseline; with
#                                   fp8_linear_bench, OUTDIR/fp8_linear_gemm_grid.jsonl: its grid
#                                   mode, the per-shape FP8 choice's measurements and the recipes)
#   OUTDIR/traces.tar               Kineto traces (trace.json.gz) of the profiled steps:
#                                   gpt_stack_bench's bf16-mixed and FP8 cases (their tables
#                                   in the log), and the AMP8_GPT_STEP runs
# AMP8_BENCHMARKS="gpt_stack_bench ..." limits the benchmarks run (default: all of them; none: no benchmark);
# AMP8_SKIP_TESTS=1 skips ctest; AMP8_TEST_REGEX limits it (ctest -R, e.g. _CUDA).
# AMP8_GPT_COMPARE="--config 125m --steps 1000 --compare 32,bf16-mixed" also runs gpt_pretrain
# with those flags (checkpoints in a scratch folder) and brings back OUTDIR/gpt_compare.tar.gz:
# every run's metrics.jsonl and loss.svg, compare.svg, compare.jsonl and the log.
# AMP8_GPT_DP="--config 125m --steps 300 --micro-batch 8 --precision bf16-mixed" (on a machine
# with 2 GPUs) runs gpt_pretrain on one GPU with --grad-accum 2 and under torchrun on two GPUs
# with --grad-accum 1 (the same global batch: rank r draws micro-batch r), again with
# --overlap-grad-reduce false, then DistributedNcclTest under torchrun, and brings back
# OUTDIR/gpt_dp.tar.gz: every run's metrics.jsonl and logs, and how the GPUs are linked
# (nvidia-smi topo -m). NVLink multicast stays off.
# AMP8_GPT_DP_RUNS="name|GPUS|flags;..." adds runs to it, each with AMP8_GPT_DP's flags and its
# own appended (GPUS 1: on GPU 0; 2: under torchrun; 2x1: two independent single-GPU runs at
# once, on GPU 0 and GPU 1, to see what sharing the host costs), e.g.
#   "one_350m|1|--config 350m --grad-accum 2;two_350m|2|--config 350m --bucket-size 10000000".
# AMP8_BASELINE_SRC=DIR: a source tree of an earlier commit (`git archive REF ops plugin recipes
#   CMakeLists.txt cmake tests third_party examples | tar -x -C DIR`); gpt_pretrain is built from
#   it as well, and every AMP8_GPT_STEP entry runs with it first (as NAME_baseline), then with this
#   tree, so before / after is a ratio within one call.
# AMP8_DP_ROWS="precision|one-GPU run|data-parallel run;..." writes dp_scaling.jsonl rows
#   (bench/dp_scaling_rows.py) from the AMP8_GPT_DP / AMP8_GPT_DP_RUNS runs named.
# AMP8_GPT_STEP="name|flags;..." runs gpt_pretrain per entry through bench/gpt_compare_rows.py
# (flags must hold a --compare list) on real text (the Python standard library's sources,
# concatenated), each run profiled (--profile, steps 10-12 unless the flags say otherwise):
# rows in OUTDIR/gpt_step_bench.jsonl, and OUTDIR/gpt_step.tar.gz with every run's log,
# metrics, step_profile.txt / .json and trace.json (gzipped).
# The tests run four at a time with one OpenMP thread each: the CPU cases are small, and 4
# processes × all cores of OpenMP threads made them 100× slower on the GPU machine.
# GoogleTest comes from a source copy at .gtest/ (cp -r /usr/src/googletest .gtest on Debian),
# or from an installed GTest when there is none; CLI11 and nlohmann-json headers likewise from
# .sysinclude/ (carry both: run with carry [".gtest", ".sysinclude"]). Exits non-zero if anything fails.
set -uo pipefail
OUT="${1:?usage: tools/gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${AMP8_GPU_BUILD_DIR:-build-gpu}"
LOG="$OUT/gpu_check.log"
export PATH="/usr/local/cuda/bin:$PATH"
status=0

{
  echo "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -2
  cmake --version | head -1
} 2>&1 | tee "$LOG"

GTEST_ARGS=()
[[ -f .gtest/CMakeLists.txt ]] && GTEST_ARGS=(-DAMP8_GTEST_SOURCE_DIR="$ROOT/.gtest")
# CLI11 and nlohmann-json headers for gpt_pretrain, where the machine has none:
# mkdir .sysinclude && cp -r /usr/include/CLI /usr/include/nlohmann .sysinclude/ (Debian).
[[ -d .sysinclude ]] && GTEST_ARGS+=(-DAMP8_EXTRA_INCLUDE_DIR="$ROOT/.sysinclude")
TORCH_PREFIX="$(python3 -W ignore -c 'import torch;print(torch.utils.cmake_prefix_path)')"

echo "== configure + build" | tee -a "$LOG"
start=$SECONDS
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" "${GTEST_ARGS[@]}" &&
       cmake --build "$BUILD" -j"$(nproc)"; } >>"$LOG" 2>&1; then
  tail -n 60 "$LOG"
  echo "gpu_check: BUILD FAILED" | tee -a "$LOG"
  exit 1
fi
echo "build took $((SECONDS - start)) s" | tee -a "$LOG"
if [[ -n "${AMP8_BASELINE_SRC:-}" ]]; then
  echo "== configure + build the baseline gpt_pretrain from $AMP8_BASELINE_SRC" | tee -a "$LOG"
  start=$SECONDS
  if ! { cmake -S "$AMP8_BASELINE_SRC" -B build-baseline -G Ninja -DCMAKE_BUILD_TYPE=Release \
           -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DAMP8_BUILD_TESTS=OFF -DAMP8_BUILD_BENCHMARKS=OFF \
           "${GTEST_ARGS[@]}" && cmake --build build-baseline -j"$(nproc)" --target gpt_pretrain; } >>"$LOG" 2>&1; then
    tail -n 40 "$LOG"
    echo "gpu_check: BASELINE BUILD FAILED" | tee -a "$LOG"
    exit 1
  fi
  echo "baseline build took $((SECONDS - start)) s" | tee -a "$LOG"
fi

# Kineto traces of the profiled steps (trace.json under $1) into OUTDIR/traces.tar (gzipped files), added to
# what earlier calls packed; the largest are left out while the archive would pass 15 MB (the
# most a file can be to come back from the GPU machine is 16 MiB).
TRACES="${TMPDIR:-/tmp}/amp8_traces"
rm -rf "$TRACES" && mkdir -p "$TRACES"
pack_traces() {
  (cd "$1" && find . -name trace.json -print0 | while IFS= read -r -d '' f; do
     mkdir -p "$TRACES/$(basename "$1")/$(dirname "$f")" && gzip -c "$f" >"$TRACES/$(basename "$1")/$f.gz"; done)
  while :; do
    (cd "$TRACES" && tar -cf "$OUT/traces.tar" .)
    (( $(stat -c %s "$OUT/traces.tar") < 15000000 )) && break
    largest="$(find "$TRACES" -name '*.gz' -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2-)"
    [[ -z "$largest" ]] && break
    echo "traces.tar: left out $largest ($(stat -c %s "$largest") bytes)" | tee -a "$LOG"
    rm -f "$largest"
  done
}

echo "== benchmarks" | tee -a "$LOG"
# AMP8_BENCHMARKS="a b" runs only those (default: all; "none": no benchmark).
BENCHMARKS="${AMP8_BENCHMARKS:-cast_transpose_bench fp8_gemm_bench fp8_linear_bench gpt_stack_bench layer_norm_bench scale_update_bench}"
[[ "$BENCHMARKS" == none ]] && BENCHMARKS=""
for bench in $BENCHMARKS; do
  if [[ -x "$BUILD/$bench" ]]; then
    if [[ "$bench" == gpt_stack_bench ]]; then
      # Three steps of its bf16-mixed and FP8 cases profiled (the tables go to the log).
      rm -rf "${TMPDIR:-/tmp}/amp8_stack_profile"
      AMP8_PROFILE_DIR="${TMPDIR:-/tmp}/amp8_stack_profile" "$BUILD/$bench" 2>>"$LOG" | tee "$OUT/$bench.jsonl" || status=1
      pack_traces "${TMPDIR:-/tmp}/amp8_stack_profile"
    else
      "$BUILD/$bench" | tee "$OUT/$bench.jsonl" || status=1
    fi
    # The grid behind the per-shape FP8 choice (tools/fp8_gemm_table.py reads it) and the recipes.
    if [[ "$bench" == fp8_linear_bench ]]; then
      "$BUILD/$bench" grid 2>>"$LOG" | tee "$OUT/fp8_linear_gemm_grid.jsonl" || status=1
    fi
  else
    echo "missing $BUILD/$bench" | tee -a "$LOG"; status=1
  fi
  # The Python user's baseline of the stack, in the same run (PyTorch eager, autocast bf16,
  # AdamW(fused=True)).
  if [[ "$bench" == gpt_stack_bench ]]; then
    python3 bench/pytorch_gpt_stack.py | tee "$OUT/pytorch_gpt_stack.jsonl" || status=1
  fi
done
if [[ -n "${AMP8_GPT_COMPARE:-}" ]]; then
  echo "== gpt_pretrain $AMP8_GPT_COMPARE" | tee -a "$LOG"
  SCRATCH="${TMPDIR:-/tmp}/amp8_gpt_compare"
  rm -rf "$SCRATCH"
  # shellcheck disable=SC2086  # the flags are meant to split
  "$BUILD/gpt_pretrain" $AMP8_GPT_COMPARE --save-dir "$SCRATCH" 2>&1 | tee "$OUT/gpt_compare.log" || status=1
  # One archive: the device tool brings back at most 8 files.
  cp "$OUT/gpt_compare.log" "$SCRATCH/" && rm "$OUT/gpt_compare.log"
  (cd "$SCRATCH" && find . \( -name '*.jsonl' -o -name '*.svg' -o -name '*.log' \) -print0 |
     tar -czf "$OUT/gpt_compare.tar.gz" --null -T -) || status=1
fi
if [[ -n "${AMP8_GPT_STEP:-}" ]]; then
  STEP="${TMPDIR:-/tmp}/amp8_gpt_step"
  rm -rf "$STEP" && mkdir -p "$STEP"
  find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat >"$STEP/stdlib.txt"
  echo "== gpt_pretrain step runs on $(wc -c <"$STEP/stdlib.txt") bytes of text" | tee -a "$LOG"
  IFS=';' read -ra step_runs <<<"$AMP8_GPT_STEP"
  binaries=("|$BUILD/gpt_pretrain")
  [[ -n "${AMP8_BASELINE_SRC:-}" ]] && binaries=("_baseline|build-baseline/gpt_pretrain" "${binaries[@]}")
  for entry in "${step_runs[@]}"; do
    [[ -z "${entry// }" ]] && continue
    IFS='|' read -r name flags <<<"$entry"
    name="${name// /}"
    for binary_entry in "${binaries[@]}"; do
      IFS='|' read -r suffix binary <<<"$binary_entry"
      run="$name$suffix"
      echo "== gpt_step $run ($binary): $flags" | tee -a "$LOG"
      # shellcheck disable=SC2086
      python3 bench/gpt_compare_rows.py --case gpt_step --binary "$binary" -- $flags \
        --data "$STEP/stdlib.txt" --save-dir "$STEP/$run" --save-last false --profile "$STEP/$run/profile" \
        2>"$STEP/$run.log" | tee -a "$OUT/gpt_step_bench.jsonl" || status=1
      grep -E "^gpt_pretrain: .*final loss|^  [a-z_ ()]+ +[0-9.]+ ms" "$STEP/$run.log" | tee -a "$LOG"
    done
  done
  (cd "$STEP" && find . \( -name '*.log' -o -name '*.jsonl' -o -name 'step_profile.*' -o -name '*.svg' \) \
     -print0 | tar -czf "$OUT/gpt_step.tar.gz" --null -T -) || status=1
  pack_traces "$STEP"
fi
if [[ -n "${AMP8_GPT_DP:-}" ]]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  DP="${TMPDIR:-/tmp}/amp8_gpt_dp"
  rm -rf "$DP" && mkdir -p "$DP"
  echo "== gpt_pretrain data-parallel: 1 GPU x grad-accum 2 vs torchrun 2 GPUs" | tee -a "$LOG"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 "$BUILD/gpt_pretrain" $AMP8_GPT_DP --grad-accum 2 --save-dir "$DP/one_gpu" \
    2>&1 | tee "$DP/one_gpu.log" || status=1
  # shellcheck disable=SC2086
  python3 -m torch.distributed.run --standalone --nproc-per-node=2 --no-python "$BUILD/gpt_pretrain" \
    $AMP8_GPT_DP --grad-accum 1 --save-dir "$DP/two_gpus" 2>&1 | tee "$DP/two_gpus.log" || status=1
  # shellcheck disable=SC2086
  python3 -m torch.distributed.run --standalone --nproc-per-node=2 --no-python "$BUILD/gpt_pretrain" \
    $AMP8_GPT_DP --grad-accum 1 --overlap-grad-reduce false --save-dir "$DP/two_gpus_no_overlap" \
    2>&1 | tee "$DP/two_gpus_no_overlap.log" || status=1
  for name in one_gpu two_gpus two_gpus_no_overlap; do
    grep -E "^gpt_pretrain: (final|data-parallel)" "$DP/$name.log" | sed "s/^/$name: /" | tee -a "$LOG"
  done
  (nvidia-smi topo -m; nvidia-smi nvlink --status) >"$DP/topology.log" 2>&1 || true
  IFS=';' read -ra dp_runs <<<"${AMP8_GPT_DP_RUNS:-}"
  for entry in "${dp_runs[@]}"; do
    [[ -z "${entry// }" ]] && continue
    IFS='|' read -r name gpus flags <<<"$entry"
    name="${name// /}" gpus="${gpus// /}"
    echo "== gpt_pretrain $name on $gpus GPU(s): $AMP8_GPT_DP $flags" | tee -a "$LOG"
    if [[ "$gpus" == 1 ]]; then
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=0 "$BUILD/gpt_pretrain" $AMP8_GPT_DP $flags --save-dir "$DP/$name" \
        2>&1 | tee "$DP/$name.log" || status=1
    elif [[ "$gpus" == 2x1 ]]; then
      # Two independent single-GPU runs at once, one per GPU, no communication: how much the
      # two processes slow each other down through the shared host alone.
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=1 "$BUILD/gpt_pretrain" $AMP8_GPT_DP $flags --save-dir "$DP/${name}_gpu1" \
        >"$DP/${name}_gpu1.log" 2>&1 &
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=0 "$BUILD/gpt_pretrain" $AMP8_GPT_DP $flags --save-dir "$DP/$name" \
        2>&1 | tee "$DP/$name.log" || status=1
      wait $! || status=1
      grep -E "^gpt_pretrain: final" "$DP/${name}_gpu1.log" | sed "s/^/${name}_gpu1: /" | tee -a "$LOG"
    else
      # shellcheck disable=SC2086
      python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" --no-python "$BUILD/gpt_pretrain" \
        $AMP8_GPT_DP $flags --save-dir "$DP/$name" 2>&1 | tee "$DP/$name.log" || status=1
    fi
    grep -E "^gpt_pretrain: (final|data-parallel)" "$DP/$name.log" | sed "s/^/$name: /" | tee -a "$LOG"
  done
  # One bench/results/dp_scaling.jsonl row per "precision|one-GPU run|data-parallel run" of
  # AMP8_DP_ROWS (run names as above: one_gpu, two_gpus, or an AMP8_GPT_DP_RUNS name).
  declare -A run_commands=(
    [one_gpu]="CUDA_VISIBLE_DEVICES=0 gpt_pretrain $AMP8_GPT_DP --grad-accum 2"
    [two_gpus]="torchrun --standalone --nproc-per-node=2 gpt_pretrain $AMP8_GPT_DP --grad-accum 1")
  for entry in "${dp_runs[@]}"; do
    IFS='|' read -r name gpus flags <<<"$entry"
    name="${name// /}" gpus="${gpus// /}"
    [[ -z "$name" ]] && continue
    if [[ "$gpus" == 1 ]]; then run_commands[$name]="CUDA_VISIBLE_DEVICES=0 gpt_pretrain $AMP8_GPT_DP $flags"
    else run_commands[$name]="torchrun --standalone --nproc-per-node=$gpus gpt_pretrain $AMP8_GPT_DP $flags"; fi
  done
  IFS=';' read -ra dp_rows <<<"${AMP8_DP_ROWS:-}"
  for entry in "${dp_rows[@]}"; do
    [[ -z "${entry// }" ]] && continue
    IFS='|' read -r precision one many <<<"$entry"
    precision="${precision// /}" one="${one// /}" many="${many// /}"
    python3 bench/dp_scaling_rows.py --config "$(sed -E 's/.*--config +([^ ]+).*/\1/' <<<"$AMP8_GPT_DP")" \
      --precision "$precision" --gpus 2 --one-gpu "$DP/$one.log" --data-parallel "$DP/$many.log" \
      --command "${run_commands[$one]:-$one} ; ${run_commands[$many]:-$many}" | tee -a "$OUT/dp_scaling.jsonl" || status=1
  done
  echo "== distributed_optimizer_test over ProcessGroupNCCL, 2 ranks" | tee -a "$LOG"
  python3 -m torch.distributed.run --standalone --nproc-per-node=2 --no-python "$BUILD/distributed_optimizer_test" \
    --gtest_filter='DistributedNcclTest.*' 2>&1 | tee "$DP/nccl_test.log" || status=1
  (cd "$DP" && find . \( -name '*.jsonl' -o -name '*.svg' -o -name '*.log' \) -print0 |
     tar -czf "$OUT/gpt_dp.tar.gz" --null -T -) || status=1
fi
echo "== tests" | tee -a "$LOG"
start=$SECONDS
CTEST_ARGS=()
[[ -n "${AMP8_TEST_REGEX:-}" ]] && CTEST_ARGS=(-R "$AMP8_TEST_REGEX")
[[ "${AMP8_SKIP_TESTS:-0}" == 1 ]] ||
  OMP_NUM_THREADS=1 ctest --test-dir "$BUILD" --output-on-failure -j4 "${CTEST_ARGS[@]}" \
    --output-junit "$OUT/ctest.xml" >>"$LOG" 2>&1 || status=1
grep -E "tests passed|tests failed|Total Test time" "$LOG" | tail -3
grep -cE "\(Skipped\)" "$LOG" | sed 's/^/skipped: /'
grep -E "\*\*\*Failed|\(Failed\)|Exception" "$LOG" | head -20
echo "tests took $((SECONDS - start)) s" | tee -a "$LOG"

cat "$OUT"/*.jsonl >>"$LOG"
echo "gpu_check: exit $status" | tee -a "$LOG"
exit $status
