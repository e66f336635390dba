#pragma once
// Helpers shared by the kernel files (ops/cuda/*.cu): launch-side queries and dispatch, and the
// device-side lookup of multi-tensor launches.

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
inline bool aligned8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }

// Blocks for `work` items of `threads`-thread blocks, one item per thread, capped at a few
// waves: elementwise kernels walk the rest grid-stride.
inline unsigned grid_stride_blocks(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(num_sms()) * 16;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

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

// Calls f(row, column) for the first column of every kVec-wide group of a [rows, cols] grid
// (cols a multiple of kVec), the groups spread grid-stride over the launch: the loop of an
// elementwise kernel that moves kVec elements per thread.
template <int kVec, typename F>
__device__ __forceinline__ void for_each_column_group(int64_t rows, int64_t cols, F&& f) {
  const int64_t groups = cols / kVec;
  const int64_t total = rows * groups;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    f(v / groups, (v % groups) * kVec);
  }
}

// Multi-tensor launches pass a table of entries (tensors, scaling groups) with the prefix sums
// `first[0..count]` of their sizes in blocks or slots: the entry that flattened index `index`
// falls in is the last i with first[i] <= index (binary search; `count` >= 1).
__device__ __forceinline__ int entry_of(const int* first, int count, int index) {
  int entry = 0;
  for (int hi = count - 1; entry < hi;) {
    const int mid = (entry + hi + 1) / 2;
    if (first[mid] <= index)
      entry = mid;
    else
      hi = mid - 1;
  }
  return entry;
}

}  // namespace amp8::cuda
