#pragma once

#include <ATen/ATen.h>

#include "ops/fp8_tensor.h"

namespace amp8 {

/// Optional parts of an FP8 GEMM.
struct Fp8GemmOptions {
  /// Added to every row of the result, shape [N]. Any float dtype; it is converted to what the
  /// tensor cores take (fp16 for an fp16 output, else bf16), on CPU too, so both paths agree.
  at::Tensor bias;
  /// Accumulate: out += A·Bᵀ (+ bias) into `out` ([M, N], the output dtype, not FP8).
  at::Tensor out;
  bool accumulate = false;
  /// Hopper's fast FP8 accumulation (fewer promotions to full fp32): TE's choice for the
  /// forward GEMM; dgrad and wgrad use full accumulation. Default: false.
  bool use_fast_accum = false;
  /// FP8 output only: the result is multiplied by out_scale (one float32) and saturated
  /// into the FP8 dtype; out_amax (one float32), when defined, receives max|A·Bᵀ + bias|.
  at::Tensor out_scale;
  at::Tensor out_amax;
};

/// y = (A·Bᵀ) * a.scale_inv * b.scale_inv (+ bias) for FP8 A [M, K] and B [N, K], both
/// row-major: the "TN" GEMM Hopper's FP8 tensor cores take, and exactly y = x·Wᵀ of a linear
/// layer. `out_dtype` is float32, bfloat16, float16, or an FP8 dtype (then see out_scale).
/// E5M2 × E5M2 is not supported (neither is it by the hardware); E4M3 × E5M2 is.
///
/// CUDA: cuBLASLt, on LibTorch's cuBLASLt handle, workspace and current stream; K, N (and M
/// for FP8 outputs) must be multiples of 16 and the data 16-byte aligned.
/// CPU: the same arithmetic in fp32 (exact FP8 products, fp32 sums), so the two agree within
/// accumulation-order rounding; the same shape rules are enforced so a CPU run predicts a GPU
/// one.
at::Tensor fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, at::ScalarType out_dtype,
                    const Fp8GemmOptions& options = {});

}  // namespace amp8
