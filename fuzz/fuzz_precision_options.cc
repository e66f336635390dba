// Fuzzes what users type for the precision plugin: newline-separated fields
//   precision, fp8, fp8_amax_compute_algo, fp8_recipe, fp8_margin, fp8_amax_history_len,
//   fp16_loss_scale, fp16_initial_loss_scale, fp16_hysteresis, num_layers_at_start_in_bf16
// A bad value must be a c10::Error naming the knob; anything else escaping (or a sanitizer
// report) is a finding.
#include "plugin/precision/mixed_precision_plugin.cc"  // the parser under test, instrumented

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace {

int64_t to_int(const std::string& field) {
  int64_t value = 0;
  for (char c : field.substr(0, 18)) value = value * 10 + (c >= '0' && c <= '9' ? c - '0' : 0);
  return field.rfind('-', 0) == 0 ? -value : value;
}

double to_double(const std::string& field) {
  if (field == "inf") return INFINITY;
  if (field == "nan") return NAN;
  return static_cast<double>(to_int(field)) / 8.0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> f;
  std::stringstream stream(std::string(reinterpret_cast<const char*>(data), size));
  for (std::string line; f.size() < 10 && std::getline(stream, line);) f.push_back(line);
  f.resize(10);
  try {
    auto options = amp8::MixedPrecisionOptions(f[0])
                       .fp8(f[1].empty() ? "none" : f[1])
                       .fp8_amax_compute_algo(f[2].empty() ? "max" : f[2])
                       .fp8_recipe(f[3].empty() ? "delayed" : f[3])
                       .fp8_margin(static_cast<int>(to_int(f[4])))
                       .fp8_amax_history_len(f[5].empty() ? 1024 : to_int(f[5]))
                       .fp16_initial_loss_scale(f[7].empty() ? 65536.0 : to_double(f[7]))
                       .fp16_hysteresis(f[8].empty() ? 2 : to_int(f[8]))
                       .num_layers_at_start_in_bf16(to_int(f[9]));
    if (!f[6].empty()) options.fp16_loss_scale(to_double(f[6]));
    options.validate();
    amp8::MixedPrecisionPlugin plugin(options);  // accepted options must build a plugin
    (void)plugin.name();
  } catch (const c10::Error& e) {
    // The message must name what was wrong.
    if (std::string(e.what_without_backtrace()).empty()) __builtin_trap();
  }
  return 0;
}
