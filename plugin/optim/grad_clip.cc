#include "plugin/optim/grad_clip.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>

namespace amp8 {

double global_grad_norm(const std::vector<at::Tensor>& grads, c10d::ProcessGroup* group,
                        at::Device device) {
  if (grads.empty() && group == nullptr) return 0.0;
  at::NoGradGuard no_grad;
  at::Tensor sum_of_squares;
  if (grads.empty()) {
    sum_of_squares = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  } else {
    auto norms = at::_foreach_norm(grads, 2, at::kFloat);
    for (auto& n : norms) n = n.reshape({1}).to(grads.front().device());
    sum_of_squares = at::cat(norms).square().sum().reshape({1});
  }
  if (group != nullptr) {
    std::vector<at::Tensor> tensors{sum_of_squares};
    group->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::SUM})->wait();
  }
  return std::sqrt(sum_of_squares.item<double>());
}

double clip_coefficient(double norm, double max_norm) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  const double coef = max_norm / (norm + 1e-6);
  return std::isfinite(norm) && coef < 1.0 ? coef : 1.0;
}

double clip_grad_norm_(const std::vector<at::Tensor>& grads, double max_norm,
                       c10d::ProcessGroup* group, at::Device device) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  const double norm = global_grad_norm(grads, group, device);
  const double coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0 && !grads.empty()) {
    at::NoGradGuard no_grad;
    at::_foreach_mul_(grads, coef);
  }
  return norm;
}

}  // namespace amp8
