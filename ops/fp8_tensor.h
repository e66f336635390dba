#pragma once

#include <ATen/ATen.h>

#include "ops/fp8_format.h"

namespace amp8 {

/// A quantized tensor: FP8 `data` and the float32 `scale_inv` (one element) that maps it back,
/// x ≈ float(data) * scale_inv. `data`'s dtype always matches `format`.
struct Fp8Tensor {
  at::Tensor data;
  at::Tensor scale_inv;
  Fp8Format format = Fp8Format::kE4M3;

  Fp8Tensor() = default;
  /// Checks that data's dtype is format's and that scale_inv is one float32 on data's device.
  Fp8Tensor(at::Tensor data, at::Tensor scale_inv, Fp8Format format);

  bool defined() const { return data.defined(); }
  at::IntArrayRef sizes() const { return data.sizes(); }
  at::Device device() const { return data.device(); }

  /// float(data) * scale_inv, computed in float32 and returned as `dtype`.
  at::Tensor dequantize(at::ScalarType dtype = at::kFloat) const;
};

}  // namespace amp8
