#!/usr/bin/env bash
# GPU check of the one-read blockwise weight write (prepared 2026-12-06, session 36; not yet run),
# one device call from the repository root:
#   run(command="bash bench/results/whole_weights_blockwise/run.sh", carry=[".gpubin18", ".gpubin19"])
# .gpubin18/ (git-ignored): main at the commit in its COMMIT file, built on the CPU machine:
# quantize_whole_weights_blockwise (DistributedOptimizer at world size 1 and
# update_fp8_weight_blocks write each FP8 weight's 128x128 blocks from one read of its master)
# and the 128x128 kernel's 16-byte loads for float32. .gpubin19/: gpt_pretrain of 4010bd9, the
# commit before (the two passes over the masters). Neither survives a new checkout: rebuild
# them there (cmake --build for the five targets; the baseline from 4010bd9's sources).
# 1. the _CUDA tests of blockwise_test (WholeWeightKernelsMatchCpuByteForByte_CUDA, and
#    CudaMatchesCpuByteForByte_CUDA, whose float32 128x128 cases now take the 16-byte loads),
#    fp8_linear_test and distributed_optimizer_test;
# 2. cast_transpose_bench: quantize_whole_weights_blockwise against the two passes, 350m and 1b
#    weights (predicted from the bytes: 5.9 ms -> ~2.3 ms at 1b on an H100);
# 3. the 1b step, blockwise with FP8 weights, main against .gpubin19, interleaved twice, delayed
#    beside once (predicted ~1.02x: ~3.5 ms of the ~161 ms step).
# Everything goes into one tarball under $OUT.
set -u
M=${MAIN:-.gpubin18}; B=.gpubin19  # MAIN: another build of main (its COMMIT file says which)
for d in $M $B; do (cd $d; for f in *.xz; do unxz -f "$f"; done; chmod +x *); done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib
export OMP_NUM_THREADS=1
R=/tmp/W; mkdir -p $R; S=/tmp/step; mkdir -p $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c 'import torch; print(torch.__version__)' | tee -a $R/device.txt
cat $M/COMMIT >> $R/device.txt
pack() { tar czf $OUT/whole_weights_blockwise.tar.gz -C /tmp W; }
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $R/tests.txt; timeout $t "$@" --gtest_brief=1 >> $R/tests.txt 2>&1; echo "$name exit $?" | tee -a $R/tests.txt; }
run blockwise 150 $M/blockwise_test --gtest_filter='*_CUDA*'
run fp8_linear 150 $M/fp8_linear_test --gtest_filter='*_CUDA*'
run distributed_optimizer 150 $M/distributed_optimizer_test --gtest_filter='*_CUDA*'
grep -E "FAILED|Failure" $R/tests.txt | head -20
pack
timeout 120 $M/cast_transpose_bench > $R/cast_transpose_bench.jsonl 2> $R/cast_transpose_bench.err; echo "cast_transpose_bench exit $?"
python3 -c "
import json
for l in open('$R/cast_transpose_bench.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if 'blockwise' in r.get('case','') or r.get('case') == 'quantize_many': print('  ', r['case'], r.get('shape'), round(r.get('ours_ms',0),4), 'x', round(r.get('speedup',0) or 0,3), 'of copy', round(r.get('fraction_of_copy',0) or 0,3))
"
pack
# The LayerNorm backward (issue 16) on whatever card this is, when MAIN carries the bench.
if [ -x $M/layer_norm_bench ]; then
  timeout 150 $M/layer_norm_bench > $R/layer_norm_bench.jsonl 2> $R/layer_norm_bench.err; echo "layer_norm_bench exit $?"
  python3 -c "
import json
for l in open('$R/layer_norm_bench.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if r.get('case','').startswith('layer_norm_bwd') or r.get('case') == 'copy': print('  ', r['case'], r.get('shape'), r.get('ours_ms'), 'of copy', r.get('fraction_of_copy'))
"
  pack
fi
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
common="--config 1b --micro-batch 8 --steps 40 --log-every 20 --data $S/stdlib.txt --save-last false"
for round in 1 2; do for v in $B $M; do
  entries=bf16-mixed+fp8+blockwise+fp8-params
  [ $round = 1 ] && [ $v = $M ] && entries=$entries,bf16-mixed+fp8+delayed+fp8-params
  tag=${v#.gpubin}_$round
  timeout 150 python3 bench/gpt_compare_rows.py --case gpt_step_whole_weights_blockwise --binary $v/gpt_pretrain -- $common \
    --compare $entries --save-dir $S/run_$tag > $R/step_$tag.jsonl 2> $R/step_$tag.log
  echo "1b $v round $round exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/step_$tag.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'TFLOP/s', round(r.get('model_tflops',0) or 0), 'step_ms', r.get('step_ms'), 'loss', r.get('final_loss'))
" 2>/dev/null
  pack
done; done
echo "done (${SECONDS} s)"
