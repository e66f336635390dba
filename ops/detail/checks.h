#pragma once
// Argument checks shared by the ops' public entry points.

#include <ATen/ATen.h>

#include <string_view>

namespace amp8::detail {

// The CUDA branch of an op in a build without CUDA.
[[noreturn]] inline void no_cuda(std::string_view op) {
  TORCH_CHECK(false, op, ": got a CUDA tensor but amp8 was built without CUDA");
}

inline void check_high_precision_input(const at::Tensor& x, std::string_view op) {
  TORCH_CHECK(x.defined(), op, ": x must be a defined tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.numel() > 0, op, ": x must be non-empty, got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous (call .contiguous()), got strides ",
              x.strides(), " for shape ", x.sizes());
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), op, ": x must be on CPU or CUDA, got ", x.device());
}

inline void check_scalar_slot(const at::Tensor& t, const at::Tensor& x, std::string_view op,
                              std::string_view name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1, op, ": ", name, " must hold exactly one element, got shape ",
              t.sizes());
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on ", x.device(), " like x, got ",
              t.device());
}

}  // namespace amp8::detail
