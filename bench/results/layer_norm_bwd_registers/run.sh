#!/usr/bin/env bash
# The LayerNorm backward's rows in flight per SM (issue 16's 0.75 of the copy rate on the H200,
# 0.672 there on 2026-12-07): threads per row and registers per thread, in four builds of
# ops/cuda/layer_norm_kernels.cu (each .gpubinNN holds layer_norm_bench and layer_norm_test of
# main with NN's ln_bwd.patch, xz-compressed; COMMIT names the base):
#   35  x and dy as float in registers (the landed kernel), AMP8_LN_BWD_THREADS picks 512/256/128
#   36  x and dy kept packed (bf16) in registers, no dbeta accumulators under RMSNorm
#   37  36 with __launch_bounds__(512, 3): at most 40 registers, three 512-thread rows per SM
#   38  36 with __launch_bounds__(128): 128-thread rows without spills (165 registers)
# From the repository root on the GPU machine:
#   run(command="bash bench/results/layer_norm_bwd_registers/run.sh",
#       carry=[".gpubin35", ".gpubin36", ".gpubin37", ".gpubin38"], kind="nvidia-h200")
# Writes $OUT/ln.tgz: each variant's `_CUDA` tests (it must stay correct) and bench rounds,
# interleaved, with a summary line per backward case.
set -u
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64 OMP_NUM_THREADS=1
R=$OUT/ln; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
for n in 35 36 37 38; do
  mkdir -p /tmp/t$n
  for b in layer_norm_bench layer_norm_test; do xz -dc .gpubin$n/$b.xz > /tmp/t$n/$b; chmod +x /tmp/t$n/$b; done
  cp .gpubin$n/COMMIT $R/commit_$n.txt
done
CONFIGS="35:512 35:128 36:512 36:256 37:512 38:128 35:256 36:128"
for c in $CONFIGS; do
  n=${c%:*}; t=${c#*:}
  (cd /tmp/t$n && AMP8_LN_BWD_THREADS=$t timeout 100 ./layer_norm_test --gtest_filter='*_CUDA*' > $R/test_${n}_$t.txt 2>&1
   echo "test $n threads $t rc $? $(grep -E '^\[  (PASSED|FAILED) ' $R/test_${n}_$t.txt | tr '\n' ' ')")
done
for round in 1 2 3; do
  for c in $CONFIGS; do
    ((SECONDS > ${DEADLINE:-470})) && break 2
    n=${c%:*}; t=${c#*:}
    (cd /tmp/t$n && AMP8_LN_BWD_THREADS=$t timeout 60 ./layer_norm_bench > $R/bench_${n}_${t}_$round.jsonl 2>/dev/null)
    python3 - "$R/bench_${n}_${t}_$round.jsonl" $round $c <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if "bwd" in r["case"] and "parts" not in r["case"]:
        print(sys.argv[2], sys.argv[3], r["case"], r["shape"], r["ours_ms"], round(r["fraction_of_copy"], 3))
PY
  done
done
echo "elapsed $SECONDS s"
(cd $OUT && tar czf ln.tgz ln && rm -rf ln)
