#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace amp8 {

/// The global L2 norm of `grads` (float32, bfloat16 or float16), accumulated in float32: one
/// multi-tensor pass, then one all-reduce of the sum of squares over `group` when given (every
/// element on exactly one rank, as the distributed optimizer's master shards). `device`: where
/// the sum lives when this rank holds no gradient (the group's collective device). 0 when no
/// rank holds a gradient. Left where it was computed, unread: a one-element float64 tensor (the
/// square root of the float32 sum, taken in double).
at::Tensor global_grad_norm_tensor(const std::vector<at::Tensor>& grads, c10d::ProcessGroup* group = nullptr,
                                   at::Device device = at::kCPU);

/// global_grad_norm_tensor's value, read back by the host.
double global_grad_norm(const std::vector<at::Tensor>& grads, c10d::ProcessGroup* group = nullptr,
                        at::Device device = at::kCPU);

/// What clipping to `max_norm` multiplies the gradients by: max_norm / (norm + 1e-6) when the
/// norm is finite and that is below 1, else 1 (a non-finite norm leaves the gradients as they
/// are: the caller skips or stops the step). Throws when max_norm is not positive.
double clip_coefficient(double norm, double max_norm);

/// Multiplies every gradient in place by clip_coefficient(norm, max_norm) when it is below 1;
/// `norm`: their global norm, already measured (global_grad_norm).
void clip_grads_to_norm_(const std::vector<at::Tensor>& grads, double norm, double max_norm);

/// torch::nn::utils::clip_grad_norm_ for gradients that may be sharded over `group`:
/// global_grad_norm, then every gradient multiplied in place by clip_coefficient when it is
/// below 1. max_norm = infinity only measures. Returns the norm before clipping.
double clip_grad_norm_(const std::vector<at::Tensor>& grads, double max_norm,
                       c10d::ProcessGroup* group = nullptr, at::Device device = at::kCPU);

}  // namespace amp8
