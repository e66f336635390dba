"""Collects the stage folders' runs into rows.jsonl: one row per run with `commit`, `round`,
`stage` and, for the new binary, `speedup` (tokens/s over the old binary's in the same round and
precision). Run from this folder: python3 rows.py"""
import glob, json, os, re

rows = []
for stage_dir in sorted(glob.glob("stage*")):
    device = open(os.path.join(stage_dir, "device.txt")).read()
    commits = dict(re.findall(r"(new|old) \.gpubin\d+ (\w+)", device))
    runs = {}
    for path in sorted(glob.glob(os.path.join(stage_dir, "*_round*.jsonl"))):
        m = re.match(r"(.*)_(new|old)_round(\d+)\.jsonl", os.path.basename(path))
        for line in open(path):
            r = json.loads(line)
            r.update(commit=commits[m.group(2)], round=int(m.group(3)), stage=stage_dir)
            runs[(m.group(1), m.group(2), int(m.group(3)), r["precision"])] = r
    for (case, tag, rnd, precision), r in sorted(runs.items()):
        old = runs.get((case, "old", rnd, precision))
        if tag == "new" and old:
            r["speedup"] = r["tokens_per_s"] / old["tokens_per_s"]
        rows.append(r)
with open("rows.jsonl", "w") as out:
    for r in rows:
        out.write(json.dumps(r) + "\n")
for r in rows:
    print(r["stage"], r["case"], r["commit"], "round", r["round"], r["precision"],
          round(r.get("tokens_per_s")), "tokens/s", round(r.get("model_tflops") or 0), "TFLOP/s",
          "speedup %.4f" % r["speedup"] if "speedup" in r else "")
