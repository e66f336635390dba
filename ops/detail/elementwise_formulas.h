#pragma once
// The float32 formulas of Llama's elementwise ops (ops/swiglu.h, ops/rotary.h), shared verbatim
// by the host reference and the CUDA kernels. Products and sums are rounded one by one
// (no fused multiply-add) so that host and device compute the same bits; only expf may differ
// by its last place between the two. No LibTorch or CUDA types here.

#include <cmath>

#include "ops/detail/scale_formula.h"  // AMP8_HOST_DEVICE

namespace amp8::detail {

#if defined(__CUDA_ARCH__)
AMP8_HOST_DEVICE inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
AMP8_HOST_DEVICE inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
AMP8_HOST_DEVICE inline float sub_rn(float a, float b) { return __fsub_rn(a, b); }
#else
AMP8_HOST_DEVICE inline float mul_rn(float a, float b) { return a * b; }
AMP8_HOST_DEVICE inline float add_rn(float a, float b) { return a + b; }
AMP8_HOST_DEVICE inline float sub_rn(float a, float b) { return a - b; }
#endif

// σ(g) = 1 / (1 + e^-g); e^-g overflows to inf for very negative g (σ = 0), as in LibTorch.
AMP8_HOST_DEVICE inline float sigmoid(float g) { return 1.0f / add_rn(1.0f, expf(-g)); }

// SwiGLU of one (gate, up) pair: silu(gate) · up, silu(g) = g · σ(g).
AMP8_HOST_DEVICE inline float swiglu(float gate, float up) {
  return mul_rn(mul_rn(gate, sigmoid(gate)), up);
}

// Its gradients for dy:  d gate = dy · up · σ(g) · (1 + g · (1 - σ(g))),  d up = dy · silu(g).
struct SwiGluGrad {
  float gate, up;
};
AMP8_HOST_DEVICE inline SwiGluGrad swiglu_backward(float dy, float gate, float up) {
  const float s = sigmoid(gate);
  const float dsilu = mul_rn(s, add_rn(1.0f, mul_rn(gate, sub_rn(1.0f, s))));
  return {mul_rn(mul_rn(dy, up), dsilu), mul_rn(dy, mul_rn(gate, s))};
}

// One rotary pair (x0, x1) turned by the angle whose cosine and sine are c and s:
//   (x0 c - x1 s, x0 s + x1 c); by the opposite angle (the backward pass) when `inverse`.
struct RotaryPair {
  float first, second;
};
AMP8_HOST_DEVICE inline RotaryPair rotate_pair(float x0, float x1, float c, float s,
                                               bool inverse) {
  if (inverse) s = -s;
  return {sub_rn(mul_rn(x0, c), mul_rn(x1, s)), add_rn(mul_rn(x0, s), mul_rn(x1, c))};
}

}  // namespace amp8::detail
