#pragma once
// Small string helpers for parsing option values.

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

namespace amp8::detail {

inline std::string to_lower(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower;
}

}  // namespace amp8::detail
