#!/usr/bin/env bash
# Issue 22's 1.4x on an H200 with session 47's two changes (prepared 2026-12-08, session 47; not
# yet run): the cast-transpose kernels one pass at a time and the FP8 weights written by the
# fused Adam pass (--fp8-params-scaling delayed). BIN (default .gpubin43) holds gpt_pretrain and
# quantize_test of main at its COMMIT, xz-compressed (git-ignored; rebuild on a new checkout:
# `ninja gpt_pretrain quantize_test`, `xz` both into the folder, `git rev-parse --short HEAD > COMMIT`).
# From the repository root on the GPU machine:
#   run(command="bash bench/results/proxy_one_pass_h200/run.sh", carry=[".gpubin43"], kind="nvidia-h200")
# 1. quantize_test's byte comparisons of the SwiGLU, dSwiGLU and dGELU casts against the CPU
#    (the landed kernels; session 47's call ran out of time before them), with every core for the
#    CPU reference. 2. The Llama 8B proxy, bf16-mixed against FP8 (fp8_params) with the weights
#    written at the current scale and at the last step's, two interleaved rounds.
# Writes $OUT/proxy_one_pass.tgz.
set -u
B=${BIN:-.gpubin43}; R=$OUT/proxy_one_pass; mkdir -p $R /tmp/b
for f in $B/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/b/$n; chmod +x /tmp/b/$n; done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'
  echo "$B $(cat $B/COMMIT)"; } | tee $R/device.txt
OMP_NUM_THREADS=16 timeout 240 /tmp/b/quantize_test \
  --gtest_filter='*CastTransposeSwigluMatchesCpu_CUDA*:*CastTransposeDswigluMatchesCpu_CUDA*:*CastTransposeDgeluMatchesCpu_CUDA*:*CastTransposeMatchesCpu_CUDA*' \
  > $R/quantize_test_cuda.txt 2>&1
echo "quantize_test rc $? $(grep -E '^\[  (PASSED|FAILED) ' $R/quantize_test_cuda.txt | tr '\n' ' ') (${SECONDS} s)"
export OMP_NUM_THREADS=1
S=/tmp/step; mkdir -p $S
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
P="--config llama3_8b_4layer --steps 30 --log-every 10 --fp8-min-gemm-size 0 --data $S/stdlib.txt --save-last false"
for round in 1 2; do
  for scaling in current delayed; do
    ((SECONDS > ${DEADLINE:-540})) && break 2
    name=proxy_${scaling}_round$round
    timeout 150 python3 bench/gpt_compare_rows.py --case llama_step --binary /tmp/b/gpt_pretrain -- $P \
      --fp8-params-scaling $scaling --compare bf16-mixed,bf16-mixed+fp8 --save-dir $S/$name > $R/$name.jsonl 2> $R/$name.log
    echo "$name exit $? (${SECONDS} s)"
    python3 -c "
import json
for l in open('$R/$name.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'TFLOP/s', round(r.get('model_tflops') or 0), 'x bf16', round(r.get('tokens_per_s_vs_bf16') or 0, 4))
" 2>/dev/null
  done
done
(cd $OUT && tar czf proxy_one_pass.tgz proxy_one_pass && rm -rf proxy_one_pass)
echo "done (${SECONDS} s)"
