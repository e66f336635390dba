#pragma once
// Device-side saturating FP8 conversion: the same rules as ops/detail/fp8_cpu.h.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace amp8::cuda {

template <bool kE5M2>
struct Fp8Traits {
  static constexpr float kMax = 448.0f;
  static constexpr __nv_fp8_interpretation_t kInterpretation = __NV_E4M3;
};
template <>
struct Fp8Traits<true> {
  static constexpr float kMax = 57344.0f;
  static constexpr __nv_fp8_interpretation_t kInterpretation = __NV_E5M2;
};

template <bool kE5M2>
__device__ __forceinline__ uint8_t saturating_cast(float v, float scale) {
  // NaN keeps its sign, as LibTorch's conversion does on the CPU; both formats encode it 0x7F.
  if (isnan(v)) return signbit(v) ? 0xFF : 0x7F;
  float y = v * scale;
  if (isnan(y)) return 0x7F;
  y = fminf(fmaxf(y, -Fp8Traits<kE5M2>::kMax), Fp8Traits<kE5M2>::kMax);
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(y, __NV_SATFINITE, Fp8Traits<kE5M2>::kInterpretation));
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// |v| as ordered bits: for non-negative floats integer order is float order, and a NaN
// (sign cleared) compares above +inf, so a max over these bits propagates NaN.
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// Block-wide max of `bits`, then one atomicMax into *amax (which the launcher zeroed).
// Every thread of the block must call it; block sizes are multiples of 32.
__device__ __forceinline__ void block_amax_to_global(uint32_t bits, float* amax) {
  __shared__ uint32_t warp_max[32];
  const int linear = threadIdx.y * blockDim.x + threadIdx.x;
  const int num_warps = (blockDim.x * blockDim.y) / 32;
  bits = __reduce_max_sync(0xffffffffu, bits);
  if (linear % 32 == 0) warp_max[linear / 32] = bits;
  __syncthreads();
  if (linear < 32) {
    uint32_t m = linear < num_warps ? warp_max[linear] : 0u;
    m = __reduce_max_sync(0xffffffffu, m);
    if (linear == 0 && m != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
  }
}

template <typename T>
struct alignas(sizeof(T) * 8 > 16 ? 16 : sizeof(T) * 8) Pack8 {
  T v[8];
};

}  // namespace amp8::cuda
