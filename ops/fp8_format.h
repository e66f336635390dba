#pragma once

#include <ATen/ATen.h>

#include <string>
#include <string_view>

namespace amp8 {

/// The two FP8 encodings of Hopper's tensor cores (OCP FP8).
///   E4M3: 4 exponent bits, 3 mantissa bits, no infinities, max finite 448.
///   E5M2: 5 exponent bits, 2 mantissa bits, IEEE-like, max finite 57344.
enum class Fp8Format { kE4M3, kE5M2 };

/// Largest finite value of `format`: 448 for E4M3, 57344 for E5M2.
float fp8_max(Fp8Format format);

/// LibTorch dtype holding `format`: at::kFloat8_e4m3fn or at::kFloat8_e5m2.
at::ScalarType fp8_dtype(Fp8Format format);

/// "e4m3" or "e5m2".
const char* fp8_format_name(Fp8Format format);

/// Parses "e4m3" / "e5m2" (case-insensitive). Throws c10::Error naming `param` and the accepted
/// values otherwise: `format must be "e4m3" or "e5m2", got "e5m3"`.
Fp8Format fp8_format_from_string(std::string_view name, std::string_view param = "format");

/// The format stored in a tensor of dtype `dtype`; throws when `dtype` is not an FP8 dtype.
Fp8Format fp8_format_of(at::ScalarType dtype, std::string_view param = "dtype");

std::ostream& operator<<(std::ostream& os, Fp8Format format);

}  // namespace amp8
