#!/usr/bin/env python3
"""What FP8 attention would buy amp8's Llama step, measured before it is built.

amp8's attention is PyTorch's `scaled_dot_product_attention` in bfloat16 (cuDNN's flash kernels
on Hopper). FP8 attention on Hopper exists only as cuDNN's graph API (`sdpa_fp8` /
`sdpa_fp8_backward`, what Transformer Engine's `fp8_dpa` calls). This probe times both at one
attention shape (default: the llama3_8b layer, batch 1, sequence 8192, 32 query / 8 KV heads,
head_dim 128, causal) and checks that the FP8 result is attention at all (relative error of O and
of dQ, dK, dV against the bfloat16 result). It also times the casts FP8 attention adds in front of
and behind it when written as separate ops (Q, K, V and dO to FP8; dQ, dK, dV back to bfloat16),
an upper bound on what fused casts would cost.

Needs the `nvidia-cudnn-frontend` wheel (the `cudnn` Python module) beside torch's cuDNN.
Prints JSON rows (`case: "attention_fp8_probe"`), one per precision, and writes them to --out.

    python3 bench/attention_fp8_probe.py [--batch 1 --seq 8192 --heads 32 --kv-heads 8
        --head-dim 128 --iters 20 --out FILE]
"""
import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
E5M2_MAX = 57344.0


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


class Fp8Attention:
    """cuDNN's FP8 flash attention, forward and backward graphs for one shape (BSHD storage)."""

    # One uid per graph tensor; the forward and backward graphs share the numbering.
    (Q, K, V, O, STATS, DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S, SCALE_O, AMAX_S,
     AMAX_O, DO, DESCALE_O, DESCALE_DO, DESCALE_DP, SCALE_DQ, SCALE_DK, SCALE_DV, SCALE_DP, DQ,
     DK, DV, AMAX_DQ, AMAX_DK, AMAX_DV, AMAX_DP) = range(1, 29)

    def __init__(self, cudnn, b, h, h_kv, s, d, grad_type):
        self.cudnn, self.shape = cudnn, (b, h, h_kv, s, d)
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        self.grad_type = grad_type
        self.handle = cudnn.create_handle()
        scale = 1.0 / d ** 0.5

        def bshd(g, uid, heads, dtype):
            return g.tensor(uid=uid, dim=(b, heads, s, d), stride=(s * heads * d, d, heads * d, 1), data_type=dtype)

        def scalar(g, uid):
            return g.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)

        def output(t, uid, dims, strides, dtype):
            t.set_uid(uid).set_output(True).set_dim(dims).set_stride(strides).set_data_type(dtype)

        fwd = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32)
        o, stats, amax_s, amax_o = fwd.sdpa_fp8(
            q=bshd(fwd, self.Q, h, fp8), k=bshd(fwd, self.K, h_kv, fp8), v=bshd(fwd, self.V, h_kv, fp8),
            descale_q=scalar(fwd, self.DESCALE_Q), descale_k=scalar(fwd, self.DESCALE_K),
            descale_v=scalar(fwd, self.DESCALE_V), descale_s=scalar(fwd, self.DESCALE_S),
            scale_s=scalar(fwd, self.SCALE_S), scale_o=scalar(fwd, self.SCALE_O),
            is_inference=False, attn_scale=scale, use_causal_mask=True)
        output(o, self.O, (b, h, s, d), (s * h * d, d, h * d, 1), fp8)
        output(stats, self.STATS, (b, h, s, 1), (h * s, s, 1, 1), f32)
        output(amax_s, self.AMAX_S, (1, 1, 1, 1), (1, 1, 1, 1), f32)
        output(amax_o, self.AMAX_O, (1, 1, 1, 1), (1, 1, 1, 1), f32)

        bwd = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32)
        grads = bwd.sdpa_fp8_backward(
            q=bshd(bwd, self.Q, h, fp8), k=bshd(bwd, self.K, h_kv, fp8), v=bshd(bwd, self.V, h_kv, fp8),
            o=bshd(bwd, self.O, h, fp8), dO=bshd(bwd, self.DO, h, grad_type),
            stats=bwd.tensor(uid=self.STATS, dim=(b, h, s, 1), stride=(h * s, s, 1, 1), data_type=f32),
            descale_q=scalar(bwd, self.DESCALE_Q), descale_k=scalar(bwd, self.DESCALE_K),
            descale_v=scalar(bwd, self.DESCALE_V), descale_o=scalar(bwd, self.DESCALE_O),
            descale_dO=scalar(bwd, self.DESCALE_DO), descale_s=scalar(bwd, self.DESCALE_S),
            descale_dP=scalar(bwd, self.DESCALE_DP), scale_s=scalar(bwd, self.SCALE_S),
            scale_dQ=scalar(bwd, self.SCALE_DQ), scale_dK=scalar(bwd, self.SCALE_DK),
            scale_dV=scalar(bwd, self.SCALE_DV), scale_dP=scalar(bwd, self.SCALE_DP),
            attn_scale=scale, use_causal_mask=True)
        dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = grads
        output(dq, self.DQ, (b, h, s, d), (s * h * d, d, h * d, 1), grad_type)
        output(dk, self.DK, (b, h_kv, s, d), (s * h_kv * d, d, h_kv * d, 1), grad_type)
        output(dv, self.DV, (b, h_kv, s, d), (s * h_kv * d, d, h_kv * d, 1), grad_type)
        for t, uid in ((amax_dq, self.AMAX_DQ), (amax_dk, self.AMAX_DK), (amax_dv, self.AMAX_DV),
                       (amax_dp, self.AMAX_DP)):
            output(t, uid, (1, 1, 1, 1), (1, 1, 1, 1), f32)

        for g in (fwd, bwd):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        self.fwd, self.bwd = fwd, bwd
        self.workspace = torch.empty(max(fwd.get_workspace_size(), bwd.get_workspace_size()),
                                     dtype=torch.uint8, device="cuda")

    def run(self, graph, pack):
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute(pack, self.workspace, handle=self.handle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import cudnn  # the nvidia-cudnn-frontend wheel

    b, h, h_kv, s, d = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    torch.manual_seed(0)
    dev = "cuda"
    # Activations as a trained model's attention sees them: unit-scale Q and K (RMSNorm'd
    # hidden states through a projection), V likewise, dO small as a loss gradient is.
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, s, h_kv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, s, h_kv, d, device=dev, dtype=torch.bfloat16)
    do = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) * 1e-3

    # bfloat16: what amp8's attention runs today (BHSD views of BSHD storage, PyTorch's own
    # choice of kernel, which on Hopper is cuDNN's).
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

    def bf16_fwd():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=h != h_kv)

    def bf16_fwd_bwd():
        out = bf16_fwd()
        return torch.autograd.grad(out, (qt, kt, vt), do.transpose(1, 2))

    out_ref = bf16_fwd().detach().transpose(1, 2)
    dq_ref, dk_ref, dv_ref = (g.transpose(1, 2) for g in bf16_fwd_bwd())
    bf16_fwd_ms = median_ms(bf16_fwd, args.iters)
    bf16_total_ms = median_ms(bf16_fwd_bwd, args.iters)

    # FP8: scales from each tensor's own amax (current scaling), S at 448 (amax(P) <= 1), and the
    # backward's dP, dQ, dK, dV scales from a first pass's amaxes (at scale 1, so the amaxes are
    # the values' own however cuDNN reports them), as delayed scaling would hold them.
    rows, fp8_error = [], ""
    try:
        grad_type_name = "e5m2"
        try:
            attn = Fp8Attention(cudnn, b, h, h_kv, s, d, cudnn.data_type.FP8_E5M2)
        except Exception as e:  # HYBRID's E5M2 gradients may have no engine; E4M3 throughout then
            print(f"E5M2 gradients not supported ({e}); trying E4M3", file=sys.stderr)
            grad_type_name = "e4m3"
            attn = Fp8Attention(cudnn, b, h, h_kv, s, d, cudnn.data_type.FP8_E4M3)
        grad_dtype, grad_max = ((torch.float8_e5m2, E5M2_MAX) if grad_type_name == "e5m2"
                                else (torch.float8_e4m3fn, E4M3_MAX))
        one = lambda x: torch.full((1, 1, 1, 1), float(x), device=dev, dtype=torch.float32)

        def quantize(t, fp8_dtype, fp8_max):
            scale = fp8_max / t.abs().amax().float().clamp_min(1e-12)
            return (t.float() * scale).to(fp8_dtype), (1.0 / scale).reshape(1, 1, 1, 1)

        q8, dsq = quantize(q, torch.float8_e4m3fn, E4M3_MAX)
        k8, dsk = quantize(k, torch.float8_e4m3fn, E4M3_MAX)
        v8, dsv = quantize(v, torch.float8_e4m3fn, E4M3_MAX)
        do8, dsdo = quantize(do, grad_dtype, grad_max)
        o8 = torch.empty(b, s, h, d, device=dev, dtype=torch.float8_e4m3fn)
        stats = torch.empty(b, h, s, 1, device=dev, dtype=torch.float32)
        dq8 = torch.empty(b, s, h, d, device=dev, dtype=grad_dtype)
        dk8 = torch.empty(b, s, h_kv, d, device=dev, dtype=grad_dtype)
        dv8 = torch.empty(b, s, h_kv, d, device=dev, dtype=grad_dtype)
        amax = {n: one(0) for n in ("s", "o", "dq", "dk", "dv", "dp")}
        # O's scale follows V's (|O| <= max|V|: each row of P sums to 1).
        scale_o = 1.0 / dsv
        descale_o = dsv
        scale = {n: one(1.0) for n in ("dq", "dk", "dv", "dp")}
        A = Fp8Attention
        fwd_pack = {A.Q: q8, A.K: k8, A.V: v8, A.O: o8, A.STATS: stats, A.DESCALE_Q: dsq,
                    A.DESCALE_K: dsk, A.DESCALE_V: dsv, A.DESCALE_S: one(1 / E4M3_MAX),
                    A.SCALE_S: one(E4M3_MAX), A.SCALE_O: scale_o, A.AMAX_S: amax["s"],
                    A.AMAX_O: amax["o"]}

        def bwd_pack():
            return {A.Q: q8, A.K: k8, A.V: v8, A.O: o8, A.DO: do8, A.STATS: stats,
                    A.DESCALE_Q: dsq, A.DESCALE_K: dsk, A.DESCALE_V: dsv, A.DESCALE_O: descale_o,
                    A.DESCALE_DO: dsdo, A.DESCALE_S: one(1 / E4M3_MAX),
                    A.DESCALE_DP: 1.0 / scale["dp"], A.SCALE_S: one(E4M3_MAX),
                    A.SCALE_DQ: scale["dq"], A.SCALE_DK: scale["dk"], A.SCALE_DV: scale["dv"],
                    A.SCALE_DP: scale["dp"], A.DQ: dq8, A.DK: dk8, A.DV: dv8,
                    A.AMAX_DQ: amax["dq"], A.AMAX_DK: amax["dk"], A.AMAX_DV: amax["dv"],
                    A.AMAX_DP: amax["dp"]}

        attn.run(attn.fwd, fwd_pack)
        attn.run(attn.bwd, bwd_pack())
        torch.cuda.synchronize()
        for n in scale:
            scale[n] = one(grad_max) / amax[n].clamp_min(1e-30)
        pack = bwd_pack()
        attn.run(attn.bwd, pack)
        torch.cuda.synchronize()
        descale = lambda n: (1.0 / scale[n]).reshape(())
        errors = {
            "rel_err_o": rel_err(o8.float() * descale_o.reshape(()), out_ref),
            "rel_err_dq": rel_err(dq8.float() * descale("dq"), dq_ref),
            "rel_err_dk": rel_err(dk8.float() * descale("dk"), dk_ref),
            "rel_err_dv": rel_err(dv8.float() * descale("dv"), dv_ref),
            "amax_s": amax["s"].item(),
        }
        fp8_fwd_ms = median_ms(lambda: attn.run(attn.fwd, fwd_pack), args.iters)
        fp8_total_ms = median_ms(lambda: (attn.run(attn.fwd, fwd_pack), attn.run(attn.bwd, pack)), args.iters)

        def casts():  # separate-op casts around FP8 attention: an upper bound on fused ones
            for t in (q, k, v):
                (t.float() * 448.0).to(torch.float8_e4m3fn)
            (do.float() * 448.0).to(grad_dtype)
            for t in (dq8, dk8, dv8):
                t.to(torch.bfloat16)

        casts_ms = median_ms(casts, args.iters)
        rows.append(dict(precision="fp8", grad_dtype=grad_type_name, fwd_ms=round(fp8_fwd_ms, 3),
                         fwd_bwd_ms=round(fp8_total_ms, 3), unfused_casts_ms=round(casts_ms, 3),
                         speedup_fwd_bwd=round(bf16_total_ms / fp8_total_ms, 3),
                         speedup_with_unfused_casts=round(bf16_total_ms / (fp8_total_ms + casts_ms), 3),
                         **{k_: round(v_, 5) for k_, v_ in errors.items()}))
    except Exception as e:  # recorded, not hidden: the bf16 row still says what was measured
        fp8_error = f"{type(e).__name__}: {e}"
    rows.insert(0, dict(precision="bf16", fwd_ms=round(bf16_fwd_ms, 3), fwd_bwd_ms=round(bf16_total_ms, 3)))
    common = dict(case="attention_fp8_probe", batch=b, seq=s, heads=h, kv_heads=h_kv, head_dim=d,
                  causal=True, command=" ".join(["python3"] + sys.argv),
                  device=torch.cuda.get_device_name(), torch=torch.__version__,
                  cudnn_backend=cudnn.backend_version_string(),
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    if fp8_error:
        common["fp8_error"] = fp8_error[:2000]
    lines = [json.dumps({**common, **row}) for row in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if not fp8_error else 1


if __name__ == "__main__":
    sys.exit(main())
