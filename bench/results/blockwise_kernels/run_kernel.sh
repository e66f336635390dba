#!/usr/bin/env bash
# GPU check of the blockwise kernels (issue 19; run as staged, before they landed), as one device call from the repository root:
#   run(command="bash bench/results/blockwise_kernels/run_kernel.sh", carry=[".gpubin10"])
# .gpubin10/ (git-ignored) holds xz-compressed binaries built on the CPU machine (MANIFEST.md):
#   blockwise_test, fp8_linear_test, cast_transpose_bench_new, gpt_pretrain_new  (main + patch)
#   cast_transpose_bench, gpt_pretrain_main                                      (main)
# It runs the patched GPU tests, compute-sanitizer (memcheck, racecheck) over the kernels' tests,
# cast_transpose_bench main/new interleaved twice, the 1b GPT step (blockwise with FP8 and with
# bf16 weights, delayed) with each binary, the 1b blockwise step's device time by category with
# each, and last Nsight Compute of the staged kernel.
# Everything is written straight under $OUT/K, so
# what ran comes back even if the call is cut short.
set -u
B=.gpubin10; cd $B; for f in *.xz; do unxz -f "$f"; done; chmod +x *_test cast_transpose_bench* gpt_pretrain_*; cd ..
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib
export OMP_NUM_THREADS=1
R=$OUT/K; mkdir -p $R; S=/tmp/step; mkdir -p $S  # files straight under $OUT: what is written comes back even if the call is cut
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $R/tests.txt; timeout $t "$@" --gtest_brief=1 >> $R/tests.txt 2>&1; echo "$name exit $?" | tee -a $R/tests.txt; }
run blockwise 120 $B/blockwise_test --gtest_filter='*_CUDA*'
run fp8_linear 120 $B/fp8_linear_test --gtest_filter='*_CUDA*'
grep -E "FAILED|PASSED|Failure" $R/tests.txt | head -20
# compute-sanitizer over the new kernels' tests: out-of-bounds accesses and shared-memory
# races that byte comparisons cannot see.
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$SAN" ]; then
  for tool in memcheck racecheck; do
    timeout 90 $SAN --tool $tool --error-exitcode 9 $B/blockwise_test \
      --gtest_filter='*CudaMatchesCpuByteForByte_CUDA:*CudaDbiasMatchesCpu_CUDA' --gtest_brief=1 > $R/sanitizer_$tool.txt 2>&1
    echo "compute-sanitizer $tool exit $?"; grep -E "ERROR SUMMARY|PASSED|FAILED" $R/sanitizer_$tool.txt | head -4
  done
fi
for round in 1 2; do for v in cast_transpose_bench cast_transpose_bench_new; do
  timeout 90 $B/$v > $R/bench_${v}_$round.jsonl 2> $R/bench_${v}_$round.err; echo "$v round $round exit $?"
  python3 -c "
import json
for l in open('$R/bench_${v}_$round.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if 'quantize_blockwise' in r.get('case','') or r.get('case')=='cast_transpose_amax': print('  ', r['case'], r.get('shape'), round(r.get('ours_ms',0),4), round(r.get('fraction_of_copy',0),3))
"
done; done
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
for round in 1; do for v in main new; do
  timeout 150 python3 bench/gpt_compare_rows.py --case gpt_step_blockwise_staged --binary $B/gpt_pretrain_$v -- --config 1b --micro-batch 8 --steps 40 --log-every 20 \
    --compare bf16-mixed+fp8+blockwise+fp8-params,bf16-mixed+fp8+blockwise+bf16-params,bf16-mixed+fp8+delayed+fp8-params --data $S/stdlib.txt --save-dir $S/${v}_$round --save-last false > $R/step_${v}_$round.jsonl 2> $R/step_${v}_$round.log
  echo "1b $v round $round exit $?"
  python3 -c "
import json
for l in open('$R/step_${v}_$round.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'TFLOP/s', round(r.get('model_tflops',0) or 0), 'loss', r.get('final_loss'))
" 2>/dev/null
done; done
for v in main new; do
  timeout 120 $B/gpt_pretrain_$v --config 1b --micro-batch 8 --steps 14 --log-every 7 --compare bf16-mixed+fp8+blockwise+fp8-params \
    --profile $S/prof_$v --profile-first-step 10 --profile-steps 3 --data $S/stdlib.txt --save-dir $S/prof_run_$v --save-last false > $R/prof_$v.log 2>&1
  echo "profile $v exit $?"; find $S/prof_$v -name step_profile.txt -exec cp {} $R/1b_blockwise_${v}_step_profile.txt \;
  head -14 $R/1b_blockwise_${v}_step_profile.txt
done
# Last, if the call still has time: Nsight Compute of the staged kernel (what limits it now).
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$NCU" ]; then
  timeout 100 $NCU --clock-control none --kernel-name-base mangled -k regex:quantize_1x128_staged -s 5 -c 1 --set full \
    -o /tmp/ncu_staged $B/cast_transpose_bench_new > /tmp/ncu_staged.log 2>&1; echo "ncu exit $?"
  $NCU -i /tmp/ncu_staged.ncu-rep --page details > $R/ncu_staged_details.txt 2>&1
  grep -E "^ +(Duration|Memory Throughput|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Compute \(SM\) Throughput)" $R/ncu_staged_details.txt | head -12
fi
echo done
