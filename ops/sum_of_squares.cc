#include "ops/sum_of_squares.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"

namespace amp8 {

at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors) {
  detail::check_multi_tensor_list(tensors, "sum_of_squares", "tensors");
  if (tensors.front().is_cuda()) {
#ifdef AMP8_WITH_CUDA
    return detail::sum_of_squares_cuda(tensors);
#else
    detail::no_cuda("sum_of_squares");
#endif
  }
  at::NoGradGuard no_grad;
  auto sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble));
  for (const auto& t : tensors) sum += t.to(at::kDouble).square().sum();
  return sum.to(at::kFloat).reshape({1});
}

}  // namespace amp8
