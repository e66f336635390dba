#!/usr/bin/env bash
# Second call of the measured FP8 GEMM algorithms (session 42), from the repository root:
#   run(command="bash bench/results/gemm_autotune/run_rows.sh", carry=[".gpubin24"])
# .gpubin24 = main at its COMMIT (git-ignored, built on the CPU machine): `fp8_gemm_bench algo`
# (the first call's aborted after one row: it asked the block-scaled GEMMs for fast
# accumulation), and gpt_pretrain_test's _CUDA cases (the default now times candidates).
# Writes $OUT/gemm_autotune_rows/.
set -u
B=.gpubin24; R=$OUT/gemm_autotune_rows; mkdir -p $R /tmp/g24
for f in $B/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/g24/$n; chmod +x /tmp/g24/$n; done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib OMP_NUM_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'
  echo "$B $(cat $B/COMMIT)"; } | tee $R/device.txt
(cd /tmp/g24 && timeout 120 ./fp8_gemm_bench algo > $R/fp8_gemm_bench_algo.jsonl 2> $R/fp8_gemm_bench_algo.err)
echo "fp8_gemm_bench algo exit $? (${SECONDS} s)"
python3 -c "
import json
for l in open('$R/fp8_gemm_bench_algo.jsonl'):
    r=json.loads(l); print('   ', r['gemm'], r['recipe'], 'heuristic', round(r['baseline_ms'],3), 'measured', round(r['ours_ms'],3), 'x', round(r['speedup'],3))"
timeout 180 /tmp/g24/gpt_pretrain_test --gtest_filter='*_CUDA*' --gtest_brief=1 > $R/tests_gpt_pretrain_test.txt 2>&1
echo "gpt_pretrain_test _CUDA exit $? (${SECONDS} s)"; grep -E "FAILED|Failure|PASSED|SKIPPED" $R/tests_gpt_pretrain_test.txt | head -8
