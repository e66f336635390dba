#!/usr/bin/env bash
# The open step targets after the residual change (session 43), on whichever card comes, from
# the repository root:
#   run(command="bash bench/results/steps_by_device/run.sh", carry=[".gpubin28o"], kind="nvidia-h200")
# .gpubin28o = gpt_pretrain of main at 4dcba92 (the residual connections inside the GEMMs) and
# layer_norm_bench of 528bdb8 (the LayerNorm kernels are unchanged since), built on the CPU machine.
# On an H200 (the issues' GPU): issue 16's 1b step (bf16-mixed and FP8 delayed with fp8_params,
# targets 560 and 800 model TFLOP/s) and LayerNorm backward (0.75 of the copy rate), issue 22's
# Llama 8B proxy (FP8 against bf16-mixed, target 1.4x). On an H100: issue 19's 1b blockwise
# against delayed (fp8_params, two rounds); with H100_BRANCH=350m issue 16's 350m target (FP8
# >= 1.15x bf16-mixed), eager and with --cuda-graph. BIN names another binary folder (session
# 44: BIN=.gpubin31, main with the residual gradients summed by the LayerNorm backward).
# Issue 22's proxy runs profiled on either card (step_profiles.tgz). Writes $OUT/steps_by_device.tgz.
set -u
B=${BIN:-.gpubin28o}; R=$OUT/steps_by_device; mkdir -p $R /tmp/b
for f in $B/*.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/b/$n; chmod +x /tmp/b/$n; done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib OMP_NUM_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'
  echo "$B $(cat $B/COMMIT)"; } | tee $R/device.txt
S=/tmp/step; mkdir -p $S
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
step() {  # name case -- gpt_pretrain args
  local name=$1 case=$2; shift 3
  timeout 200 python3 bench/gpt_compare_rows.py --case $case --binary /tmp/b/gpt_pretrain -- "$@" --data $S/stdlib.txt \
    --save-last false --save-dir $S/run_$name > $R/$name.jsonl 2> /tmp/$name.log
  echo "$name exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/$name.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'TFLOP/s', round(r.get('model_tflops') or 0), 'x bf16', round(r.get('tokens_per_s_vs_bf16') or 0, 4))
" 2>/dev/null
}
if grep -q H200 $R/device.txt; then
  step 1b gpt_step -- --config 1b --micro-batch 8 --steps 40 --log-every 20 --compare bf16-mixed,bf16-mixed+fp8+fp8-params
  step llama3_8b_4layer llama_step -- --config llama3_8b_4layer --steps 30 --log-every 10 --fp8-min-gemm-size 0 --compare bf16-mixed,bf16-mixed+fp8 --profile $S/profile_llama3_8b_4layer
  (cd /tmp/b && timeout 150 ./layer_norm_bench > $R/layer_norm_bench.jsonl 2> /tmp/layer_norm_bench.err)
  echo "layer_norm_bench exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/layer_norm_bench.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if 'bwd' in r.get('case',''): print('  ', r['case'], r.get('shape'), r.get('ours_ms'), 'of copy', r.get('fraction_of_copy'))"
elif [ "${H100_BRANCH:-blockwise}" = 350m ]; then
  step 350m_eager gpt_step -- --config 350m --steps 80 --log-every 40 --fp8-min-gemm-size 0 --compare bf16-mixed,bf16-mixed+fp8
  step 350m_graph gpt_step -- --config 350m --steps 80 --log-every 40 --fp8-min-gemm-size 0 --cuda-graph true --compare bf16-mixed,bf16-mixed+fp8
else
  # Issue 19's ratio (blockwise against delayed, fp8_params, 1b), two rounds.
  for round in 1 2; do
    step 1b_recipes_round$round gpt_step -- --config 1b --micro-batch 8 --steps 40 --log-every 20 --compare bf16-mixed+fp8+delayed+fp8-params,bf16-mixed+fp8+blockwise+fp8-params
  done
  # Issue 22's proxy profiled (device time by category, steps 10-12), for where its FP8 step goes.
  step llama3_8b_4layer llama_step -- --config llama3_8b_4layer --steps 30 --log-every 10 --fp8-min-gemm-size 0 --compare bf16-mixed,bf16-mixed+fp8 --profile $S/profile_llama3_8b_4layer
fi
# The step profiles' tables (step_profile.txt / .json per run), and from each trace every
# kernel's device time per step (the 3 profiled steps), by name: kernels.txt beside them.
for t in $(find $S -path '*/profile_*' -name 'trace.json'); do
  python3 - "$t" > $(dirname $t)/kernels.txt <<'PY'
import collections, json, sys
events = json.load(open(sys.argv[1])).get("traceEvents", [])
ms = collections.Counter(); n = collections.Counter()
for e in events:
    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
        ms[e["name"]] += e["dur"] / 1000 / 3; n[e["name"]] += 1
print(f"{sum(ms.values()):9.2f} ms per step in {sum(n.values()) // 3} kernels and copies")
for name, t in ms.most_common(80):
    print(f"{t:9.3f} {n[name] // 3:5d}x  {name[:150]}")
PY
done
(cd $S && find . -path './profile_*' \( -name 'step_profile.*' -o -name 'kernels.txt' \) -print0 | tar czf $R/step_profiles.tgz --null -T -)
(cd $OUT && tar czf steps_by_device.tgz steps_by_device && rm -rf steps_by_device)
echo "done (${SECONDS} s)"
