#!/usr/bin/env bash
# GPU check of the one-rank float32 micro-batch sums (c7fbdcc, session 39; prepared session 40),
# one device call from the repository root:
#   run(command="bash bench/results/micro_batch_sum/run.sh", carry=[".gpubin21", ".gpubin20"])
# .gpubin21/ (git-ignored): main at the commit in its COMMIT file (gpt_pretrain,
# mixed_precision_plugin_test, layer_norm_bench), built on the CPU machine; .gpubin20/: d16f049,
# before the float32 sums (a one-GPU run summed --grad-accum micro-batches in bf16).
# 1. every _CUDA test of mixed_precision_plugin_test (MicroBatchSumTest's fused SGD step reading
#    the float32 sums has never run on a GPU);
# 2. layer_norm_bench twice (issue 16's LayerNorm backward on whatever card this is);
# 3. the 350m bf16-mixed step with --grad-accum 4: main (float32 sums), main with
#    --grad-reduce-in-fp32 false (bf16 sums, the same binary) and d16f049, interleaved twice.
# Everything goes into one tarball under $OUT.
set -u
M=.gpubin21; B=.gpubin20
for d in $M $B; do (cd $d; for f in *.xz; do unxz -f "$f"; done; chmod +x *); done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib
export OMP_NUM_THREADS=1
R=/tmp/W; mkdir -p $R; S=/tmp/step; mkdir -p $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c 'import torch; print(torch.__version__)' | tee -a $R/device.txt
cat $M/COMMIT >> $R/device.txt
pack() { tar czf $OUT/micro_batch_sum.tar.gz -C /tmp W; }
timeout 200 $M/mixed_precision_plugin_test --gtest_filter='*_CUDA*' --gtest_brief=1 > $R/tests.txt 2>&1
echo "mixed_precision_plugin_test _CUDA exit $?"; grep -E "FAILED|Failure|PASSED|SKIPPED" $R/tests.txt | head -20
pack
for round in 1 2; do
  timeout 150 $M/layer_norm_bench > $R/layer_norm_bench_$round.jsonl 2> $R/layer_norm_bench_$round.err
  echo "layer_norm_bench round $round exit $?"
  python3 -c "
import json
for l in open('$R/layer_norm_bench_$round.jsonl'):
    try: r=json.loads(l)
    except Exception: continue
    if r.get('case','').startswith('layer_norm_bwd'): print('  ', r['case'], r.get('shape'), r.get('ours_ms'), 'of copy', r.get('fraction_of_copy'))
"
  pack
done
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
common="--config 350m --micro-batch 8 --grad-accum 4 --steps 30 --log-every 10 --data $S/stdlib.txt --save-last false --compare bf16-mixed"
for round in 1 2; do
  for v in "main_fp32_sums|$M|" "main_bf16_sums|$M|--grad-reduce-in-fp32 false" "d16f049|$B|"; do
    IFS='|' read -r tag dir extra <<< "$v"
    # shellcheck disable=SC2086  # extra is words
    timeout 150 python3 bench/gpt_compare_rows.py --case gpt_step_grad_accum_${tag} --binary $dir/gpt_pretrain -- $common $extra \
      --save-dir $S/run_${tag}_$round > $R/step_${tag}_$round.jsonl 2> $R/step_${tag}_$round.log
    echo "350m $tag round $round exit $? (${SECONDS} s)"
    python3 -c "
import json
for l in open('$R/step_${tag}_$round.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'step_ms', round(r.get('step_ms',0),2), 'loss', r.get('final_loss'), 'peak', r.get('peak_mem_bytes'))
" 2>/dev/null
    pack
  done
done
echo "done (${SECONDS} s)"
