"""One bench/results/dp_scaling.jsonl row from two gpt_pretrain logs of the same global batch: one
GPU with --grad-accum N against N GPUs under torchrun (tools/gpu_check.sh, AMP8_DP_ROWS).

  python3 bench/dp_scaling_rows.py --config 1b --precision bf16-mixed --gpus 2 \
      --one-gpu one_gpu.log --data-parallel two_gpus.log --command "..."

scaling_efficiency = data-parallel tokens/s / (gpus x one-GPU tokens/s), both the steady state
gpt_pretrain prints (the median step of the second half); the waits are the data-parallel run's
(median of the second half): the reduce-scatter left after the backward pass and the parameter
all-gather after the step.
"""
import argparse
import datetime
import json
import re
import sys

STEADY = re.compile(r"^gpt_pretrain: final loss ([0-9.eE+-]+|nan), [0-9.eE+-]+ tokens/s \(steady state ([0-9.eE+-]+)\)"
                    r"(?:, peak memory ([0-9.eE+-]+) GB)?", re.M)
WAITS = re.compile(r"waited ([0-9.eE+-]+) ms for the reduce-scatter .* ([0-9.eE+-]+) ms for the all-gather", re.M)


def read(path, want_waits):
    text = open(path).read()
    steady = STEADY.search(text)
    if not steady:
        sys.exit(f"dp_scaling_rows: {path} has no 'final loss ... (steady state N)' line")
    result = {"final_loss": float(steady.group(1)), "tokens_per_s": float(steady.group(2)),
              "peak_mem_bytes": float(steady.group(3)) * 1e9 if steady.group(3) else None}
    if want_waits:
        waits = WAITS.search(text)
        if not waits:
            sys.exit(f"dp_scaling_rows: {path} has no data-parallel communication line")
        result["reduce_scatter_wait_ms"] = float(waits.group(1))
        result["allgather_wait_ms"] = float(waits.group(2))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--precision", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--one-gpu", required=True, help="log of the one-GPU run (--grad-accum = gpus)")
    parser.add_argument("--data-parallel", required=True, help="log of rank 0 of the data-parallel run")
    parser.add_argument("--command", required=True)
    options = parser.parse_args()
    one = read(options.one_gpu, want_waits=False)
    many = read(options.data_parallel, want_waits=True)
    import torch  # the GPU machine's Python has it; only for the device name and version
    row = {
        "case": "dp_scaling", "config": options.config, "precision": options.precision, "gpus": options.gpus,
        "tokens_per_s": many["tokens_per_s"], "one_gpu_tokens_per_s": one["tokens_per_s"],
        "scaling_efficiency": many["tokens_per_s"] / (options.gpus * one["tokens_per_s"]),
        "allgather_wait_ms": many["allgather_wait_ms"], "reduce_scatter_wait_ms": many["reduce_scatter_wait_ms"],
        "peak_mem_bytes_per_rank": many["peak_mem_bytes"], "one_gpu_peak_mem_bytes": one["peak_mem_bytes"],
        "final_loss": many["final_loss"], "one_gpu_final_loss": one["final_loss"],
        "command": options.command,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
