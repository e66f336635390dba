#!/usr/bin/env bash
# Issue 16/19 follow-up (2026-12-06, session 35): does the tensorwise cast_transpose keep three
# blocks per SM with the NaN-branch conversion when __launch_bounds__ asks for three, and is it
# then faster than with the clamp? One device call from the repository root:
#   run(command="bash bench/results/cast_transpose_nan_branch_bounds/run.sh", carry=[".gpubin14", ".gpubin15"])
# .gpubin14: main at 2826a3b (plain cast_transpose: kClamp, __launch_bounds__(256, 1): 79 registers);
# .gpubin15: the same with ops.diff (plain cast_transpose: kNanBranch, __launch_bounds__(256, 3):
# 80 registers, 4 bytes spilled, by ptxas -v on the CPU machine). quantize_test of .gpubin15 checks
# the bytes; the two benches run interleaved twice.
set -u
for d in .gpubin14 .gpubin15; do (cd $d; for f in *.xz; do unxz -f "$f"; done; chmod +x * 2>/dev/null); done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64:/usr/local/cuda/lib OMP_NUM_THREADS=1
R=/tmp/B; mkdir -p $R; cp .gpubin15/ops.diff $R/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
for shard in 0 1 2; do
  GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$shard timeout 120 .gpubin15/quantize_test --gtest_filter='*_CUDA*' --gtest_brief=1 > $R/quantize_test_$shard.txt 2>&1 &
done; wait
tail -n 3 $R/quantize_test_*.txt; grep -h "FAILED" $R/quantize_test_*.txt | head
for round in 1 2; do for v in 14 15; do
  timeout 60 .gpubin$v/cast_transpose_bench > $R/bench_${v}_$round.jsonl 2> $R/bench_${v}_$round.err; echo "bench $v round $round exit $? (${SECONDS} s)"
done; done
python3 - $R <<'PY'
import json, sys, collections
R = sys.argv[1]; t = collections.defaultdict(list)
for v in ("14", "15"):
    for rnd in (1, 2):
        for line in open(f"{R}/bench_{v}_{rnd}.jsonl"):
            try: r = json.loads(line)
            except ValueError: continue
            if r.get("case", "").startswith("cast_transpose") and "ours_ms" in r: t[(r["case"], r["shape"], v)].append(r["ours_ms"])
for (case, shape, v), ms in sorted(t.items()):
    if v == "15":
        a = sum(t[(case, shape, "14")]) / 2; b = sum(ms) / 2
        print(f"{case:28s} {shape:22s} main {a:.4f} ms  nan-branch+bounds {b:.4f} ms  speedup {a / b:.3f}")
PY
tar czf $OUT/cast_transpose_nan_branch_bounds.tar.gz -C /tmp B
