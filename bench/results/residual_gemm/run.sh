#!/usr/bin/env bash
# The residual connections inside the output GEMMs (session 43), from the repository root:
#   run(command="bash bench/results/residual_gemm/run.sh", carry=[".gpubin28", ".gpubin27"])
# .gpubin28 = main with Fp8GemmOptions::residual and forward_with_residual in the GPT and Llama
# blocks (git-ignored, built on the CPU machine); .gpubin27 = main at 612de62 (before it). The
# new `_CUDA` tests (the GEMM's residual against the float64 reference, forward_with_residual
# against residual + forward in every recipe and MLP path), then in alternating rounds the 1b
# fp8_params step (delayed and blockwise) and the Llama 8B proxy (bf16-mixed against FP8:
# issue 22's ratio), new against old. Writes $OUT/residual_gemm.tgz.
set -u
NEW=${NEW:-.gpubin28}; OLD=${OLD:-.gpubin27}; R=$OUT/residual_gemm; mkdir -p $R /tmp/new /tmp/old
for f in $NEW/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/new/$n; chmod +x /tmp/new/$n; done
xz -dc $OLD/gpt_pretrain.xz > /tmp/old/gpt_pretrain; chmod +x /tmp/old/gpt_pretrain
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib OMP_NUM_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'
  echo "new $NEW $(cat $NEW/COMMIT), old $OLD $(cat $OLD/COMMIT)"; } | tee $R/device.txt
for t in fp8_gemm_test blockwise_test fp8_linear_test fp8_layer_norm_test gpt_model_test llama_model_test; do
  [ -x /tmp/new/$t ] || continue
  timeout 150 /tmp/new/$t --gtest_filter='*_CUDA*' --gtest_brief=1 > /tmp/tests_$t.txt 2>&1
  echo "$t _CUDA exit $? (${SECONDS} s)" | tee -a $R/tests_CUDA.txt
  grep -E "FAILED|Failure|PASSED|SKIPPED|tests ran" -A3 /tmp/tests_$t.txt | head -30 | tee -a $R/tests_CUDA.txt | head -8
done
S=/tmp/step; mkdir -p $S
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
step() {  # tag binary round case -- gpt_pretrain args
  local tag=$1 bin=$2 round=$3 case=$4; shift 5
  timeout 200 python3 bench/gpt_compare_rows.py --case $case --binary $bin -- "$@" --data $S/stdlib.txt \
    --save-last false --save-dir $S/run_${case}_${tag}_$round > $R/${case}_${tag}_round$round.jsonl 2> /tmp/${case}_${tag}_$round.log
  echo "$case $tag round $round exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/${case}_${tag}_round$round.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'step_ms', round(r.get('step_ms',0),2), 'TFLOP/s', round(r.get('model_tflops') or 0), 'loss', r.get('final_loss'))
" 2>/dev/null
}
one_b="--config 1b --micro-batch 8 --steps 40 --log-every 20 --compare bf16-mixed+fp8+delayed+fp8-params,bf16-mixed+fp8+blockwise+fp8-params"
proxy="--config llama3_8b_4layer --steps 30 --log-every 10 --fp8-min-gemm-size 0 --compare bf16-mixed,bf16-mixed+fp8"
for round in 1 2; do
  step new /tmp/new/gpt_pretrain $round gpt_step_residual_gemm -- $one_b
  step old /tmp/old/gpt_pretrain $round gpt_step_residual_gemm -- $one_b
done
step new /tmp/new/gpt_pretrain 1 llama_step_residual_gemm -- $proxy
step old /tmp/old/gpt_pretrain 1 llama_step_residual_gemm -- $proxy
(cd $OUT && tar czf residual_gemm.tgz residual_gemm && rm -rf residual_gemm)
echo "done (${SECONDS} s)"
