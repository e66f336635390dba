#include "ops/fp8_format.h"

#include <ostream>

#include "ops/detail/strings.h"

namespace amp8 {

float fp8_max(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

at::ScalarType fp8_dtype(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

const char* fp8_format_name(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? "e4m3" : "e5m2";
}

Fp8Format fp8_format_from_string(std::string_view name, std::string_view param) {
  const std::string lower = detail::to_lower(name);
  if (lower == "e4m3") return Fp8Format::kE4M3;
  if (lower == "e5m2") return Fp8Format::kE5M2;
  TORCH_CHECK(false, param, " must be \"e4m3\" or \"e5m2\", got \"", name, "\"");
}

Fp8Format fp8_format_of(at::ScalarType dtype, std::string_view param) {
  if (dtype == at::kFloat8_e4m3fn) return Fp8Format::kE4M3;
  if (dtype == at::kFloat8_e5m2) return Fp8Format::kE5M2;
  TORCH_CHECK(false, param, " must be Float8_e4m3fn or Float8_e5m2, got ", dtype);
}

std::ostream& operator<<(std::ostream& os, Fp8Format format) {
  return os << fp8_format_name(format);
}

}  // namespace amp8
