#!/usr/bin/env bash
# GPU check of GELU and its backward inside the blockwise quantizations (issue 19), as one device
# call from the repository root:
#   run(command="bash bench/results/blockwise_mlp_fusion/run.sh", carry=[".gpubin12"])
#   (with carry=[".gpubin12", ".gpubin13"] also the saturating_cast2 change of 6bb2555)
# .gpubin12/ (git-ignored) holds xz-compressed binaries built on the CPU machine from e6a53e0:
# blockwise_test, fp8_layer_norm_test, fp8_linear_test, quantize_test, gpt_model_test,
# cast_transpose_bench, layer_norm_bench, gpt_pretrain. .gpubin13/, when carried, the same
# of 6bb2555 (blockwise_test, quantize_test, cast_transpose_bench; fp8_layer_norm_test of 540b1b6): its byte-for-byte tests and
# its cast_transpose_bench interleaved with e6a53e0's.
# It runs every _CUDA test of those test binaries, compute-sanitizer memcheck over the
# new kernels' test, cast_transpose_bench twice (the fused casts against LibTorch's GELU kernels
# before quantize_blockwise, same run), layer_norm_bench (issue 16's LayerNorm backward on this
# card), the 1b GPT step under the blockwise recipe with the MLP fused (the default) and with
# --fused-mlp false (the modules in sequence: what main did), interleaved twice, delayed scaling
# beside them, and the fused step's device time by category. Results go straight under $OUT/K.
set -u
B=.gpubin12; N=.gpubin13
for d in $B $N; do [ -d $d ] && (cd $d; for f in *.xz; do unxz -f "$f"; done; chmod +x *); done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib
export OMP_NUM_THREADS=1
R=$OUT/K; mkdir -p $R; S=/tmp/step; mkdir -p $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $R/tests.txt; timeout $t "$@" --gtest_brief=1 >> $R/tests.txt 2>&1; echo "$name exit $?" | tee -a $R/tests.txt; }
run blockwise 120 $B/blockwise_test --gtest_filter='*_CUDA*'
run fp8_layer_norm 150 $B/fp8_layer_norm_test --gtest_filter='*_CUDA*'
run fp8_linear 150 $B/fp8_linear_test --gtest_filter='*_CUDA*'
run gpt_model 150 $B/gpt_model_test --gtest_filter='*_CUDA*'
for shard in 0 1 2; do
  GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$shard run quantize_$shard 150 $B/quantize_test --gtest_filter='*_CUDA*' &
done; wait
grep -E "FAILED|Failure" $R/tests.txt | head -20
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
common="--config 1b --micro-batch 8 --steps 40 --log-every 20 --data $S/stdlib.txt --save-last false"
step_round() {
  local round=$1
  for fused in false true; do
    entries=bf16-mixed+fp8+blockwise+fp8-params
    [ $round = 1 ] && [ $fused = true ] && entries=$entries,bf16-mixed+fp8+delayed+fp8-params
    timeout 150 python3 bench/gpt_compare_rows.py --case gpt_step_blockwise_mlp_fusion --binary $B/gpt_pretrain -- $common \
      --fused-mlp $fused --compare $entries --save-dir $S/fused_${fused}_$round > $R/step_fused_${fused}_$round.jsonl 2> $R/step_fused_${fused}_$round.log
    echo "1b --fused-mlp $fused round $round exit $? (${SECONDS} s)"
    python3 -c "
import json
for l in open('$R/step_fused_${fused}_$round.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'TFLOP/s', round(r.get('model_tflops',0) or 0), 'step_ms', r.get('step_ms'), 'peak', r.get('peak_mem_bytes'), 'loss', r.get('final_loss'))
" 2>/dev/null
  done
}
step_round 1
for round in 1 2; do for v in $B $N; do
  [ -d $v ] || continue
  tag=${v#.gpubin}_$round
  timeout 120 $v/cast_transpose_bench > $R/cast_transpose_bench_$tag.jsonl 2> $R/cast_transpose_bench_$tag.err; echo "cast_transpose_bench $v round $round exit $?"
  python3 -c "
import json
for l in open('$R/cast_transpose_bench_$tag.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if ('blockwise' in r.get('case','') and 'shards' not in r.get('case','')) or r.get('case')=='cast_transpose_amax': print('  ', r['case'], r.get('shape'), round(r.get('ours_ms',0),4), 'baseline', round(r.get('baseline_ms',0) or 0,4), 'speedup', round(r.get('speedup',0) or 0,3), 'of copy', round(r.get('fraction_of_copy',0),3))
"
done; done
if [ -d $N ]; then
  run nan_blockwise 120 $N/blockwise_test --gtest_filter='*_CUDA*'
  [ -x $N/fp8_layer_norm_test ] && run nan_fp8_layer_norm 150 $N/fp8_layer_norm_test --gtest_filter='*_CUDA*'
  for shard in 0 1 2; do
    GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$shard run nan_quantize_$shard 150 $N/quantize_test --gtest_filter='*_CUDA*' &
  done; wait
fi
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$SAN" ]; then
  for tool in memcheck; do
    timeout 60 $SAN --tool $tool --error-exitcode 9 $B/blockwise_test \
      --gtest_filter='*CudaGeluTilesMatchCpu_CUDA' --gtest_brief=1 > $R/sanitizer_$tool.txt 2>&1
    echo "compute-sanitizer $tool exit $?"; grep -E "ERROR SUMMARY|PASSED|FAILED" $R/sanitizer_$tool.txt | head -4
  done
fi
timeout 60 $B/layer_norm_bench > $R/layer_norm_bench.jsonl 2> $R/layer_norm_bench.err; echo "layer_norm_bench exit $?"
python3 -c "
import json
for l in open('$R/layer_norm_bench.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if r.get('case') in ('layer_norm_bwd_bf16','rms_norm_bwd_bf16'): print('  ', r['case'], r.get('shape'), round(r.get('ours_ms',0),4), round(r.get('fraction_of_copy',0),3))
"
timeout 120 $B/gpt_pretrain --config 1b --micro-batch 8 --steps 14 --log-every 7 --compare bf16-mixed+fp8+blockwise+fp8-params \
  --profile $S/prof --profile-first-step 10 --profile-steps 3 --data $S/stdlib.txt --save-dir $S/prof_run --save-last false > $R/prof.log 2>&1
echo "profile exit $? (${SECONDS} s)"; find $S/prof -name step_profile.txt -exec cp {} $R/1b_blockwise_fused_step_profile.txt \;
head -14 $R/1b_blockwise_fused_step_profile.txt
if [ $SECONDS -lt 420 ]; then step_round 2; else echo "round 2 skipped: ${SECONDS} s used"; fi
echo done
