#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "ops/fp8_tensor.h"

namespace amp8 {

// Quantization to FP8. Every function here runs on CPU (the reference, in plain C++ over
// ATen storage) and on CUDA (fused kernels); both produce identical bytes, amax and scale_inv.
//
// Common rules:
//  * `x` is float32, bfloat16 or float16, contiguous, non-empty.
//  * `scale` is a float32 tensor of one element on x's device (no host sync is made).
//  * Quantization saturates: q = fp8(clamp(float(x) * scale, -fp8_max, fp8_max)), rounding to
//    nearest even; NaN stays NaN (sign kept).
//  * `amax_out`, when defined, is a float32 tensor of one element on x's device, e.g. a view
//    of an amax-history row; it is overwritten with max|x| taken before scaling. A NaN in x
//    makes it NaN; an infinity makes it inf. With `accumulate_amax` it becomes
//    max(amax_out, max|x|) instead, so that several tensors (or micro-batches) quantized
//    within one step share a history slot, as TE's do; the slot must then hold a
//    non-negative value or NaN, as amax-history rows do (they are zeroed by each update).
//  * The returned scale_inv is 1 / scale, computed in float32, in a new tensor.

/// Saturating quantization of `x` (any shape) into `format`. With `out` defined (a contiguous
/// tensor of the format's dtype with x's number of elements, on x's device; e.g. a view into
/// a parameter buffer), the codes are written there and the result's data is `out` reshaped
/// to x's shape; otherwise into a new tensor.
Fp8Tensor quantize(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                   const at::Tensor& amax_out = {}, bool accumulate_amax = false,
                   const at::Tensor& out = {});

/// quantize() of many tensors at once, each with its own scale, without amax or scale_inv:
/// outs[i] receives the codes quantize(xs[i], scales[scale_index[i]], format, {}, false, outs[i])
/// writes. xs: one dtype (float32, bfloat16 or float16), contiguous, non-empty, on one device;
/// outs[i]: contiguous, the format's dtype, xs[i]'s number of elements, on that device;
/// scales: 1-D float32 there. On CUDA one launch per 128 tensors (Apex's multi_tensor_apply)
/// instead of one per tensor: e.g. every FP8 weight written from its FP32 master after a step.
void quantize_many(const std::vector<at::Tensor>& xs, const at::Tensor& scales,
                   const std::vector<int64_t>& scale_index, Fp8Format format,
                   const std::vector<at::Tensor>& outs);

/// A 2-D tensor quantized row-major and transposed, from one read of the input.
/// `data` is [rows, cols] and `transposed.data` is [cols, rows]; they share scale_inv.
struct Fp8CastTranspose {
  Fp8Tensor data;
  Fp8Tensor transposed;
};

/// Fused cast + transpose + amax of a 2-D `x` [rows, cols]: what Hopper's TN-only FP8 GEMMs
/// need to compute both y = x·Wᵀ and the backward GEMMs without a separate transpose.
/// `dbias_out`, when defined (a contiguous [cols] tensor on x's device, float32, bfloat16 or
/// float16: the bias's own dtype), receives Σ_rows x, summed in float32 and rounded once (TE's
/// cast_transpose_dbias: a layer's bias gradient from the read that quantizes its output
/// gradient; on the GPU in the same kernel where the shape allows).
Fp8CastTranspose cast_transpose(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                                const at::Tensor& amax_out = {}, bool accumulate_amax = false,
                                const at::Tensor& dbias_out = {});

/// cast_transpose of the column-wise concatenation [x_0 | x_1 | …] of `pieces` (2-D, one row
/// count, dtype and device, each contiguous) without writing the concatenation: each piece is
/// quantized into its column block of `data` [rows, Σ cols_i] and its row block of
/// `transposed.data`. The same bytes and amax as cast_transpose(at::cat(pieces, 1), …): a
/// layer's output gradient that arrives in pieces (attention's dq, dk and dv, for the QKV
/// projection) goes into the FP8 GEMMs without a concatenating copy. dbias_out ([Σ cols_i]):
/// the column sums, bit for bit cast_transpose's of the concatenation on the CPU and on the
/// GPU where every piece takes the fused kernel (rows % 16 == 0, each piece's columns and column
/// offset multiples of 8); a piece that does not is summed by ATen, in another order.
Fp8CastTranspose cast_transpose_columns(const std::vector<at::Tensor>& pieces,
                                        const at::Tensor& scale, Fp8Format format,
                                        const at::Tensor& amax_out = {},
                                        bool accumulate_amax = false,
                                        const at::Tensor& dbias_out = {});

/// cast_transpose of gelu(x), GELU's tanh approximation computed in float32 from x (TE's
/// GELU-fused cast): the FP8 input of an MLP's second GEMM and its transpose straight from the
/// first GEMM's output, with no high-precision GELU output written. amax_out receives
/// max|gelu(x)|. CUDA: one kernel where x's shape allows (rows % 16 == 0, cols % 8 == 0, 16-byte
/// aligned), else LibTorch's GELU and then cast_transpose.
Fp8CastTranspose cast_transpose_gelu(const at::Tensor& x, const at::Tensor& scale,
                                     Fp8Format format, const at::Tensor& amax_out = {},
                                     bool accumulate_amax = false);

/// cast_transpose of swiglu(gate_up) (ops/swiglu.h's formula, in float32 and not rounded to
/// gate_up's dtype before the cast; TE's LayerNormMLP with activation "swiglu"): the FP8 input of
/// a SwiGLU MLP's second GEMM [rows, ffn] and its transpose straight from the first GEMM's fused
/// gate/up output gate_up [rows, 2·ffn] (gate first), with no high-precision SwiGLU output
/// written. amax_out receives max|swiglu(gate_up)|. CUDA: one kernel where the shape allows
/// (rows % 16 == 0, ffn % 8 == 0, 16-byte aligned), else swiglu in float32 and cast_transpose.
Fp8CastTranspose cast_transpose_swiglu(const at::Tensor& gate_up, const at::Tensor& scale,
                                       Fp8Format format, const at::Tensor& amax_out = {},
                                       bool accumulate_amax = false);

/// cast_transpose of SwiGLU's backward (ops/swiglu.h's swiglu_backward in float32, not rounded to
/// grad's dtype before the cast; TE's LayerNormMLP "swiglu": dSwiGLU fused with the gradient's
/// cast-transpose): the FP8 gradient [rows, 2·ffn] of a SwiGLU MLP's first GEMM output, d gate
/// then d up, from one read of `grad` [rows, ffn] (the gradient of SwiGLU's output) and
/// `gate_up` [rows, 2·ffn] (its input; grad's dtype and device, contiguous). amax_out receives
/// the max of |those values|; dbias_out ([2·ffn]), as cast_transpose's, their column sums.
/// CUDA: one kernel where the shape allows (rows % 16 == 0, ffn % 8 == 0, 16-byte aligned, no
/// dbias_out), else swiglu_backward in float32 and cast_transpose.
Fp8CastTranspose cast_transpose_dswiglu(const at::Tensor& grad, const at::Tensor& gate_up,
                                        const at::Tensor& scale, Fp8Format format,
                                        const at::Tensor& amax_out = {},
                                        bool accumulate_amax = false,
                                        const at::Tensor& dbias_out = {});

/// cast_transpose of grad · gelu'(gelu_input) (the tanh approximation's derivative, float32;
/// TE's cast_transpose_dbias_dgelu): the FP8 gradient of an MLP's first GEMM output, from one
/// read of `grad` (the gradient of GELU's output) and `gelu_input` (both 2-D, same shape, dtype
/// and device). amax_out receives the max of |those values|; dbias_out, as cast_transpose's,
/// their column sums (the first GEMM's bias gradient). CUDA: one kernel where the shape allows,
/// as cast_transpose_gelu.
Fp8CastTranspose cast_transpose_dgelu(const at::Tensor& grad, const at::Tensor& gelu_input,
                                      const at::Tensor& scale, Fp8Format format,
                                      const at::Tensor& amax_out = {},
                                      bool accumulate_amax = false,
                                      const at::Tensor& dbias_out = {});

/// max|x| as a float32 tensor of one element on x's device (NaN if x holds a NaN).
at::Tensor compute_amax(const at::Tensor& x);

/// compute_amax of many tensors at once: float32 [xs.size()] on their device, element i
/// max|xs[i]| (NaN if xs[i] holds a NaN; 0 for an empty one). xs: float32, bfloat16 or float16
/// (mixed dtypes are fine), contiguous, on one device, at least one. On CUDA one launch per 128
/// tensors of a dtype: e.g. every FP8 weight's master amax after a step.
at::Tensor compute_amax_many(const std::vector<at::Tensor>& xs);

/// max|v| over the values cast_transpose_gelu / _dgelu / _swiglu / _dswiglu quantize for the
/// same inputs (the fused kernels' float32 formula; a float32 tensor of one element on the
/// inputs' device), computed from the inputs without writing the values: current scaling's amax
/// before the fused cast. Where the fused kernel takes the shape, measuring and casting read the
/// inputs twice, where computing the activation first writes it in high precision and reads it
/// twice more; where it does not, the cast computes the values with LibTorch's formula (GELU) or
/// writes them in float32 first, and this amax may differ from theirs in the last float32 place.
at::Tensor compute_amax_gelu(const at::Tensor& x);
at::Tensor compute_amax_dgelu(const at::Tensor& grad, const at::Tensor& gelu_input);
at::Tensor compute_amax_swiglu(const at::Tensor& gate_up);
at::Tensor compute_amax_dswiglu(const at::Tensor& grad, const at::Tensor& gate_up);

/// The current-scaling scale for a measured amax (float32 on any device, one value or a 1-D
/// tensor of n, e.g. one per weight; the result is [n]): (fp8_max / amax) / 2^margin, 1 when
/// amax is 0 or not finite, FLT_MAX on overflow. One launch for all n on the GPU.
at::Tensor compute_current_scale(const at::Tensor& amax, Fp8Format format, int margin = 0);

/// Current (per-tensor, just-in-time) scaling: amax of x, then
/// scale = (fp8_max / amax) / 2^margin (1 when amax is 0 or not finite; FLT_MAX when the
/// quotient overflows), then quantize with it. `amax_out`/`scale_out`, when defined, receive
/// the amax and the scale used.
Fp8Tensor quantize_current_scaling(const at::Tensor& x, Fp8Format format, int margin = 0,
                                   const at::Tensor& amax_out = {},
                                   const at::Tensor& scale_out = {});

}  // namespace amp8
