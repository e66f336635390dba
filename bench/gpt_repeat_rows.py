#!/usr/bin/env python3
"""Runs the same `gpt_pretrain` command several times, one after the other, and prints one JSON
row saying whether the runs repeated bit for bit: every step's loss and gradient norm (from each
run's metrics.jsonl) against the first run's, the first step where any run differs and by how
much, with the command, device, torch version and date (bench/results keeps such rows).

  python3 bench/gpt_repeat_rows.py --case gpt_repeat --runs 2 --binary build/gpt_pretrain -- \
      --config 350m --steps 50 --save-last false --deterministic true

Each run gets its own --save-dir (a fresh folder under --scratch); the command must not hold one.
"""

import argparse
import datetime
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile


def read_steps(save_dir):
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if "loss" in r and "step" in r]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--binary", required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--scratch", default=None, help="folder for the runs' save dirs (default: a temporary one)")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    args = [a for a in options.rest if a != "--"]
    if "--save-dir" in args:
        sys.exit("gpt_repeat_rows: the command must not give --save-dir (each run gets its own)")
    if options.runs < 2:
        sys.exit("gpt_repeat_rows: --runs must be >= 2")
    scratch = pathlib.Path(options.scratch or tempfile.mkdtemp(prefix="gpt_repeat_"))
    runs = []
    for i in range(options.runs):
        save_dir = scratch / f"run{i}"
        command = [options.binary] + args + ["--save-dir", str(save_dir)]
        print(f"gpt_repeat_rows: run {i + 1}/{options.runs}: {shlex.join(command)}", file=sys.stderr, flush=True)
        log = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sys.stderr.write(log.stdout[-4000:])
        if log.returncode != 0:
            sys.exit(f"gpt_repeat_rows: run {i + 1} exited {log.returncode}")
        runs.append(read_steps(save_dir))

    first = runs[0]
    first_differing_step, max_rel_loss_diff = None, 0.0
    for other in runs[1:]:
        if len(other) != len(first):
            sys.exit("gpt_repeat_rows: the runs logged different numbers of steps")
        for a, b in zip(first, other):
            same = a["loss"] == b["loss"] and a.get("grad_norm") == b.get("grad_norm")
            if not same and (first_differing_step is None or a["step"] < first_differing_step):
                first_differing_step = a["step"]
            max_rel_loss_diff = max(max_rel_loss_diff, abs(a["loss"] - b["loss"]) / abs(a["loss"]))

    import torch  # the GPU machine's Python has it; only for the device name and version
    row = {
        "case": options.case,
        "config": args[args.index("--config") + 1] if "--config" in args else "tiny",
        "deterministic": "--deterministic" in args and args[args.index("--deterministic") + 1].lower() in ("true", "1", "on", "yes"),
        "runs": options.runs,
        "steps": len(first),
        "identical": first_differing_step is None,
        "first_differing_step": first_differing_step,
        "max_rel_loss_diff": max_rel_loss_diff,
        "final_losses": [r[-1]["loss"] for r in runs],
        "command": shlex.join(["python3", "bench/gpt_repeat_rows.py"] + sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__.split("+")[0],
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
