#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp8 {

/// The hyper-parameters of one SGD step: torch::optim::SGDOptions.
struct SgdStepOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

/// One tensor's share of a fused SGD step.
struct SgdStepTensor {
  at::Tensor param;  ///< float32 (the FP32 master), updated in place
  at::Tensor grad;   ///< param's shape; float32, bfloat16 or float16; only read
  /// float32, param's shape, updated in place; required when momentum != 0, else ignored.
  at::Tensor momentum_buffer;
  /// true on the buffer's first step (torch::optim creates it then, as a copy of the gradient,
  /// undampened): the buffer's contents are not read.
  bool first_step = false;
  /// Optional: a bfloat16 / float16 tensor of param's shape (the model's half parameter) that
  /// receives the updated param, rounded to nearest even.
  at::Tensor model_copy;
};

/// torch::optim::SGD's update for many tensors at once, each gradient first multiplied by
/// `grad_multiplier` (the loss scale's inverse times the clipping coefficient; 1: none), each
/// updated param also written into its model_copy:
///   d = grad·grad_multiplier + weight_decay·param;
///   with momentum: buf = d on the first step, else buf = momentum·buf + (1 − dampening)·d;
///                  d = d + momentum·buf (nesterov) or d = buf;
///   param −= lr·d.
///
/// CUDA: multi-tensor kernels, one launch per 128 tensors of one (grad dtype, copy dtype):
/// each element's param, buffer and gradient read once, param, buffer and copy written once.
/// CPU: the reference — torch::optim::SGD's own sequence of ATen operations, so bit for bit
/// what it computes.
///
/// Every tensor must be contiguous and on one device; throws naming the entry and field.
void fused_sgd_step(const std::vector<SgdStepTensor>& tensors, const SgdStepOptions& options,
                    double grad_multiplier = 1.0);

}  // namespace amp8
