// SwiGLU and its gradient over a fused [rows, 2·ffn] gate/up tensor (ops/swiglu.h): one
// elementwise pass each, the formulas in ops/detail/elementwise_formulas.h.

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/detail/elementwise_formulas.h"

namespace amp8::cuda {
namespace {

constexpr int kThreads = 256;
unsigned grid_for(int64_t work) { return grid_stride_blocks(work, kThreads); }

// kVec = 8: eight columns per thread through 16-byte accesses (ffn % 8 == 0, aligned
// pointers); kVec = 1: one column per thread, any shape.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t ffn) {
  for_each_column_group<kVec>(rows, ffn, [&](int64_t r, int64_t j) {
    const T* gate = gate_up + r * 2 * ffn + j;
    if constexpr (kVec == 8) {
      const auto g = *reinterpret_cast<const Pack8<T>*>(gate);
      const auto u = *reinterpret_cast<const Pack8<T>*>(gate + ffn);
      Pack8<T> y;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        y.v[k] = from_float<T>(detail::swiglu(to_float(g.v[k]), to_float(u.v[k])));
      }
      *reinterpret_cast<Pack8<T>*>(out + r * ffn + j) = y;
    } else {
      out[r * ffn + j] = from_float<T>(detail::swiglu(to_float(gate[0]), to_float(gate[ffn])));
    }
  });
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ gate_up,
                           T* __restrict__ grad_gate_up, int64_t rows, int64_t ffn) {
  for_each_column_group<kVec>(rows, ffn, [&](int64_t r, int64_t j) {
    const T* gate = gate_up + r * 2 * ffn + j;
    T* grad_gate = grad_gate_up + r * 2 * ffn + j;
    if constexpr (kVec == 8) {
      const auto dy = *reinterpret_cast<const Pack8<T>*>(grad + r * ffn + j);
      const auto g = *reinterpret_cast<const Pack8<T>*>(gate);
      const auto u = *reinterpret_cast<const Pack8<T>*>(gate + ffn);
      Pack8<T> dg, du;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const auto d = detail::swiglu_backward(to_float(dy.v[k]), to_float(g.v[k]), to_float(u.v[k]));
        dg.v[k] = from_float<T>(d.gate);
        du.v[k] = from_float<T>(d.up);
      }
      *reinterpret_cast<Pack8<T>*>(grad_gate) = dg;
      *reinterpret_cast<Pack8<T>*>(grad_gate + ffn) = du;
    } else {
      const auto d = detail::swiglu_backward(to_float(grad[r * ffn + j]), to_float(gate[0]),
                                             to_float(gate[ffn]));
      grad_gate[0] = from_float<T>(d.gate);
      grad_gate[ffn] = from_float<T>(d.up);
    }
  });
}

}  // namespace

int launch_swiglu(const void* gate_up, InputType type, void* out, int64_t rows, int64_t ffn,
                  Stream stream) {
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const auto* in = static_cast<const T*>(gate_up);
    auto* dst = static_cast<T*>(out);
    if (ffn % 8 == 0 && aligned16(in) && aligned16(dst)) {
      swiglu_kernel<T, 8><<<grid_for(rows * ffn / 8), kThreads, 0, stream>>>(in, dst, rows, ffn);
    } else {
      swiglu_kernel<T, 1><<<grid_for(rows * ffn), kThreads, 0, stream>>>(in, dst, rows, ffn);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

int launch_swiglu_backward(const void* grad, const void* gate_up, InputType type,
                           void* grad_gate_up, int64_t rows, int64_t ffn, Stream stream) {
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const auto* dy = static_cast<const T*>(grad);
    const auto* in = static_cast<const T*>(gate_up);
    auto* dst = static_cast<T*>(grad_gate_up);
    if (ffn % 8 == 0 && aligned16(dy) && aligned16(in) && aligned16(dst)) {
      swiglu_backward_kernel<T, 8>
          <<<grid_for(rows * ffn / 8), kThreads, 0, stream>>>(dy, in, dst, rows, ffn);
    } else {
      swiglu_backward_kernel<T, 1>
          <<<grid_for(rows * ffn), kThreads, 0, stream>>>(dy, in, dst, rows, ffn);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace amp8::cuda
