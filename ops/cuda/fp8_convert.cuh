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

// The scale a launch quantizes with; its inverse (what the GEMM reads) is written once, by the
// first thread of the first block, where the caller wants it.
__device__ __forceinline__ float load_scale(const float* __restrict__ scale_ptr, float* __restrict__ scale_inv) {
  const float scale = *scale_ptr;
  if (scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    *scale_inv = 1.0f / scale;
  }
  return scale;
}

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

// The NaN rules of saturating_cast applied to one byte of a paired conversion.
__device__ __forceinline__ uint32_t fix_nan(uint32_t converted, float v, float y) {
  if (isnan(v)) return signbit(v) ? 0xFFu : 0x7Fu;
  if (isnan(y)) return 0x7Fu;
  return converted;
}

// How a paired conversion applies saturating_cast's rules. Both give saturating_cast's bytes;
// which runs faster depends on the kernel around it (one H100, cast_transpose_bench,
// bench/results/blockwise_mlp_fusion/):
// - kClamp clamps each product to ±max and applies the NaN rules to each byte, without a branch.
//   The tensorwise cast_transpose kernels run 1.05–1.5× faster with it than with kNanBranch.
// - kNanBranch leaves ±inf and values beyond the format to the conversion's .satfinite, which
//   takes them to ±max as the clamp does, and applies the NaN rules only where a product is NaN
//   (a NaN input, or 0 · inf): a test per pair, and a branch a warp never takes on finite data.
//   The instruction-bound blockwise kernels run 1.02–1.33× faster with it, the tensorwise
//   quantize 1.05–1.10×.
enum class Fp8CastMode { kClamp, kNanBranch };

// Two values, each with its own scale, in one paired conversion: byte 0 is v0's.
template <bool kE5M2, Fp8CastMode kMode = Fp8CastMode::kClamp>
__device__ __forceinline__ uint32_t saturating_cast2(float v0, float v1, float scale0,
                                                     float scale1) {
  const float y0 = v0 * scale0, y1 = v1 * scale1;
  if constexpr (kMode == Fp8CastMode::kNanBranch) {
    const uint32_t pair = __nv_cvt_float2_to_fp8x2(make_float2(y0, y1), __NV_SATFINITE,
                                                   Fp8Traits<kE5M2>::kInterpretation);
    if (!isnan(y0) && !isnan(y1)) return pair;
    return fix_nan(pair & 0xFFu, v0, y0) | (fix_nan(pair >> 8, v1, y1) << 8);
  } else {
    constexpr float kMax = Fp8Traits<kE5M2>::kMax;
    const float2 clamped =
        make_float2(fminf(fmaxf(y0, -kMax), kMax), fminf(fmaxf(y1, -kMax), kMax));
    const uint32_t pair =
        __nv_cvt_float2_to_fp8x2(clamped, __NV_SATFINITE, Fp8Traits<kE5M2>::kInterpretation);
    return fix_nan(pair & 0xFFu, v0, y0) | (fix_nan(pair >> 8, v1, y1) << 8);
  }
}

template <bool kE5M2, Fp8CastMode kMode = Fp8CastMode::kClamp>
__device__ __forceinline__ uint32_t saturating_cast2(float v0, float v1, float scale) {
  return saturating_cast2<kE5M2, kMode>(v0, v1, scale, scale);
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
// The hardware conversion (cvt.f32.f16) gives a NaN without its sign; LibTorch's conversion, and
// so the CPU reference, keeps it, and a negative NaN quantizes to 0xFF.
__device__ __forceinline__ float to_float(__half v) {
  const float f = __half2float(v);
  if (!isnan(f)) return f;
  return __uint_as_float((static_cast<uint32_t>(__half_as_ushort(v) & 0x8000u) << 16) | 0x7FC00000u);
}

// float32 → T, rounded to nearest even.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// Two float32 values rounded to nearest even into T, `lo` in the low 16 bits: the word two
// consecutive T hold in memory.
template <typename T>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t round_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}
template <>
__device__ __forceinline__ uint32_t round_pair<__half>(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

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

// Quantizes 8 values into 8 bytes (value j in byte j), folding |v| into max_bits.
template <bool kE5M2, Fp8CastMode kMode = Fp8CastMode::kClamp>
__device__ __forceinline__ uint64_t saturating_cast8(const float (&v)[8], float scale,
                                                     uint32_t& max_bits) {
  uint64_t packed = 0;
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    max_bits = max(max_bits, max(abs_bits(v[j]), abs_bits(v[j + 1])));
    const uint32_t pair = saturating_cast2<kE5M2, kMode>(v[j], v[j + 1], scale);
    packed |= static_cast<uint64_t>(pair) << (8 * j);
  }
  return packed;
}

template <bool kE5M2, Fp8CastMode kMode = Fp8CastMode::kClamp, typename T>
__device__ __forceinline__ uint64_t saturating_cast8(const Pack8<T>& pack, float scale,
                                                     uint32_t& max_bits) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = to_float(pack.v[j]);
  return saturating_cast8<kE5M2, kMode>(v, scale, max_bits);
}

}  // namespace amp8::cuda
