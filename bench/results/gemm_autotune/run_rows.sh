#!/usr/bin/env bash
# Second call of the measured FP8 GEMM algorithms (session 42), from the repository root:
#   run(command="bash bench/results/gemm_autotune/run_rows.sh", carry=[".gpubin25"])
# .gpubin25 = main at its COMMIT (git-ignored, built on the CPU machine): `fp8_gemm_bench algo`
# (the first call's aborted after one row: it asked the block-scaled GEMMs for fast
# accumulation), gpt_pretrain_test's _CUDA cases (the default now times candidates), issue 22's
# Llama steps (llama3_8b_4layer and llama32_1b, bf16-mixed against FP8, the measured algorithms
# now the default), and issue 16's layer_norm_bench, on whatever card comes.
# Writes $OUT/gemm_autotune_rows/.
set -u
B=${BIN:-.gpubin25}; R=$OUT/gemm_autotune_rows; mkdir -p $R /tmp/g24
for f in $B/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/g24/$n; chmod +x /tmp/g24/$n; done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib OMP_NUM_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'
  echo "$B $(cat $B/COMMIT)"; } | tee $R/device.txt
for t in gpt_pretrain_test fp8_gemm_test cuda_graph_test; do
  [ -x /tmp/g24/$t ] || continue
  timeout 180 /tmp/g24/$t --gtest_filter='*_CUDA*' --gtest_brief=1 > $R/tests_$t.txt 2>&1
  echo "$t _CUDA exit $? (${SECONDS} s)"; grep -E "FAILED|Failure|PASSED|SKIPPED" $R/tests_$t.txt | head -8
done
(cd /tmp/g24 && timeout 120 ./fp8_gemm_bench algo > $R/fp8_gemm_bench_algo.jsonl 2> $R/fp8_gemm_bench_algo.err)
echo "fp8_gemm_bench algo exit $? (${SECONDS} s)"
python3 -c "
import json
for l in open('$R/fp8_gemm_bench_algo.jsonl'):
    r=json.loads(l); print('   ', r['gemm'], r['recipe'], 'heuristic', round(r['baseline_ms'],3), 'measured', round(r['ours_ms'],3), 'x', round(r['speedup'],3))"
S=/tmp/step; mkdir -p $S
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
llama() {
  local config=$1
  timeout 200 python3 bench/gpt_compare_rows.py --case llama_step --binary /tmp/g24/gpt_pretrain -- --config $config \
    --steps 30 --log-every 10 --compare bf16-mixed,bf16-mixed+fp8 --data $S/stdlib.txt --save-last false \
    --save-dir $S/$config > $R/llama_step_$config.jsonl 2> $R/llama_step_$config.log
  echo "$config exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/llama_step_$config.jsonl'):
    r=json.loads(l); print('   ', r['precision'], round(r['tokens_per_s']), 'TFLOP/s', round(r.get('model_tflops') or 0), 'x bf16', round(r.get('tokens_per_s_vs_bf16') or 0, 4))"
}
llama llama3_8b_4layer
if grep -q H200 $R/device.txt; then  # the H100's figure is measured four times already
  timeout 150 /tmp/g24/layer_norm_bench > $R/layer_norm_bench.jsonl 2> $R/layer_norm_bench.err
  echo "layer_norm_bench exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/layer_norm_bench.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if r.get('case','').startswith('layer_norm_bwd'): print('  ', r['case'], r.get('shape'), r.get('ours_ms'), 'of copy', r.get('fraction_of_copy'))"
fi
# Issue 19: where blockwise's quantize time goes (its quantize_cast was 31.9 ms a step against
# delayed's 18.4 in the last profiles): the 1b blockwise and delayed fp8_params steps profiled,
# every kernel of the trace summed by name (the txt lists only the 20 longest).
timeout 200 /tmp/g24/gpt_pretrain --config 1b --micro-batch 8 --steps 12 --log-every 4 --data $S/stdlib.txt \
  --save-last false --save-dir $S/prof --profile $S/prof/profile --profile-first-step 8 --profile-steps 3 \
  --compare bf16-mixed+fp8+blockwise+fp8-params,bf16-mixed+fp8+delayed+fp8-params > $R/profile_1b.log 2>&1
echo "1b profile exit $? (${SECONDS} s)"
for d in $S/prof/profile/*/; do
  n=$(basename $d); cp $d/step_profile.txt $R/profile_1b_$n.txt
  python3 - $d/trace.json > $R/profile_1b_${n}_kernels.txt <<'PY'
import json, sys, collections
events = json.load(open(sys.argv[1]))
events = events.get("traceEvents", events) if isinstance(events, dict) else events
total = collections.Counter(); count = collections.Counter()
for e in events:
    if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
        total[e["name"]] += e.get("dur", 0); count[e["name"]] += 1
steps = 3
for name, us in total.most_common(80):
    print(f"{us / steps / 1000:8.3f} ms  {count[name] // steps:5d}x  {name[:200]}")
PY
  head -4 $R/profile_1b_${n}_kernels.txt
done
llama llama32_1b
echo "done (${SECONDS} s)"
