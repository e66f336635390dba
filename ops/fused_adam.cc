#include "ops/fused_adam.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <string>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"
#include "ops/quantize.h"

namespace amp8 {
namespace {

constexpr const char* kOp = "fused_adam_step";

// One float32 element on `device` (amax, model_copy_scale), else an error naming `field`.
void check_one_float(const at::Tensor& x, const at::Device& device, const std::string& where, const char* field,
                     const char* role = "") {
  TORCH_CHECK(x.defined() && x.scalar_type() == at::kFloat && x.numel() == 1 && x.device() == device, where, field,
              " must be one float32 element on ", device, role, ", got ",
              x.defined() ? c10::str(x.scalar_type(), " ", x.sizes(), " on ", x.device()) : std::string("none"));
}

void check_entry(const AdamStepTensor& t, size_t index, const at::Device& device) {
  const std::string where = detail::step_entry_name(kOp, index);
  const bool fp8_copy = t.model_copy.defined() && t.model_copy.scalar_type() == at::kFloat8_e4m3fn;
  detail::check_step_param_grad_copy(t.param, t.grad, fp8_copy ? at::Tensor() : t.model_copy, device, where);
  if (fp8_copy) {
    detail::check_step_tensor(t.model_copy, t.param, device, where, "model_copy", detail::StepDtypes::kFloat8E4M3);
    check_one_float(t.model_copy_scale, device, where, "model_copy_scale",
                    " (a float8_e4m3fn model_copy is written at it)");
  } else {
    TORCH_CHECK(!t.model_copy_scale.defined(), where,
                "model_copy_scale applies to a float8_e4m3fn model_copy only, got ",
                t.model_copy.defined() ? toString(t.model_copy.scalar_type()) : "no model_copy");
  }
  detail::check_step_tensor(t.exp_avg, t.param, device, where, "exp_avg", detail::StepDtypes::kFloat32OrBFloat16);
  detail::check_step_tensor(t.exp_avg_sq, t.param, device, where, "exp_avg_sq",
                            detail::StepDtypes::kFloat32OrBFloat16);
  TORCH_CHECK(t.step >= 1, where, "step must be >= 1 (the count including this step), got ", t.step);
  if (t.amax.defined()) check_one_float(t.amax, device, where, "amax");
}

// torch::optim::Adam / AdamW (torch/csrc/api/src/optim/adam*.cpp), operation for operation.
void fused_adam_step_cpu(const std::vector<AdamStepTensor>& tensors, const AdamStepOptions& o,
                         double grad_multiplier) {
  for (const auto& t : tensors) {
    at::Tensor grad = t.grad.scalar_type() == at::kFloat ? t.grad : t.grad.to(at::kFloat);
    if (grad_multiplier != 1.0) grad = grad.mul(grad_multiplier);
    auto& p = t.param;
    if (o.decoupled_weight_decay) {
      if (o.weight_decay != 0) p.mul_(1 - o.lr * o.weight_decay);
    } else if (o.weight_decay != 0) {
      grad = grad.add(p, o.weight_decay);
    }
    const double bias_correction1 = 1 - std::pow(o.beta1, t.step);
    const double bias_correction2 = 1 - std::pow(o.beta2, t.step);
    // A bfloat16 moment: updated and used as float32, stored rounded.
    auto exp_avg = t.exp_avg.scalar_type() == at::kFloat ? t.exp_avg : t.exp_avg.to(at::kFloat);
    auto exp_avg_sq = t.exp_avg_sq.scalar_type() == at::kFloat ? t.exp_avg_sq : t.exp_avg_sq.to(at::kFloat);
    exp_avg.mul_(o.beta1).add_(grad, 1 - o.beta1);
    exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
    const auto denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(o.eps);
    p.addcdiv_(exp_avg, denom, -(o.lr / bias_correction1));
    if (!exp_avg.is_same(t.exp_avg)) t.exp_avg.copy_(exp_avg);
    if (!exp_avg_sq.is_same(t.exp_avg_sq)) t.exp_avg_sq.copy_(exp_avg_sq);
    if (t.model_copy_scale.defined()) {
      // quantize's saturating cast: the bytes the kernel writes for the same param.
      if (p.numel() > 0) {
        quantize(p, t.model_copy_scale, Fp8Format::kE4M3, /*amax=*/{}, /*accumulate_amax=*/false, t.model_copy);
      }
    } else if (t.model_copy.defined()) {
      t.model_copy.copy_(p);
    }
    if (t.amax.defined() && p.numel() > 0) {
      // at::maximum and max() both propagate NaN, as the kernel's max over |x|'s bits does.
      t.amax.copy_(at::maximum(t.amax.reshape({}), p.abs().max()).reshape(t.amax.sizes()));
    }
  }
}

}  // namespace

void fused_adam_step(const std::vector<AdamStepTensor>& tensors, const AdamStepOptions& options,
                     double grad_multiplier) {
  if (tensors.empty()) return;
  TORCH_CHECK(options.lr >= 0, kOp, ": lr must be >= 0, got ", options.lr);
  TORCH_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
              kOp, ": betas must be in [0, 1), got (", options.beta1, ", ", options.beta2, ")");
  TORCH_CHECK(options.eps >= 0, kOp, ": eps must be >= 0, got ", options.eps);
  TORCH_CHECK(std::isfinite(grad_multiplier), kOp, ": grad_multiplier must be finite, got ",
              grad_multiplier);
  TORCH_CHECK(tensors.front().param.defined(), kOp, ": tensors[0].param must be a defined tensor");
  const auto device = tensors.front().param.device();
  for (size_t i = 0; i < tensors.size(); ++i) check_entry(tensors[i], i, device);
  at::NoGradGuard no_grad;
  if (device.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::fused_adam_step_cuda(tensors, options, grad_multiplier);
    // Written through raw pointers: bump the version counters as in-place ATen ops would (an
    // Fp8Linear weight cache, for one, keys on them).
    for (const auto& t : tensors) {
      for (const auto* written : {&t.param, &t.exp_avg, &t.exp_avg_sq, &t.model_copy, &t.amax}) {
        if (written->defined()) written->unsafeGetTensorImpl()->bump_version();
      }
    }
#else
    TORCH_CHECK(false, kOp, ": got CUDA tensors but amp8 was built without CUDA");
#endif
    return;
  }
  fused_adam_step_cpu(tensors, options, grad_multiplier);
}

}  // namespace amp8
