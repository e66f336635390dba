#pragma once
// The activation a fused cast applies to what it loads (CastActivation, kernels.h), on a thread's
// 8 values, in float32, by the formulas the CPU references use (ops/detail/gelu_formula.h,
// ops/detail/elementwise_formulas.h).

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/kernels.h"
#include "ops/detail/elementwise_formulas.h"
#include "ops/detail/gelu_formula.h"

namespace amp8::cuda {

// The value the cast quantizes, from x (and, for kDGelu, the GELU's input `gate`; for kSwiGlu,
// the up projection), in float32.
template <CastActivation kAct, typename T>
__device__ __forceinline__ void activate8(const Pack8<T>& x, const Pack8<T>& gate, float (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float xj = to_float(x.v[j]);
    if constexpr (kAct == CastActivation::kGelu) {
      v[j] = detail::gelu_tanh(xj);
    } else if constexpr (kAct == CastActivation::kDGelu) {
      v[j] = detail::gelu_tanh_backward(xj, to_float(gate.v[j]));
    } else if constexpr (kAct == CastActivation::kSwiGlu) {
      v[j] = detail::swiglu(xj, to_float(gate.v[j]));
    } else {
      v[j] = xj;
    }
  }
}

}  // namespace amp8::cuda
