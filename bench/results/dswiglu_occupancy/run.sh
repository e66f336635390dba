#!/usr/bin/env bash
# The dSwiGLU cast-transpose's occupancy (issue 22: 2.31 ms of the 8B proxy's FP8 step on the
# H200, ~0.52 of the copy rate there; 0.725 on the H100). The landed kernel loads its 128 × 64
# tile's three inputs at once (12 16-byte loads per thread, 128 registers, two blocks per SM).
# Variants (.gpubin40/<variant>: cast_transpose_bench and quantize_test of main with
# <variant>/dswiglu.patch, xz-compressed): the passes in groups of G loaded then cast, and
# __launch_bounds__(256, M):
#   base  main (G 4, M 2)     g2m2  G 2, M 2 (105 registers)
#   g2m3  G 2, M 3 (80, 16 B spilled)     g1m4  G 1, M 4 (63, none spilled)
# From the repository root on the GPU machine (BIN=.gpubin40 by default):
#   run(command="bash bench/results/dswiglu_occupancy/run.sh", carry=[".gpubin40"], kind="nvidia-h200")
# Writes $OUT/dswiglu.tgz: each variant's quantize_test `_CUDA` cases and cast_transpose_bench
# rounds, interleaved, and a summary line per dSwiGLU / copy row.
set -u
B=${BIN:-.gpubin40}
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:/usr/local/cuda/lib64 OMP_NUM_THREADS=1
R=$OUT/dswiglu; mkdir -p $R
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
VARIANTS="base g2m2 g2m3 g1m4"
for v in $VARIANTS; do
  mkdir -p /tmp/d_$v
  for b in cast_transpose_bench quantize_test; do xz -dc $B/$v/$b.xz > /tmp/d_$v/$b; chmod +x /tmp/d_$v/$b; done
  (cd /tmp/d_$v && timeout 150 ./quantize_test --gtest_filter='*CastTransposeDswiglu*_CUDA*' > $R/test_$v.txt 2>&1
   echo "test $v rc $? $(grep -E '^\[  (PASSED|FAILED) ' $R/test_$v.txt | tr '\n' ' ')")
done
for round in 1 2 3; do
  for v in $VARIANTS; do
    ((SECONDS - start > ${BUDGET:-200})) && break 2
    (cd /tmp/d_$v && timeout 60 ./cast_transpose_bench > $R/bench_${v}_$round.jsonl 2>/dev/null)
    python3 - "$R/bench_${v}_$round.jsonl" $round $v <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r["case"] in ("cast_transpose_dswiglu", "device_copy"):
        print(sys.argv[2], sys.argv[3], r["case"], r["shape"], r.get("ours_ms"), r.get("fraction_of_copy"), r.get("gbps"))
PY
  done
done
echo "elapsed $((SECONDS - start)) s"
(cd $OUT && tar czf dswiglu.tgz dswiglu && rm -rf dswiglu)
