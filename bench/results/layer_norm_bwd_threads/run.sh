#!/usr/bin/env bash
# The LayerNorm backward's threads per row (512, the landed plan, against 256 and 128, which give
# each thread 16 or 32 elements and more blocks per SM), for issue 16's 0.75 of the copy rate on
# the H200 (0.672 there on 2026-12-07). From the repository root, on the GPU machine:
#   run(command="bash bench/results/layer_norm_bwd_threads/run.sh", carry=[".gpubinNN"], kind="nvidia-h200")
# .gpubinNN (BIN=...; default .gpubin35) = layer_norm_bench and layer_norm_test built on the CPU
# machine from main with ln_bwd_threads.patch applied (`git apply`; kBwdMaxElems 32 and
# AMP8_LN_BWD_THREADS read by the backward's plan), xz-compressed. Writes $OUT/ln.tgz: each
# thread count's `_CUDA` tests (the plan must stay correct) and two interleaved bench rounds.
set -u
B=${BIN:-.gpubin35}
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64 OMP_NUM_THREADS=1
R=$OUT/ln; mkdir -p /tmp/t $R
for b in layer_norm_bench layer_norm_test; do xz -dc $B/$b.xz > /tmp/t/$b; chmod +x /tmp/t/$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
for t in 512 256 128; do
  (cd /tmp/t && AMP8_LN_BWD_THREADS=$t timeout 150 ./layer_norm_test --gtest_filter='*_CUDA' > $R/test_$t.txt 2>&1
   echo "test threads $t rc $? $(grep -E '^\[  (PASSED|FAILED) ' $R/test_$t.txt | tr '\n' ' ')")
done
for round in 1 2; do
  for t in 512 256 128; do
    (cd /tmp/t && AMP8_LN_BWD_THREADS=$t timeout 120 ./layer_norm_bench > $R/bench_${t}_$round.jsonl 2>/dev/null)
    python3 - "$R/bench_${t}_$round.jsonl" $round $t <<'PY'
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
(cd $OUT && tar czf ln.tgz ln && rm -rf ln)
