#include "plugin/precision_plugin.h"

#include <ATen/ATen.h>

#include <cmath>

namespace amp8 {
namespace {

std::vector<torch::Tensor> optimizer_params(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> params;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) params.push_back(param);
  }
  return params;
}

}  // namespace

double PrecisionPlugin::clip_gradients(torch::optim::Optimizer& optimizer, double max_norm) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  unscale_gradients(optimizer);
  std::vector<torch::Tensor> grads;
  for (const auto& param : optimizer_params(optimizer)) {
    if (param.grad().defined()) grads.push_back(param.grad());
  }
  if (grads.empty()) return 0.0;
  torch::NoGradGuard no_grad;
  // The global L2 norm in float32 (one multi-tensor pass), then a scaling pass only when the
  // norm is above max_norm: an infinite max_norm (the Trainer's gradient check) only measures.
  auto norms = at::_foreach_norm(grads, 2);
  for (auto& n : norms) n = n.to(at::kFloat).reshape({1}).to(norms.front().device());
  const double norm = at::cat(norms).norm().item<double>();
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0) at::_foreach_mul_(grads, coef);
  return norm;
}

bool PrecisionPlugin::optimizer_step(torch::optim::Optimizer& optimizer) {
  optimizer.step();
  optimizer.zero_grad(/*set_to_none=*/true);
  return true;
}

}  // namespace amp8
