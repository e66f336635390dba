#include "plugin/training/throughput.h"

#include <ATen/Context.h>
#include <torch/cuda.h>

#if __has_include(<cuda_runtime_api.h>) && defined(AMP8_WITH_CUDA)
#include <cuda_runtime_api.h>
#define AMP8_HAS_CUDA_RUNTIME 1
#endif

#include <utility>

namespace amp8 {

double dense_bf16_peak_flops(const std::string& device_name) {
  // Most specific names first: "H100 PCIe" before "H100".
  static const std::pair<const char*, double> kPeaks[] = {
      {"H200", 989.4e12}, {"H100 PCIe", 756.0e12}, {"H100 NVL", 835.0e12}, {"H100", 989.4e12},
      {"GH200", 989.4e12}, {"B200", 2250e12}, {"A100", 312e12}, {"L40S", 362.05e12},
  };
  for (const auto& [name, peak] : kPeaks) {
    if (device_name.find(name) != std::string::npos) return peak;
  }
  return 0;
}

std::string cuda_device_name(int index) {
#ifdef AMP8_HAS_CUDA_RUNTIME
  if (!torch::cuda::is_available()) return "";
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, index) != cudaSuccess) return "";
  return properties.name;
#else
  (void)index;
  return "";
#endif
}

}  // namespace amp8
