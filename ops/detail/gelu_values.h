#pragma once
// The CPU reference of the GELU-fused casts (cast_transpose_gelu / _dgelu, quantize_blockwise_gelu
// / _dgelu): the values they quantize, by the formula their kernels use.

#include <ATen/ATen.h>

namespace amp8::detail {

// gelu(x) or, with `gate` (GELU's input, x's shape and dtype), x · gelu'(gate): GELU's tanh
// approximation (ops/detail/gelu_formula.h) in float32, returned as float32.
at::Tensor gelu_values_cpu(const at::Tensor& x, const at::Tensor& gate);

}  // namespace amp8::detail
