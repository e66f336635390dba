#include "plugin/optim/grad_clip.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ops/detail/checks.h"
#include "ops/sum_of_squares.h"

namespace amp8 {

namespace {

// The _foreach_* ops' multi-tensor kernels take one dtype and device per list; a mixed list (FP32
// main grads beside half gradients) falls back to one op per tensor, one launch and a few host
// ops each (profiled: 292 norms, ~7 ms of host time per 350m step). So: one list per
// (device, dtype), in a deterministic order.
std::vector<std::vector<at::Tensor>> by_device_and_dtype(const std::vector<at::Tensor>& tensors) {
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) groups[{t.device().str(), t.scalar_type()}].push_back(t);
  std::vector<std::vector<at::Tensor>> lists;
  for (auto& [key, list] : groups) lists.push_back(std::move(list));
  return lists;
}

// Where one multi-tensor kernel takes the whole list (ops/sum_of_squares.h): a norm and a stack
// per dtype cost the host ~10 µs per gradient (profiled: ~2.5 ms of a 1b GPT step, the GPU
// idle for ~1 ms of it).
bool one_cuda_device_contiguous(const std::vector<at::Tensor>& tensors) {
  return tensors.front().is_cuda() && !detail::multi_tensor_list_problem(tensors, "grads");
}

}  // namespace

at::Tensor global_grad_norm_tensor(const std::vector<at::Tensor>& grads, c10d::ProcessGroup* group,
                                   at::Device device) {
  const auto float64 = at::TensorOptions().dtype(at::kDouble);
  if (grads.empty() && group == nullptr) return at::zeros({1}, float64.device(device));
  at::NoGradGuard no_grad;
  at::Tensor sum_of_squares;
  if (grads.empty()) {
    sum_of_squares = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  } else if (one_cuda_device_contiguous(grads)) {
    sum_of_squares = amp8::sum_of_squares(grads);
  } else {
    const auto home = grads.front().device();
    std::vector<at::Tensor> per_list;
    for (const auto& list : by_device_and_dtype(grads)) {
      per_list.push_back(at::stack(at::_foreach_norm(list, 2, at::kFloat)).to(home).square().sum());
    }
    sum_of_squares = at::stack(per_list).sum().reshape({1});
  }
  if (group != nullptr) {
    std::vector<at::Tensor> tensors{sum_of_squares};
    group->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::SUM})->wait();
  }
  return sum_of_squares.to(at::kDouble).sqrt();
}

double global_grad_norm(const std::vector<at::Tensor>& grads, c10d::ProcessGroup* group, at::Device device) {
  return global_grad_norm_tensor(grads, group, device).item<double>();
}

double clip_coefficient(double norm, double max_norm) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  const double coef = max_norm / (norm + 1e-6);
  return std::isfinite(norm) && coef < 1.0 ? coef : 1.0;
}

void clip_grads_to_norm_(const std::vector<at::Tensor>& grads, double norm, double max_norm) {
  const double coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0 && !grads.empty()) {
    at::NoGradGuard no_grad;
    for (const auto& list : by_device_and_dtype(grads)) at::_foreach_mul_(list, coef);
  }
}

double clip_grad_norm_(const std::vector<at::Tensor>& grads, double max_norm,
                       c10d::ProcessGroup* group, at::Device device) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  const double norm = global_grad_norm(grads, group, device);
  clip_grads_to_norm_(grads, norm, max_norm);
  return norm;
}

}  // namespace amp8
