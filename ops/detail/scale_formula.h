#pragma once
// The one scale formula, shared verbatim by the host reference and the CUDA kernels so that
// both round identically. No LibTorch or CUDA types here.

#include <cfloat>
#include <cmath>

#if defined(__CUDACC__)
#define AMP8_HOST_DEVICE __host__ __device__
#else
#define AMP8_HOST_DEVICE
#endif

namespace amp8::detail {

// margin_divisor is 2^margin, exact in float32.
AMP8_HOST_DEVICE inline float scale_from_amax(float amax, float fallback, float fp8_max,
                                              float margin_divisor) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return fallback;
  float scale = (fp8_max / amax) / margin_divisor;
  if (std::isinf(scale)) scale = FLT_MAX;
  return scale;
}

// NaN-propagating max (torch.max semantics).
AMP8_HOST_DEVICE inline float nan_max(float a, float b) { return (a > b || std::isnan(a)) ? a : b; }

}  // namespace amp8::detail
