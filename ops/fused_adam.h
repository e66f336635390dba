#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace amp8 {

/// The hyper-parameters of one Adam / AdamW step: torch::optim::AdamOptions / AdamWOptions.
struct AdamStepOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  /// true: AdamW's decoupled decay (param *= 1 - lr·weight_decay before the update);
  /// false: Adam's L2 term (grad += weight_decay·param).
  bool decoupled_weight_decay = true;
};

/// One tensor's share of a fused step.
struct AdamStepTensor {
  at::Tensor param;       ///< float32 (the FP32 master), updated in place
  at::Tensor grad;        ///< param's shape; float32, bfloat16 or float16; only read
  at::Tensor exp_avg;     ///< float32 or bfloat16, param's shape, updated in place
  at::Tensor exp_avg_sq;  ///< float32 or bfloat16, param's shape, updated in place
  int64_t step = 1;       ///< the step count including this step (1 for the first)
  /// Optional: a bfloat16 / float16 tensor of param's shape (the model's half parameter) that
  /// receives the updated param, rounded to nearest even; or, with model_copy_scale, a
  /// float8_e4m3fn one (an FP8 weight) that receives quantize(param, model_copy_scale) in the
  /// same pass: TE's FusedAdam on Float8Tensor params, at the scale the weight already has.
  at::Tensor model_copy;
  /// Optional: one float32 element on param's device that becomes max(amax, max|param|) over
  /// the updated param (NaN if it holds one): an FP8 weight's amax measured by the step's own
  /// pass over its master instead of a second read of it (TE's FusedAdam writes FP8 params' amax
  /// the same way). Accumulated, so that the caller zeroes it once for any number of pieces; it
  /// must start at zero or above (on CUDA the max is taken over the bits of |x|: a negative
  /// start, −0.0 included, would stay).
  at::Tensor amax;
  /// With a float8_e4m3fn model_copy (and only then): one float32 element on param's device,
  /// the scale the copy is written at (values beyond ±448 saturate, as quantize's).
  at::Tensor model_copy_scale;
};

/// torch::optim::Adam / AdamW's update for many tensors at once, each gradient first multiplied
/// by `grad_multiplier` (the loss scale's inverse times the clipping coefficient; 1: none),
/// each updated param also written into its model_copy:
///   g = grad·grad_multiplier (+ weight_decay·param for Adam); param *= 1 − lr·weight_decay
///   (AdamW); m = β1·m + (1 − β1)·g; v = β2·v + (1 − β2)·g²;
///   param −= lr / (1 − β1^step) · m / (√v / √(1 − β2^step) + eps).
///
/// A moment stored in bfloat16 (TE's FusedAdam exp_avg_dtype / exp_avg_sq_dtype, Megatron-Core's
/// precision-aware optimizer; DeepSeek-V3 keeps both in bfloat16) is read into float32, updated
/// and used for this step's update in float32, and stored rounded to nearest even: half the
/// bytes of a float32 moment, the same arithmetic.
///
/// CUDA: multi-tensor kernels, one launch per 128 tensors of one (grad, copy, moment dtypes):
/// every element's param, moments and gradient read once, param, moments and copy written
/// once. CPU: the reference — torch::optim's own sequence of ATen operations, so with float32
/// moments bit for bit what torch::optim::Adam / AdamW computes (a bfloat16 moment: the same
/// operations on its float32 value, then rounded).
///
/// Every tensor must be contiguous and on one device; throws naming the entry and field.
void fused_adam_step(const std::vector<AdamStepTensor>& tensors, const AdamStepOptions& options,
                     double grad_multiplier = 1.0);

}  // namespace amp8
