#pragma once
// Host-side helpers shared by the kernel launchers (ops/cuda/*.cu).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/kernels.h"

namespace amp8::cuda {

// Streaming multiprocessors of the current device (queried once).
inline int num_sms() {
  static const int value = [] {
    int device = 0, sms = 132;
    if (cudaGetDevice(&device) == cudaSuccess) {
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    return sms;
  }();
  return value;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(T{}) with T the element type of `type`; returns f's error code.
template <typename F>
int dispatch_input(InputType type, F&& f) {
  switch (type) {
    case InputType::kFloat:
      return f(float{});
    case InputType::kBFloat16:
      return f(__nv_bfloat16{});
    case InputType::kHalf:
      return f(__half{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace amp8::cuda
