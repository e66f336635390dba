#pragma once
// The CPU reference of saturating FP8 quantization, element by element. The CUDA kernels
// (ops/cuda/fp8_convert.cuh) implement exactly these rules.

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace amp8::detail {

template <typename Fp8T>
inline Fp8T saturating_cast_cpu(float v, float scale, float fp8_max) {
  if (std::isnan(v)) return Fp8T(v);  // NaN stays NaN, keeping its sign
  float y = v * scale;
  if (std::isnan(y)) return Fp8T(std::numeric_limits<float>::quiet_NaN());  // e.g. inf * 0
  y = std::min(std::max(y, -fp8_max), fp8_max);
  return Fp8T(y);  // round to nearest even
}

}  // namespace amp8::detail
