#!/usr/bin/env bash
# The cast-transpose kernels' loads in flight against blocks per SM (session 47), after the
# dSwiGLU kernel's one-pass-at-a-time variant ran at 0.93 of the copy rate against main's 0.73 on
# an H100 (../dswiglu_occupancy/). Four builds of ops/cuda/quantize_kernels.cu (.gpubin41/<v>:
# gpt_pretrain, quantize_test, fp8_layer_norm_test and cast_transpose_bench, xz-compressed):
#   base  main (b336d5f)
#   new   the dSwiGLU cast loads and casts one pass at a time, 4 blocks per SM (48 registers)
#   v1    new + cast_transpose_kernel's gated casts (SwiGLU forward, dGELU) one pass at a time,
#         dGELU at 4 blocks per SM (106 -> 64 registers; SwiGLU 64 + 66 B spilled -> 56)
#   v2    v1 + the plain / dbias / GELU casts one pass at a time, 4 blocks per SM (tile128: 79 -> 64)
# With .gpubin42 (gpt_pretrain and the optimizer's test binaries of `new` + ../one_pass_fp8_adam's
# draft, fp8_params_scaling "delayed"): its `_CUDA` tests, and its proxy step with
# --fp8-params-scaling delayed beside the others.
# From the repository root on the GPU machine:
#   run(command="bash bench/results/cast_transpose_occupancy/run.sh", carry=[".gpubin41", ".gpubin42"], kind="nvidia-h200")
# Writes $OUT/ct.tgz: each variant's `_CUDA` tests (quantize_test, fp8_layer_norm_test), two
# interleaved cast_transpose_bench rounds, and the Llama 8B proxy (issue 22) and 1b GPT (issue 16)
# FP8 steps of each build, with a bf16-mixed run of base for the ratio.
set -u
B=${BIN:-.gpubin41}; R=$OUT/ct; mkdir -p $R
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64 OMP_NUM_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'; } | tee $R/device.txt
VARIANTS="base new v1 v2"
for v in $VARIANTS; do
  mkdir -p /tmp/c_$v
  for f in $B/$v/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/c_$v/$n; chmod +x /tmp/c_$v/$n; done
  cp $B/$v/COMMIT $R/commit_$v.txt
done
if [ -d .gpubin42 ]; then
  mkdir -p /tmp/c_op
  for f in .gpubin42/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/c_op/$n; chmod +x /tmp/c_op/$n; done
  cp .gpubin42/COMMIT $R/commit_op.txt
  for t in fused_optimizer_test mixed_precision_plugin_test distributed_optimizer_test; do
    f='*_CUDA*'; [ $t = gpt_pretrain_test ] && f='*TrainsOnTheGpuInEveryPrecision_CUDA'
    (timeout 90 /tmp/c_op/$t --gtest_filter="$f" > $R/${t}_op.txt 2>&1
     echo "$t op rc $? $(grep -E '^\[  (PASSED|FAILED) ' $R/${t}_op.txt | tr '\n' ' ')")
  done
fi
for v in new v1 v2; do
  for t in quantize_test fp8_layer_norm_test; do
    (cd /tmp/c_$v && timeout 120 ./$t --gtest_filter='*_CUDA*' > $R/${t}_$v.txt 2>&1
     echo "$t $v rc $? $(grep -E '^\[  (PASSED|FAILED) ' $R/${t}_$v.txt | tr '\n' ' ')")
  done
done
for round in 1 2; do
  for v in $VARIANTS; do
    (cd /tmp/c_$v && timeout 60 ./cast_transpose_bench > $R/bench_${v}_$round.jsonl 2>/dev/null)
    python3 - "$R/bench_${v}_$round.jsonl" $round $v <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r["case"].startswith("cast_transpose_") and r["case"] != "cast_transpose_amax" and r.get("shape", "").startswith("16384"):
        print(sys.argv[2], sys.argv[3], r["case"], r["shape"], r.get("ours_ms"), round(r.get("fraction_of_copy") or 0, 3))
PY
  done
done
echo "bench done (${SECONDS} s)"
S=/tmp/step; mkdir -p $S
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
step() {  # name binary-folder case -- gpt_pretrain args
  local name=$1 dir=$2 case=$3; shift 4
  ((SECONDS > ${DEADLINE:-540})) && { echo "$name skipped (deadline)"; return; }
  timeout 120 python3 bench/gpt_compare_rows.py --case $case --binary $dir/gpt_pretrain -- "$@" --data $S/stdlib.txt \
    --save-last false --save-dir $S/run_$name > $R/$name.jsonl 2> $R/$name.log
  echo "$name exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/$name.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'TFLOP/s', round(r.get('model_tflops') or 0))
" 2>/dev/null
}
P="--config llama3_8b_4layer --steps 30 --log-every 10 --fp8-min-gemm-size 0"
step proxy_bf16_base /tmp/c_base llama_step -- $P --compare bf16-mixed
for v in base new v1 v2 op op v2 v1 new base; do
  if [ $v = op ]; then
    [ -d /tmp/c_op ] && step proxy_fp8_delayed_weights_$SECONDS /tmp/c_op llama_step -- $P --fp8-params-scaling delayed --compare bf16-mixed+fp8
  else
    step proxy_fp8_$v\_$SECONDS /tmp/c_$v llama_step -- $P --compare bf16-mixed+fp8
  fi
done
G="--config 1b --micro-batch 8 --steps 40 --log-every 20 --compare bf16-mixed+fp8+fp8-params"
for v in base v1 v2 v2 v1 base; do step 1b_fp8_$v\_$SECONDS /tmp/c_$v gpt_step -- $G; done
echo "elapsed $SECONDS s"
(cd $OUT && tar czf ct.tgz ct && rm -rf ct)
