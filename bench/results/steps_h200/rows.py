"""The Llama proxy's rows with model TFLOP/s and step time, which gpt_compare_rows.py did not
compute for Llama configs before this session (its config table held the GPT ones only): the
same formula, 6·N + 12·layers·hidden·seq FLOPs per token, N from the runs' compare.jsonl
(874,549,248 parameters with the byte-level vocabulary). Writes rows.jsonl (all rows of the
directory, the 1b ones as they came) from the repository root:
    python3 bench/results/steps_h200/rows.py
"""
import json
import pathlib

HERE = pathlib.Path(__file__).parent
PARAMETERS = {json.loads(l)["parameters"] for f in HERE.glob("llama_compare_round*.jsonl")
              for l in f.read_text().splitlines() if l}
assert len(PARAMETERS) == 1, PARAMETERS
N = PARAMETERS.pop()
LAYERS, HIDDEN, SEQ = 4, 4096, 8192
FLOPS_PER_TOKEN = 6 * N + 12 * LAYERS * HIDDEN * SEQ

rows = [json.loads(l) for l in (HERE / "1b.jsonl").read_text().splitlines() if l]
for f in sorted(HERE.glob("llama3_8b_4layer_round*.jsonl")):
    for line in f.read_text().splitlines():
        if not line:
            continue
        row = json.loads(line)
        row["model_tflops"] = row["tokens_per_s"] * FLOPS_PER_TOKEN / 1e12
        row["step_ms"] = 1000 * SEQ / row["tokens_per_s"]
        row["round"] = int(f.stem.rsplit("round", 1)[1])
        rows.append(row)
with open(HERE / "rows.jsonl", "w") as out:
    for row in rows:
        out.write(json.dumps(row) + "\n")
for row in rows:
    print(row["config"], row.get("round", ""), row["precision"], round(row["tokens_per_s"]),
          round(row["model_tflops"], 1), round(row.get("tokens_per_s_vs_bf16") or 0, 4))
