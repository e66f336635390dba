#!/usr/bin/env bash
# The residual gradients summed by the LayerNorm backward (session 44), from the repository root:
#   run(command="STAGE=1 bash bench/results/residual_backward/run.sh", carry=[".gpubin31", ".gpubin30"], kind="nvidia-h200")
#   run(command="STAGE=2 bash bench/results/residual_backward/run.sh", carry=[".gpubin31", ".gpubin30"])
# .gpubin31 = main with WithResidualBranch (git-ignored, built on the CPU machine: gpt_pretrain,
# layer_norm_bench and the test binaries); .gpubin30 = main at 68c8279 (before it: gpt_pretrain,
# layer_norm_bench). Stage 1: the `_CUDA` tests of the new binaries, layer_norm_bench new and
# old (the backward with and without the residual's gradient; issue 16's 0.75 of copy on an
# H200), the 1b step new against old in alternating rounds (bf16-mixed and FP8 delayed with
# fp8_params). Stage 2: the kernels' tests and benches again (the residual a template
# parameter), the Llama 8B proxy new against old (bf16-mixed and FP8: issue 22's ratio) and a
# third 1b round. Writes $OUT/residual_backward_stage$STAGE.tgz.
set -u
STAGE=${STAGE:-1}; NEW=${NEW:-.gpubin31}; OLD=${OLD:-.gpubin30}
R=$OUT/residual_backward_stage$STAGE; mkdir -p $R /tmp/new /tmp/old
for f in $NEW/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/new/$n; chmod +x /tmp/new/$n; done
for f in $OLD/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/old/$n; chmod +x /tmp/old/$n; done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib OMP_NUM_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'
  echo "new $NEW $(cat $NEW/COMMIT), old $OLD $(cat $OLD/COMMIT)"; date -u +%FT%TZ; } | tee $R/device.txt
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
tests() {
  for t in "$@"; do
    [ -x /tmp/new/$t ] || continue
    timeout 150 /tmp/new/$t --gtest_filter='*_CUDA*' --gtest_brief=1 > /tmp/tests_$t.txt 2>&1
    echo "$t _CUDA exit $? (${SECONDS} s)" | tee -a $R/tests_CUDA.txt
    grep -E "FAILED|Failure|PASSED|SKIPPED|tests ran" -A3 /tmp/tests_$t.txt | head -30 | tee -a $R/tests_CUDA.txt | head -8
  done
}
layer_norm_benches() {
  for tag in new old; do
    (cd /tmp/$tag && timeout 150 ./layer_norm_bench > $R/layer_norm_bench_$tag.jsonl 2> /tmp/layer_norm_bench_$tag.err)
    echo "layer_norm_bench $tag exit $? (${SECONDS} s)"
    python3 -c "
import json
for l in open('$R/layer_norm_bench_$tag.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if r.get('case') in ('layer_norm_bwd_bf16', 'layer_norm_bwd_bf16_residual', 'rms_norm_bwd_bf16'): print('  ', r['case'], r.get('shape'), r.get('ours_ms'), 'baseline', r.get('baseline_ms'), 'of copy', r.get('fraction_of_copy'))"
  done
}
one_b="--config 1b --micro-batch 8 --steps 40 --log-every 20 --compare bf16-mixed,bf16-mixed+fp8+delayed+fp8-params"
proxy="--config llama3_8b_4layer --steps 30 --log-every 10 --fp8-min-gemm-size 0 --compare bf16-mixed,bf16-mixed+fp8"
if [ "$STAGE" = 1 ]; then
  tests layer_norm_test fp8_layer_norm_test gpt_model_test llama_model_test cuda_graph_test recompute_test
  layer_norm_benches
  for round in 1 2; do
    step new /tmp/new/gpt_pretrain $round gpt_step_residual_backward -- $one_b
    step old /tmp/old/gpt_pretrain $round gpt_step_residual_backward -- $one_b
  done
else
  # Stage 2 (after stage 1 on an H100: the residual a template parameter of the backward
  # kernel, whose null-pointer test had cost the backward without a residual 6-7%).
  tests layer_norm_test fp8_layer_norm_test
  layer_norm_benches
  for round in 1 2; do
    step new /tmp/new/gpt_pretrain $round llama_step_residual_backward -- $proxy
    step old /tmp/old/gpt_pretrain $round llama_step_residual_backward -- $proxy
  done
  step new /tmp/new/gpt_pretrain 3 gpt_step_residual_backward -- $one_b
  step old /tmp/old/gpt_pretrain 3 gpt_step_residual_backward -- $one_b
fi
(cd $OUT && tar czf residual_backward_stage$STAGE.tgz residual_backward_stage$STAGE && rm -rf residual_backward_stage$STAGE)
echo "done (${SECONDS} s)"
