#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp8 {

/// Σ x² over every element of every tensor in `tensors`, as float32 [1] on their device: the
/// squared global L2 norm that gradient clipping (torch::nn::utils::clip_grad_norm_) takes the
/// square root of. A NaN anywhere gives NaN, an infinity (and no NaN) +inf.
///
/// CUDA: a few launches whatever the number of tensors (one per 128 tensors of a dtype, then one
/// sum), float32 partial sums in a fixed order: the same tensors give the same bits on every call
/// on one kind of GPU. CPU: the reference, summed in float64 and rounded once.
///
/// Tensors: float32, bfloat16 or float16 (mixed dtypes are fine), contiguous, on one device;
/// at least one. Throws naming the offending entry.
at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors);

}  // namespace amp8
