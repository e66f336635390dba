#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <vector>

namespace amp8 {

/// RAII at::autocast region (torch.autocast in C++): on construction it turns autocast on with
/// `dtype` for each device type in `devices`; on destruction it restores the enabled state and
/// the dtype each had, and clears the autocast cast cache when the outermost region closes.
/// Nests like torch.autocast.
///
///   { amp8::AutocastGuard autocast(at::kBFloat16); y = model->forward(x); }
class AutocastGuard {
 public:
  explicit AutocastGuard(c10::ScalarType dtype,
                         std::vector<c10::DeviceType> devices = {c10::DeviceType::CPU,
                                                                 c10::DeviceType::CUDA},
                         bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  struct Saved {
    c10::DeviceType device;
    bool enabled;
    c10::ScalarType dtype;
  };
  std::vector<Saved> saved_;
};

}  // namespace amp8
