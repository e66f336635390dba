#pragma once
// The ATen path of a bias gradient: what the fused cast kernels' dbias computes where they do
// not take the shape.

#include <ATen/ATen.h>

namespace amp8::detail {

// out[c] = Σ_r x[r, c] for a 2-D x, accumulated in float32 and rounded once into out's dtype
// (float32, bfloat16 or float16; a contiguous [cols] tensor on x's device).
inline void sum_rows_into(const at::Tensor& out, const at::Tensor& x) {
  if (out.scalar_type() == at::kFloat) {
    at::Tensor handle = out;  // sum_out writes the caller's storage
    at::sum_out(handle, x, {0}, /*keepdim=*/false, at::kFloat);
  } else {
    out.copy_(x.sum(0, /*keepdim=*/false, at::kFloat));
  }
}

}  // namespace amp8::detail
