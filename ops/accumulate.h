#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp8 {

/// sums[i] += grads[i] in float32 for every i, or sums[i] = grads[i] where overwrite[i]: the
/// float32 running sum of a step's micro-batch gradients (Megatron's main_grad), the first
/// micro-batch of a sum written without reading (or zeroing) what the sum held before.
///
/// CUDA: one launch per 128 tensors of a gradient dtype, whatever their number (ATen's mixed-dtype
/// add takes one launch per tensor). Each element is rounded once, as the CPU reference (ATen's
/// add_ / copy_) does: both give the same bits, but for a NaN's payload (a NaN stays a NaN, an
/// infinity the same infinity).
///
/// sums: float32, contiguous; grads: float32, bfloat16 or float16 (mixed dtypes are fine),
/// contiguous, each the shape of its sum; all on one device; the three lists of one length
/// (empty lists do nothing). Throws naming the offending entry.
void accumulate_in_float32(const std::vector<at::Tensor>& sums, const std::vector<at::Tensor>& grads,
                           const std::vector<bool>& overwrite);

}  // namespace amp8
