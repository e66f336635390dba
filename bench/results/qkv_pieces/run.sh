#!/usr/bin/env bash
# The blockwise QKV gradient in pieces and the interleaved timing rounds (session 43), from the
# repository root:
#   run(command="bash bench/results/qkv_pieces/run.sh", carry=[".gpubin27", ".gpubin26"])
# .gpubin27 = main with the change (git-ignored, built on the CPU machine): the new `_CUDA`
# tests (quantize_blockwise_columns against the CPU reference, forward_split's gradients against
# the concatenated ones, the measured GEMM choice's), `fp8_gemm_bench algo` (does the measured
# choice still keep a slower float32 wgrad with two interleaved timing rounds?), and the 1b
# fp8_params step, blockwise and delayed, against .gpubin26 (main at 0098ec7) in alternating
# rounds: with --fp8-gemm-autotune false (only the QKV pieces differ: blockwise's backward
# without autograd's concatenation of dq, dk, dv) and true (the timing rounds too); then a
# profile of the new blockwise step. Writes $OUT/qkv_pieces.tgz.
set -u
NEW=${NEW:-.gpubin27}; OLD=${OLD:-.gpubin26}; R=$OUT/qkv_pieces; mkdir -p $R /tmp/new /tmp/old
for f in $NEW/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/new/$n; chmod +x /tmp/new/$n; done
xz -dc $OLD/gpt_pretrain.xz > /tmp/old/gpt_pretrain; chmod +x /tmp/old/gpt_pretrain
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib OMP_NUM_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'
  echo "new $NEW $(cat $NEW/COMMIT), old $OLD $(cat $OLD/COMMIT)"; } | tee $R/device.txt
for t in blockwise_test fp8_linear_test fp8_layer_norm_test fp8_gemm_test cuda_graph_test llama_model_test gpt_model_test; do
  [ -x /tmp/new/$t ] || continue
  timeout 150 /tmp/new/$t --gtest_filter='*_CUDA*' --gtest_brief=1 > /tmp/tests_$t.txt 2>&1
  echo "$t _CUDA exit $? (${SECONDS} s)"; grep -E "FAILED|Failure|PASSED|SKIPPED|tests ran" /tmp/tests_$t.txt | head -8
  grep -E "FAILED|Failure|PASSED|SKIPPED|tests ran|error" -A3 /tmp/tests_$t.txt | head -40 >> $R/tests_CUDA.txt
done
(cd /tmp/new && timeout 120 ./fp8_gemm_bench algo > $R/fp8_gemm_bench_algo.jsonl 2> $R/fp8_gemm_bench_algo.err)
echo "fp8_gemm_bench algo exit $? (${SECONDS} s)"
python3 -c "
import json
for l in open('$R/fp8_gemm_bench_algo.jsonl'):
    r=json.loads(l); print('   ', r['gemm'], r['recipe'], 'heuristic', round(r['baseline_ms'],3), 'measured', round(r['ours_ms'],3), 'x', round(r['speedup'],3))"
S=/tmp/step; mkdir -p $S
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
one_b="--config 1b --micro-batch 8 --steps 40 --log-every 20 --data $S/stdlib.txt --save-last false"
step() {  # tag binary autotune
  local tag=$1 bin=$2 tune=$3
  timeout 150 python3 bench/gpt_compare_rows.py --case gpt_step_qkv_pieces_$tag --binary $bin -- $one_b \
    --fp8-gemm-autotune $tune --compare bf16-mixed+fp8+blockwise+fp8-params,bf16-mixed+fp8+delayed+fp8-params \
    --save-dir $S/run_${tag}_${tune}_$4 > $R/step_${tag}_autotune_${tune}_round$4.jsonl 2> /tmp/step_${tag}_${tune}_$4.log
  echo "$tag autotune $tune round $4 exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/step_${tag}_autotune_${tune}_round$4.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'step_ms', round(r.get('step_ms',0),2), 'loss', r.get('final_loss'))
" 2>/dev/null
}
for round in 1 2; do
  for tune in false true; do
    step new /tmp/new/gpt_pretrain $tune $round
    step old /tmp/old/gpt_pretrain $tune $round
  done
done
# Where the new blockwise step's time goes (CatArrayBatchedCopy was 2.45 ms a step before).
timeout 150 /tmp/new/gpt_pretrain --config 1b --micro-batch 8 --steps 12 --log-every 4 --data $S/stdlib.txt \
  --save-last false --save-dir $S/prof --profile $S/prof/profile --profile-first-step 8 --profile-steps 3 \
  --compare bf16-mixed+fp8+blockwise+fp8-params > /tmp/profile_1b.log 2>&1
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
  head -6 $R/profile_1b_${n}_kernels.txt; grep -i "cat" $R/profile_1b_${n}_kernels.txt | head -3
done
# One file back: a call returns at most 8.
(cd $OUT && tar czf qkv_pieces.tgz qkv_pieces && rm -rf qkv_pieces)
echo "done (${SECONDS} s)"
