#!/usr/bin/env bash
# GPU check of the float32 micro-batch sums in one multi-tensor launch (f462f3b, session 40),
# one device call from the repository root:
#   run(command="bash bench/results/micro_batch_sum/run_one_kernel.sh", carry=[".gpubin22", ".gpubin21"])
# (ROUNDS=1: one round of the step runs instead of two)
# .gpubin22/ (git-ignored): main at the commit in its COMMIT file (gpt_pretrain,
# fused_optimizer_test, mixed_precision_plugin_test, cuda_graph_test), built on the CPU machine;
# .gpubin21/: 44cb8a3 (the sums through ATen's per-tensor add, zeroed every step).
# 1. the _CUDA tests of the three test binaries (AccumulateInFloat32MatchesTheCpuReference_CUDA
#    is new; the CUDA graph tests capture takes under static gradients);
# 2. the 350m bf16-mixed step with --grad-accum 4, as run.sh: f462f3b, f462f3b with
#    --grad-reduce-in-fp32 false and 44cb8a3, interleaved twice.
# Everything goes into one tarball under $OUT.
set -u
M=.gpubin22; B=.gpubin21
for d in $M $B; do (cd $d; for f in *.xz; do unxz -f "$f"; done; chmod +x *); done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib
export OMP_NUM_THREADS=1
R=/tmp/K; mkdir -p $R; S=/tmp/step; mkdir -p $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c 'import torch; print(torch.__version__)' | tee -a $R/device.txt
cat $M/COMMIT >> $R/device.txt
pack() { tar czf $OUT/micro_batch_sum_one_kernel.tar.gz -C /tmp K; }
for t in fused_optimizer_test mixed_precision_plugin_test cuda_graph_test; do
  timeout 150 $M/$t --gtest_filter='*_CUDA*' --gtest_brief=1 > $R/tests_$t.txt 2>&1
  echo "$t _CUDA exit $?"; grep -E "FAILED|Failure|PASSED|SKIPPED" $R/tests_$t.txt | head -8
done
pack
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
common="--config 350m --micro-batch 8 --grad-accum 4 --steps 30 --log-every 10 --data $S/stdlib.txt --save-last false --compare bf16-mixed"
for round in $(seq 1 ${ROUNDS:-2}); do
  for v in "one_kernel_fp32_sums|$M|" "one_kernel_bf16_sums|$M|--grad-reduce-in-fp32 false" "44cb8a3_fp32_sums|$B|"; do
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
