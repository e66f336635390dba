#!/usr/bin/env bash
# GPU check of the FP8 GEMMs' measured algorithm choice (Fp8GemmAlgoSelection::kFastestMeasured,
# gpt_pretrain --fp8-gemm-autotune; session 41) and of the float32 micro-batch sums in one
# multi-tensor launch (session 40), in one device call from the repository root:
#   run(command="bash bench/results/gemm_autotune/run.sh", carry=[".gpubin23", ".gpubin22", ".gpubin21"])
# Built on the CPU machine, git-ignored (COMMIT in each folder):
#   .gpubin23: main (gpt_pretrain, fp8_gemm_test, fp8_gemm_bench, cuda_graph_test);
#   .gpubin22: aad33e9 (fused_optimizer_test, mixed_precision_plugin_test: the one-launch sums);
#   .gpubin21: 44cb8a3 (gpt_pretrain: the float32 sums through ATen's per-tensor add).
# Stages, most needed first (a call cut short keeps what ended), each packed into
# $OUT/gemm_autotune.tar.gz as it ends:
#   1. the _CUDA tests of fp8_gemm_test and cuda_graph_test (.gpubin23);
#   2. `fp8_gemm_bench algo`: measured against heuristic at the 1b step's GEMMs;
#   3. 1b steps (blockwise fp8_params, delayed fp8_params), autotune off / on;
#   4. the 8B proxy (llama3_8b_4layer) FP8, off / on;
#   5. the _CUDA tests of fused_optimizer_test and mixed_precision_plugin_test (.gpubin22);
#   6. the 1b steps again (a second round);
#   7. 350m bf16-mixed --grad-accum 4: .gpubin23 against .gpubin21 (one launch vs ATen's adds).
set -u
M=.gpubin23; S22=.gpubin22; B=.gpubin21
for d in $M $S22 $B; do (cd $d; for f in *.xz; do unxz -f "$f"; done; chmod +x *); done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib
export OMP_NUM_THREADS=1
R=/tmp/G; mkdir -p $R; S=/tmp/step; mkdir -p $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c 'import torch; print(torch.__version__)' | tee -a $R/device.txt
for d in $M $S22 $B; do echo "$d $(cat $d/COMMIT)" >> $R/device.txt; done
pack() { tar czf $OUT/gemm_autotune.tar.gz -C /tmp G; }
tests() {
  for t in "$@"; do
    n=$(basename $t)
    timeout 120 $t --gtest_filter='*_CUDA*' --gtest_brief=1 > $R/tests_$n.txt 2>&1
    echo "$n _CUDA exit $? (${SECONDS} s)"; grep -E "FAILED|Failure|PASSED|SKIPPED" $R/tests_$n.txt | head -8
  done
  pack
}
tests $M/fp8_gemm_test $M/cuda_graph_test
timeout 120 $M/fp8_gemm_bench algo > $R/fp8_gemm_bench_algo.jsonl 2> $R/fp8_gemm_bench_algo.err
echo "fp8_gemm_bench algo exit $? (${SECONDS} s)"
python3 -c "
import json
for l in open('$R/fp8_gemm_bench_algo.jsonl'):
    r=json.loads(l); print('   ', r['gemm'], r['recipe'], 'heuristic', round(r['baseline_ms'],3), 'measured', round(r['ours_ms'],3), 'x', round(r['speedup'],3))
" 2>/dev/null
pack
step() {  # tag binary case -- gpt_pretrain args
  local tag=$1 bin=$2 case=$3; shift 4
  timeout 150 python3 bench/gpt_compare_rows.py --case $case --binary $bin -- "$@" --save-dir $S/run_$tag \
    > $R/step_$tag.jsonl 2> $R/step_$tag.log
  echo "$tag exit $? (${SECONDS} s)"
  python3 -c "
import json
for l in open('$R/step_$tag.jsonl'):
    r=json.loads(l); print('   ', r.get('precision'), round(r.get('tokens_per_s',0)), 'step_ms', round(r.get('step_ms',0),2), 'loss', r.get('final_loss'), 'peak', r.get('peak_mem_bytes'))
" 2>/dev/null
  pack
}
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort | xargs cat > $S/stdlib.txt
one_b="--config 1b --micro-batch 8 --steps 40 --log-every 20 --data $S/stdlib.txt --save-last false"
one_b_round() {
  for tune in false true; do
    step 1b_autotune_${tune}_$1 $M/gpt_pretrain gpt_step_gemm_autotune_$tune -- $one_b --fp8-gemm-autotune $tune \
      --compare bf16-mixed+fp8+blockwise+fp8-params,bf16-mixed+fp8+delayed+fp8-params
  done
}
one_b_round 1
proxy="--config llama3_8b_4layer --steps 30 --log-every 10 --fp8-min-gemm-size 0 --data $S/stdlib.txt --save-last false"
for tune in false true; do
  step proxy_autotune_$tune $M/gpt_pretrain llama_step_gemm_autotune_$tune -- $proxy --fp8-gemm-autotune $tune \
    --compare bf16-mixed+fp8
done
tests $S22/fused_optimizer_test $S22/mixed_precision_plugin_test
one_b_round 2
accum="--config 350m --micro-batch 8 --grad-accum 4 --steps 30 --log-every 10 --data $S/stdlib.txt --save-last false --compare bf16-mixed"
step accum_one_kernel $M/gpt_pretrain gpt_step_grad_accum_one_kernel_fp32_sums -- $accum
step accum_44cb8a3 $B/gpt_pretrain gpt_step_grad_accum_44cb8a3_fp32_sums -- $accum
echo "done (${SECONDS} s)"
