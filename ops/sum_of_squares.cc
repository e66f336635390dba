#include "ops/sum_of_squares.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <string>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"

namespace amp8 {

at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "sum_of_squares: tensors must hold at least one tensor");
  const auto device = tensors.front().device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.defined(), "sum_of_squares: tensors[", i, "] is undefined");
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                    t.scalar_type() == at::kHalf,
                "sum_of_squares: tensors[", i, "] must be float32, bfloat16 or float16, got ",
                t.scalar_type());
    TORCH_CHECK(t.device() == device, "sum_of_squares: tensors[", i, "] is on ", t.device(),
                ", tensors[0] on ", device, ": all must be on one device");
    TORCH_CHECK(t.is_contiguous(), "sum_of_squares: tensors[", i, "] (", t.sizes(),
                ") must be contiguous");
  }
  if (device.is_cuda()) {
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
