#pragma once

#include <ATen/ATen.h>

#include "ops/fp8_tensor.h"

namespace amp8 {

// LayerNorm over the last dimension of a 2-D x [rows, hidden], statistics in float32:
//   mean = Σx / hidden,  var = Σ(x - mean)² / hidden (biased, as torch::nn::LayerNorm),
//   rstd = 1 / √(var + eps),  y = (x - mean) · rstd · gamma + beta,
// and RMSNorm (Llama's; at::rms_norm, TE's normalization "RMSNorm"), which neither centers nor
// shifts:
//   rstd = 1 / √(Σx² / hidden + eps),  y = x · rstd · gamma.
// CPU (reference, statistics accumulated in float64) and CUDA (fused kernels, float32
// two-pass statistics from registers; RMSNorm runs the same kernels with the mean fixed at 0)
// agree to float32 rounding.
//
// Common rules:
//  * `x` is float32, bfloat16 or float16, contiguous, 2-D, non-empty.
//  * `gamma` and `beta` are [hidden] tensors of any of those dtypes on x's device, or undefined
//    (no affine transform: gamma = 1, beta = 0).
//  * `eps` > 0.

/// The normalizations above (TE's `normalization` argument).
enum class Normalization { kLayerNorm, kRMSNorm };

/// "LayerNorm" or "RMSNorm".
const char* normalization_name(Normalization normalization);

/// Per-row statistics, float32 [rows]: what the backward pass needs.
struct LayerNormStats {
  at::Tensor mean;  ///< undefined for RMSNorm
  at::Tensor rstd;
};

struct LayerNormResult {
  at::Tensor out;  ///< [rows, hidden], x's dtype
  LayerNormStats stats;
};

/// y in x's dtype.
LayerNormResult layer_norm(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                           double eps);

struct LayerNormFp8Result {
  Fp8Tensor out;  ///< [rows, hidden] in `format`
  LayerNormStats stats;
};

/// y quantized straight into FP8, without a high-precision copy in memory (TE's
/// layernorm_fwd_fp8): q = fp8(clamp(y · scale)) with quantize()'s rules, y computed in float32.
/// `scale` is one float32 on x's device; `amax_out` (optional, one float32) receives max|y|
/// (max-merged with `accumulate_amax`, as in quantize()). `out`, when defined, is a contiguous
/// [rows, hidden] tensor of format's dtype to write into (e.g. the leading rows of a
/// zero-padded buffer); otherwise a new one is returned.
LayerNormFp8Result layer_norm_fp8(const at::Tensor& x, const at::Tensor& gamma,
                                  const at::Tensor& beta, double eps, const at::Tensor& scale,
                                  Fp8Format format, const at::Tensor& amax_out = {},
                                  bool accumulate_amax = false, const at::Tensor& out = {});

struct LayerNormGrads {
  at::Tensor grad_input;  ///< x's dtype
  at::Tensor grad_gamma;  ///< gamma's dtype; undefined when gamma is
  at::Tensor grad_beta;   ///< beta's dtype; undefined when beta is
};

/// Gradients of layer_norm for grad_out [rows, hidden] (any of the three dtypes), from the
/// saved x and statistics:
///   x̂ = (x - mean) · rstd,  g = grad_out · gamma,
///   dx = rstd · (g - mean(g) - x̂ · mean(g · x̂)) + grad_residual,  dgamma = Σ_rows grad_out · x̂,
///   dbeta = Σ_rows grad_out.
/// Accumulated in float32 in a fixed order: the result is deterministic.
/// `grad_residual`, when defined, is added to dx before its one rounding to x's dtype: the
/// gradient of a residual connection around the normalized input (a pre-norm block's
/// `x + f(norm(x))`), which autograd would otherwise sum with dx in a pass of its own. It has
/// x's shape and dtype, on x's device.
LayerNormGrads layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                   const LayerNormStats& stats, const at::Tensor& gamma,
                                   const at::Tensor& beta, const at::Tensor& grad_residual = {});

/// RMSNorm: y = x · rstd · gamma in x's dtype; stats.mean is undefined. Rules as layer_norm's
/// (there is no beta).
LayerNormResult rms_norm(const at::Tensor& x, const at::Tensor& gamma, double eps);

/// RMSNorm quantized straight into FP8, with layer_norm_fp8's arguments and rules (TE's
/// rmsnorm_fwd_fp8).
LayerNormFp8Result rms_norm_fp8(const at::Tensor& x, const at::Tensor& gamma, double eps,
                                const at::Tensor& scale, Fp8Format format,
                                const at::Tensor& amax_out = {}, bool accumulate_amax = false,
                                const at::Tensor& out = {});

/// Gradients of rms_norm (grad_beta undefined), with layer_norm_backward's rules:
///   x̂ = x · rstd,  g = grad_out · gamma,
///   dx = rstd · (g - x̂ · mean(g · x̂)) + grad_residual,  dgamma = Σ_rows grad_out · x̂.
LayerNormGrads rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                 const LayerNormStats& stats, const at::Tensor& gamma,
                                 const at::Tensor& grad_residual = {});

/// The byte transpose of a 2-D FP8 tensor: [rows, cols] → [cols, rows], same scale_inv.
/// For an activation quantized once (e.g. by layer_norm_fp8) whose transpose a weight-gradient
/// GEMM needs.
Fp8Tensor fp8_transpose(const Fp8Tensor& t);

}  // namespace amp8
