#!/usr/bin/env python3
"""The Python user's baseline for gpt_stack_bench: the same 12-layer pre-LayerNorm GPT block
stack (hidden 2048, 16 heads, sequence 2048, micro-batch 8, MSE loss against a random target) in
plain PyTorch as a Python user writes it: float32 parameters, torch.autocast(bfloat16), fused
AdamW (torch.optim.AdamW(fused=True)), eager mode. Prints one JSON line in gpt_stack_bench's
format (step time as the median of CUDA-event-timed steps).

    python3 bench/pytorch_gpt_stack.py [--reps 10] [--warmup 3]
"""
import argparse
import datetime
import json
import socket
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH = 12, 2048, 16, 2048, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, HIDDEN // HEADS).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, HIDDEN))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.final_ln = nn.LayerNorm(HIDDEN)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.final_ln(x)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Stack().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.manual_seed(1)
    x = torch.randn(MICRO_BATCH, SEQ, HIDDEN, device="cuda")
    y = torch.randn(MICRO_BATCH, SEQ, HIDDEN, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first_loss = step().item()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    step_ms = sorted(times)[len(times) // 2]
    tokens = SEQ * MICRO_BATCH
    print(json.dumps({
        "case": "gpt_stack_step_pytorch_amp",
        "shape": f"{LAYERS} layers x hidden {HIDDEN} x seq {SEQ} x batch {MICRO_BATCH}",
        "precision": "pytorch-amp",
        "ours_ms": step_ms,
        "tokens_per_s": tokens / (step_ms / 1000.0),
        "peak_mem_bytes": peak,
        "first_loss": first_loss,
        "what": "PyTorch eager, torch.autocast(bfloat16), float32 params, AdamW(fused=True)",
        "command": " ".join([sys.executable] + sys.argv),
        "device": torch.cuda.get_device_name(),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
