#include "plugin/precision/precision_plugin.h"

#include <ATen/ATen.h>

#include <cmath>

#include "plugin/optim/grad_clip.h"

namespace amp8 {
namespace {

std::vector<torch::Tensor> optimizer_params(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> params;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) params.push_back(param);
  }
  return params;
}

std::vector<torch::Tensor> defined_gradients(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> grads;
  for (const auto& param : optimizer_params(optimizer)) {
    if (param.grad().defined()) grads.push_back(param.grad());
  }
  return grads;
}

}  // namespace

torch::Tensor PrecisionPlugin::gradient_norm(torch::optim::Optimizer& optimizer) {
  unscale_gradients(optimizer);
  return global_grad_norm_tensor(defined_gradients(optimizer));
}

void PrecisionPlugin::clip_gradients_to(torch::optim::Optimizer& optimizer, double max_norm, double norm) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  unscale_gradients(optimizer);
  clip_grads_to_norm_(defined_gradients(optimizer), norm, max_norm);
}

double PrecisionPlugin::clip_gradients(torch::optim::Optimizer& optimizer, double max_norm) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  const double norm = gradient_norm(optimizer).item<double>();
  clip_gradients_to(optimizer, max_norm, norm);
  return norm;
}

bool PrecisionPlugin::optimizer_step(torch::optim::Optimizer& optimizer) {
  optimizer.step();
  optimizer.zero_grad(/*set_to_none=*/true);
  return true;
}

}  // namespace amp8
