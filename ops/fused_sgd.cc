#include "ops/fused_sgd.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <string>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"

namespace amp8 {
namespace {

constexpr const char* kOp = "fused_sgd_step";

void check_entry(const SgdStepTensor& t, size_t index, const at::Device& device,
                 bool with_momentum) {
  const std::string where = detail::step_entry_name(kOp, index);
  detail::check_step_param_grad_copy(t.param, t.grad, t.model_copy, device, where);
  if (with_momentum) {
    detail::check_step_tensor(t.momentum_buffer, t.param, device, where, "momentum_buffer",
                              detail::StepDtypes::kFloat32);
  }
}

// torch::optim::SGD (torch/csrc/api/src/optim/sgd.cpp), operation for operation.
void fused_sgd_step_cpu(const std::vector<SgdStepTensor>& tensors, const SgdStepOptions& o,
                        double grad_multiplier) {
  for (const auto& t : tensors) {
    at::Tensor d = t.grad.scalar_type() == at::kFloat ? t.grad : t.grad.to(at::kFloat);
    if (grad_multiplier != 1.0) d = d.mul(grad_multiplier);
    auto& p = t.param;
    if (o.weight_decay != 0) d = d.add(p, o.weight_decay);
    if (o.momentum != 0) {
      auto& buf = t.momentum_buffer;
      if (t.first_step) {
        buf.copy_(d);
      } else {
        buf.mul_(o.momentum).add_(d, 1 - o.dampening);
      }
      d = o.nesterov ? d.add(buf, o.momentum) : buf;
    }
    p.add_(d, -1 * o.lr);
    if (t.model_copy.defined()) t.model_copy.copy_(p);
  }
}

}  // namespace

void fused_sgd_step(const std::vector<SgdStepTensor>& tensors, const SgdStepOptions& options,
                    double grad_multiplier) {
  if (tensors.empty()) return;
  TORCH_CHECK(options.lr >= 0, kOp, ": lr must be >= 0, got ", options.lr);
  TORCH_CHECK(options.momentum >= 0, kOp, ": momentum must be >= 0, got ", options.momentum);
  TORCH_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0), kOp,
              ": nesterov needs momentum > 0 and dampening 0, got momentum ", options.momentum,
              " and dampening ", options.dampening);
  TORCH_CHECK(std::isfinite(grad_multiplier), kOp, ": grad_multiplier must be finite, got ",
              grad_multiplier);
  TORCH_CHECK(tensors.front().param.defined(), kOp, ": tensors[0].param must be a defined tensor");
  const auto device = tensors.front().param.device();
  const bool with_momentum = options.momentum != 0;
  for (size_t i = 0; i < tensors.size(); ++i) check_entry(tensors[i], i, device, with_momentum);
  at::NoGradGuard no_grad;
  if (device.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::fused_sgd_step_cuda(tensors, options, grad_multiplier);
    // Written through raw pointers: bump the version counters as in-place ATen ops would.
    for (const auto& t : tensors) {
      t.param.unsafeGetTensorImpl()->bump_version();
      if (with_momentum) t.momentum_buffer.unsafeGetTensorImpl()->bump_version();
      if (t.model_copy.defined()) t.model_copy.unsafeGetTensorImpl()->bump_version();
    }
#else
    TORCH_CHECK(false, kOp, ": got CUDA tensors but amp8 was built without CUDA");
#endif
    return;
  }
  fused_sgd_step_cpu(tensors, options, grad_multiplier);
}

}  // namespace amp8
