#!/usr/bin/env bash
# GPU check for issue 19 (prepared 2026-12-06, session 33; run 2026-12-06, session 35: MANIFEST.md), as one device call
# from the repository root:
#   run(command="bash bench/results/blockwise_cast_mode_step/run.sh", carry=[".gpubin14", ".gpubin12", ".gpubin13"])
# .gpubin14/ (git-ignored): main at 2826a3b built on the CPU machine (gpt_pretrain,
# cast_transpose_bench and the test binaries): the blockwise kernels and the elementwise quantize
# with Fp8CastMode::kNanBranch, the tensorwise cast_transpose kernels with kClamp. .gpubin12/:
# e6a53e0 (every conversion kClamp); .gpubin13/: 6bb2555 (every conversion kNanBranch); see
# ../blockwise_mlp_fusion/MANIFEST.md.
# 1. every _CUDA test of main's binaries (the landed combination has not run on a GPU as one
#    binary; each kernel's code has, in .gpubin12 or .gpubin13);
# 2. the 1b blockwise step, main against .gpubin12 (the same but for the blockwise kernels'
#    conversion), interleaved twice, delayed beside: what kNanBranch gives a step;
# 3. main's cast_transpose_bench (both kinds of kernel at their measured speed in one binary);
# 4. Nsight Compute of the tensorwise cast_transpose kernel in .gpubin12 and .gpubin13: why the
#    NaN branch slows it (0.67-0.95x) when it speeds the blockwise kernels.
# Everything goes into one tarball under $OUT (a call returns at most 8 files).
set -u
M=.gpubin14; C=.gpubin12; N=.gpubin13
for d in $M $C $N; do [ -d $d ] && (cd $d; for f in *.xz; do unxz -f "$f"; done; chmod +x *); done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib
export OMP_NUM_THREADS=1
R=/tmp/K; mkdir -p $R; S=/tmp/step; mkdir -p $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c 'import torch; print(torch.__version__)' | tee -a $R/device.txt
pack() { tar czf $OUT/blockwise_cast_mode_step.tar.gz -C /tmp K; }
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $R/tests.txt; timeout $t "$@" --gtest_brief=1 >> $R/tests.txt 2>&1; echo "$name exit $?" | tee -a $R/tests.txt; }
run blockwise 120 $M/blockwise_test --gtest_filter='*_CUDA*'
run fp8_layer_norm 150 $M/fp8_layer_norm_test --gtest_filter='*_CUDA*'
run fp8_linear 150 $M/fp8_linear_test --gtest_filter='*_CUDA*'
run gpt_model 150 $M/gpt_model_test --gtest_filter='*_CUDA*'
for shard in 0 1 2; do
  GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$shard run quantize_$shard 150 $M/quantize_test --gtest_filter='*_CUDA*' &
done; wait
grep -E "FAILED|Failure" $R/tests.txt | head -20
pack
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
common="--config 1b --micro-batch 8 --steps 40 --log-every 20 --data $S/stdlib.txt --save-last false"
for round in 1 2; do for v in $C $M; do
  entries=bf16-mixed+fp8+blockwise+fp8-params
  [ $round = 1 ] && [ $v = $M ] && entries=$entries,bf16-mixed+fp8+delayed+fp8-params
  tag=${v#.gpubin}_$round
  timeout 150 python3 bench/gpt_compare_rows.py --case gpt_step_blockwise_cast_mode --binary $v/gpt_pretrain -- $common \
    --compare $entries --save-dir $S/run_$tag > $R/step_$tag.jsonl 2> $R/step_$tag.log
  echo "1b $v round $round exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/step_$tag.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'TFLOP/s', round(r.get('model_tflops',0) or 0), 'step_ms', r.get('step_ms'), 'loss', r.get('final_loss'))
" 2>/dev/null
  pack
done; done
timeout 120 $M/cast_transpose_bench > $R/cast_transpose_bench_14.jsonl 2> $R/cast_transpose_bench_14.err; echo "cast_transpose_bench main exit $?"
python3 -c "
import json
for l in open('$R/cast_transpose_bench_14.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if 'shards' not in r.get('case','') and r.get('case') != 'quantize_many': print('  ', r['case'], r.get('shape'), round(r.get('ours_ms',0),4), 'of copy', round(r.get('fraction_of_copy',0) or 0,3))
"
pack
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$NCU" ]; then
  for v in $C $N; do
    tag=${v#.gpubin}
    timeout 100 $NCU --clock-control none -k regex:cast_transpose_kernel -s 5 -c 1 --set full \
      -o /tmp/ncu_ct_$tag $v/cast_transpose_bench > /tmp/ncu_ct_$tag.log 2>&1; echo "ncu $v exit $?"
    $NCU -i /tmp/ncu_ct_$tag.ncu-rep --page details > $R/ncu_cast_transpose_$tag.txt 2>&1
    grep -E "^ +(Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Ipc Active|Compute \(SM\) Throughput)" $R/ncu_cast_transpose_$tag.txt | head -10
  done
  pack
fi
echo "done (${SECONDS} s)"
