#include "plugin/precision/autocast_guard.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace amp8 {

AutocastGuard::AutocastGuard(c10::ScalarType dtype, std::vector<c10::DeviceType> devices,
                             bool enabled) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "AutocastGuard: dtype must be bfloat16, float16 or float32, got ", dtype);
  for (const auto device : devices) {
    TORCH_CHECK(at::autocast::is_autocast_available(device),
                "AutocastGuard: autocast is not available for device type ", device);
    saved_.push_back({device, at::autocast::is_autocast_enabled(device),
                      at::autocast::get_autocast_dtype(device)});
    at::autocast::set_autocast_enabled(device, enabled);
    at::autocast::set_autocast_dtype(device, dtype);
  }
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  for (const auto& saved : saved_) {
    at::autocast::set_autocast_enabled(saved.device, saved.enabled);
    at::autocast::set_autocast_dtype(saved.device, saved.dtype);
  }
}

}  // namespace amp8
