#!/usr/bin/env bash
# run_fuzzers.sh AMP8_PREFIX [SECONDS]: builds the libFuzzer targets in fuzz/ with clang against
# an installed amp8 (cmake --install of a normal build) and runs each for SECONDS (default 60)
# from its committed seed corpus fuzz/corpus/<target>/ (new inputs go to a scratch folder, the
# committed corpus is only read). A crash leaves crash-* and fails the
# run (in build-fuzz/run_<target>/); fix it and add the input to fuzz/corpus/<target>/ as a regression case.
set -euo pipefail
PREFIX="${1:?usage: tools/run_fuzzers.sh AMP8_PREFIX [SECONDS]}"
SECONDS_EACH="${2:-60}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build-fuzz"
TORCH_PREFIX="$(python3 -W ignore -c 'import torch;print(torch.utils.cmake_prefix_path)')"
CXX=clang++ cmake -S "$ROOT/fuzz" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX;$TORCH_PREFIX" >"$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" -j"$(nproc)" >/dev/null
status=0
for target in fuzz_precision_options fuzz_checkpoint_load fuzz_text_data fuzz_indexed_dataset; do
  work="$BUILD/run_$target"
  rm -rf "$work" && mkdir -p "$work/new"
  rc=0
  (cd "$work" && OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 "$BUILD/$target" -max_total_time="$SECONDS_EACH" \
     -max_len=65536 -timeout=20 -print_final_stats=1 new "$ROOT/fuzz/corpus/$target" >"$work/log" 2>&1) || rc=$?
  runs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$work/log" | grep -oE "[0-9]+$" || echo "?")
  crashes=$(find "$work" -maxdepth 1 \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  echo "$target: $runs executions in ${SECONDS_EACH} s, $crashes crash/leak/timeout/out-of-memory inputs (exit $rc)"
  if ((crashes > 0 || rc != 0)); then
    status=1
    grep -v '^#[0-9]' "$work/log" | tail -n 40
  fi
done
exit $status
