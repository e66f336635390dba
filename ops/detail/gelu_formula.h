#pragma once
// GELU's tanh approximation and its derivative, shared verbatim by the host reference and the
// CUDA kernels (LibTorch's gelu / gelu_backward with approximate="tanh", in float32, with tanh
// computed from an exponential). No LibTorch or CUDA types here.

#include <cmath>

#include "ops/detail/scale_formula.h"  // AMP8_HOST_DEVICE

namespace amp8::detail {

inline constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluKappa = 0.044715f;

// tanh(u) = 1 - 2 / (1 + e^(2u)): one exponential and one division, a third of tanhf's work
// on the GPU, where it made the GELU-fused casts compute-bound (bench/results). e^(2u)
// overflows to inf for large u (tanh = 1) and underflows to 0 for very negative u (tanh = -1);
// the absolute error stays at float32's resolution of 1, which is what GELU and its derivative
// need (both add tanh to 1 or subtract its square from 1).
AMP8_HOST_DEVICE inline float tanh_via_exp(float u) {
#if defined(__CUDA_ARCH__)
  return 1.0f - __fdividef(2.0f, 1.0f + __expf(2.0f * u));
#else
  return 1.0f - 2.0f / (1.0f + expf(2.0f * u));
#endif
}

// 0.5 x (1 + tanh(β (x + κ x³)))
AMP8_HOST_DEVICE inline float gelu_tanh(float x) {
  const float inner = kGeluBeta * (x + kGeluKappa * x * x * x);
  return 0.5f * x * (1.0f + tanh_via_exp(inner));
}

// dy · d gelu_tanh(x) / dx
AMP8_HOST_DEVICE inline float gelu_tanh_backward(float dy, float x) {
  const float x_sq = x * x;
  const float inner = kGeluBeta * (x + kGeluKappa * x_sq * x);
  const float tanh_inner = tanh_via_exp(inner);
  const float left = 0.5f * x;
  const float right = 1.0f + tanh_inner;
  const float left_derivative = 0.5f * right;
  const float right_derivative =
      left * (1.0f - tanh_inner * tanh_inner) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * x_sq);
  return dy * (left_derivative + right_derivative);
}

}  // namespace amp8::detail
