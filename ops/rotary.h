#pragma once

#include <ATen/ATen.h>

namespace amp8 {

// Rotary position embeddings in Meta's Llama layout: dimensions 2i and 2i+1 of every head are a
// pair turned by the angle position · θ_i,
//   out[b, t, h, 2i]     = x[b, t, h, 2i] · cos[t, i] - x[b, t, h, 2i+1] · sin[t, i]
//   out[b, t, h, 2i + 1] = x[b, t, h, 2i] · sin[t, i] + x[b, t, h, 2i+1] · cos[t, i]
// computed in float32 (each product and sum rounded on its own, as LibTorch's float32 ops do)
// and rounded once to x's dtype. One read of x and one write of out, where LibTorch's
// formulation takes a dozen kernels. CPU reference and CUDA kernel agree bit for bit.
//
// x: [batch, seq, heads, head_dim], float32, bfloat16 or float16, non-empty, head_dim even,
//    its last dimension contiguous (stride 1); the other strides are free, so x may be a view
//    of the Q or K columns of a fused QKV projection's output.
// cos, sin: float32 [seq, head_dim / 2], contiguous, on x's device.
// inverse: turn by the opposite angles. A rotation's gradient is the inverse rotation of the
//    output's gradient, so the backward pass is rotary_embedding(grad, cos, sin, true).
/// out: contiguous [batch, seq, heads, head_dim] in x's dtype.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            bool inverse = false);

}  // namespace amp8
