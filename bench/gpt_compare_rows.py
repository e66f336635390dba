#!/usr/bin/env python3
"""Runs `gpt_pretrain ... --compare A,B,...` once and prints one JSON row per run, as bench/results
keeps them (the issue's fields: `precision` is the run's name in the --compare list): the run's
final loss and tokens/s from compare.jsonl, their ratios against the
bf16-mixed run of the same call, and the command, device, torch version and date.

  python3 bench/gpt_compare_rows.py --case gpt_fidelity --binary build/gpt_pretrain -- \
      --config 350m --steps 2000 --data stdlib.txt --save-dir /tmp/fid --save-last false \
      --fp8-min-gemm-size 0 --compare bf16-mixed,bf16-mixed+fp8,bf16-mixed+fp8+tensorwise

Model FLOPs per token are 6 N + 12 L H S (the parameter count from the run, causal attention
counted in full), so model TFLOP/s = tokens/s x that / 1e12.
"""

import argparse
import datetime
import json
import pathlib
import shlex
import subprocess
import sys

CONFIGS = {  # layers, hidden, sequence length, micro-batch: the named configs' recipes
    # recipes/gpt/gpt_model.cc (8 sequences per micro-batch, recipes/gpt/pretrain.cc)
    "125m": (12, 768, 1024, 8), "128m": (18, 768, 1024, 8), "350m": (24, 1024, 1024, 8),
    "1b": (18, 2048, 2048, 8),
    # recipes/llama/llama_model.cc (one 8192-token sequence per micro-batch)
    "llama32_1b": (16, 2048, 8192, 1), "llama32_3b": (28, 3072, 8192, 1), "llama3_8b": (32, 4096, 8192, 1),
    "llama3_8b_4layer": (4, 4096, 8192, 1),
}


def flag(args, name, default=None):
    return args[args.index(name) + 1] if name in args else default


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--binary", required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    args = [a for a in options.rest if a != "--"]
    save_dir = pathlib.Path(flag(args, "--save-dir"))
    command = [options.binary] + args
    print(f"gpt_compare_rows: {shlex.join(command)}", file=sys.stderr, flush=True)
    log = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stderr.write(log.stdout)
    if log.returncode != 0:
        sys.exit(f"gpt_compare_rows: gpt_pretrain exited {log.returncode}")
    runs = [json.loads(line) for line in (save_dir / "compare.jsonl").read_text().splitlines() if line]

    import torch  # the GPU machine's Python has it; only for the device name and version
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    config = flag(args, "--config", "tiny")
    baseline = next((r for r in runs if r["run"] == "bf16-mixed"), None)
    for r in runs:
        row = {
            "case": options.case, "config": config, "precision": r["run"],
            "recipe": r.get("fp8_recipe", "none"), "fp8": r.get("fp8", "none"),
            "fp8_params": r.get("fp8_params", False), "steps": r.get("steps"),
            "final_loss": r.get("final_loss"), "tokens_per_s": r.get("steady_tokens_per_s"),
            "peak_mem_bytes": r.get("peak_memory_bytes"),
            "resident_mem_bytes": r.get("resident_memory_bytes"),
            "recompute": flag(args, "--recompute-method", "none"),
            "exp_avg_dtype": flag(args, "--exp-avg-dtype", "fp32"),
            "exp_avg_sq_dtype": flag(args, "--exp-avg-sq-dtype", "fp32"),
            "cuda_graph": flag(args, "--cuda-graph", "false").lower() in ("true", "1", "on", "yes"),
        }
        if config in CONFIGS and r.get("parameters"):
            layers, hidden, seq, micro_batch = CONFIGS[config]
            seq = int(flag(args, "--seq", seq))
            flops_per_token = 6 * r["parameters"] + 12 * layers * hidden * seq
            row["model_tflops"] = r["steady_tokens_per_s"] * flops_per_token / 1e12
            tokens_per_step = int(flag(args, "--micro-batch", micro_batch)) * seq * int(flag(args, "--grad-accum", 1))
            row["step_ms"] = 1000 * tokens_per_step / r["steady_tokens_per_s"]
        if baseline and "final_loss" in r:
            row["rel_diff_vs_bf16"] = (r["final_loss"] - baseline["final_loss"]) / baseline["final_loss"]
            row["tokens_per_s_vs_bf16"] = r["steady_tokens_per_s"] / baseline["steady_tokens_per_s"]
        row.update({"command": shlex.join(command), "device": device, "torch": torch.__version__,
                    "date": datetime.date.today().isoformat()})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
