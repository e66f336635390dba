#!/usr/bin/env python3
"""Where the host's time goes in a profiled training step: the phases of one `amp8::step N`
of a Kineto trace written by `gpt_pretrain --profile DIR` (DIR/<run>/trace.json, or the
gzipped copies tools/gpu_check.sh brings back), and the top-level host ops of each phase.

  python3 tools/trace_phases.py runs/profile/bf16-mixed_fp8/trace.json.gz [--step 11] [--top 12]

Phases, from the host's side: the forward pass (step start to the autograd engine's first
node), the backward pass (its first to its last node) and what follows (optimizer step, FP8
weight re-quantization, scale updates). For each: wall time, and the host ops that ran at top
level on any thread, by total time and count. Kernel time is in step_profile.txt beside the
trace; this is the host's view, for steps that are bound by it (the 350m GPT). The profiler
adds host time per op, so compare phases within one trace or between traces, not with
unprofiled step times.
"""

import argparse
import collections
import gzip
import json
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def short(name):
    """A host op's name without the autograd engine's and amp8's namespaces."""
    for prefix, replacement in (("autograd::engine::evaluate_function: ", "backward: "),
                                ("torch::autograd::CppNode<", ""), ("amp8::(anonymous namespace)::", "")):
        name = name.replace(prefix, replacement)
    return name.rstrip(">")


def top_level(events):
    """The events not nested inside another of the list (one thread's)."""
    result, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            result.append(e)
            end = e["ts"] + e["dur"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--step", type=int, help="which amp8::step (default: the last one)")
    parser.add_argument("--top", type=int, default=12, help="host ops listed per phase")
    args = parser.parse_args()
    events = load(args.trace)
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("amp8::step")), key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"trace_phases: no amp8::step annotation in {args.trace}")
    if args.step is not None:
        steps = [s for s in steps if s["name"] == f"amp8::step {args.step}"]
        if not steps:
            sys.exit(f"trace_phases: no amp8::step {args.step} in {args.trace}")
    step = steps[-1]
    begin, end = step["ts"], step["ts"] + step["dur"]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")
            and begin <= e["ts"] <= end]
    backward = [e for e in host if e["name"].startswith("autograd::engine::evaluate_function")]
    if not backward:
        sys.exit("trace_phases: the step has no autograd node (no backward pass recorded)")
    bw_begin = min(e["ts"] for e in backward)
    bw_end = max(e["ts"] + e["dur"] for e in backward)
    phases = [("forward", begin, bw_begin), ("backward", bw_begin, bw_end), ("after the backward", bw_end, end)]
    print(f"{step['name']}: {step['dur'] / 1000:.1f} ms on the host ({args.trace})")
    by_thread = collections.defaultdict(list)
    for e in host:
        by_thread[e["tid"]].append(e)
    for name, lo, hi in phases:
        ops = collections.defaultdict(lambda: [0.0, 0])
        for thread_events in by_thread.values():
            for e in top_level([e for e in thread_events if lo <= e["ts"] < hi]):
                ops[e["name"]][0] += e["dur"]
                ops[e["name"]][1] += 1
        busy = sum(v[0] for v in ops.values())
        print(f"\n{name}: {(hi - lo) / 1000:.1f} ms wall, {busy / 1000:.1f} ms in recorded host ops")
        for op, (dur, count) in sorted(ops.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {dur / 1000:8.2f} ms {count:6d}x  {short(op)[:100]}")


if __name__ == "__main__":
    main()
