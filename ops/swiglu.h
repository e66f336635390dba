#pragma once

#include <ATen/ATen.h>

namespace amp8 {

// SwiGLU over a fused gate/up projection, the output of one Linear with 2·ffn features, gate
// first (Llama's MLP with w1 and w3 stacked):
//   out[..., j] = silu(gate_up[..., j]) · gate_up[..., ffn + j],  silu(g) = g / (1 + e^-g).
// One read of gate_up and one write of out, computed in float32 and rounded once to
// gate_up's dtype (LibTorch's silu(gate) * up rounds twice). CPU reference and CUDA kernel
// (ops/detail/elementwise_formulas.h) agree but for expf's last place.
//
// gate_up: float32, bfloat16 or float16, contiguous, non-empty, last dimension even.
/// out [..., ffn] in gate_up's dtype.
at::Tensor swiglu(const at::Tensor& gate_up);

/// The gradient of swiglu for grad [..., ffn] (contiguous, gate_up's dtype, shape and device):
///   d gate = grad · up · σ(gate) · (1 + gate · (1 - σ(gate))),  d up = grad · silu(gate),
/// as one tensor shaped like gate_up (gate's half first).
at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& gate_up);

}  // namespace amp8
