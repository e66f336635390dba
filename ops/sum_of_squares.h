#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp8 {

/// Σ x² over every element of every tensor in `tensors`, as float32 [1] on their device: the
/// squared global L2 norm that gradient clipping (torch::nn::utils::clip_grad_norm_) takes the
/// square root of. A NaN anywhere gives NaN, an infinity (and no NaN) +inf.
///
/// CUDA: Apex's multi_tensor_l2norm. Every tensor is cut in chunks of 4096 elements; one block
/// of a multi-tensor kernel sums a chunk's squares in float32 (one launch per 128 tensors of a
/// dtype, whatever their sizes), and ATen sums the chunks' sums: a few launches in all, where
/// one norm per tensor and a stack of them cost the host ~10 µs per tensor. The same tensors
/// give the same bits on every call on one kind of GPU (ATen's reduction follows the device). CPU:
/// the reference, summed in float64 and rounded once.
///
/// Tensors: float32, bfloat16 or float16 (mixed dtypes are fine), contiguous, on one device;
/// at least one. Throws naming the offending entry.
at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors);

}  // namespace amp8
