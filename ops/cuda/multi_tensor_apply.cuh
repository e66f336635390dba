#pragma once
// Apex's multi_tensor_apply for the fused optimizers (fused_adam_kernels.cu,
// fused_sgd_kernels.cu): the tensors of a step go to the GPU as tables of up to kCapacity
// entries (one launch each), every tensor cut in chunks of kChunk elements, one block per
// chunk. Each table entry is the caller's own per-tensor struct (with an int64_t `numel`),
// passed as a kernel parameter: no host-to-device copy of pointers, no per-tensor launch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/launch_util.cuh"

namespace amp8::cuda::multi_tensor {

constexpr int kCapacity = 128;      // tensors per launch
constexpr int kThreads = 512;
constexpr int kItemsPerThread = 8;  // 4096 elements per block, loads coalesced across the block
constexpr int64_t kChunk = int64_t{kThreads} * kItemsPerThread;

template <typename Entry>
struct Table {
  Entry entry[kCapacity];
  int first_chunk[kCapacity + 1];  // prefix sums of chunks per tensor
  int num_tensors;
};

// What a block works on: its tensor's entry and the elements [begin, end) of that tensor.
template <typename Entry>
struct Chunk {
  const Entry& tensor;
  int64_t begin, end;
};

template <typename Entry>
__device__ __forceinline__ Chunk<Entry> chunk_of(const Table<Entry>& table) {
  const int chunk = blockIdx.x;
  const int t = entry_of(table.first_chunk, table.num_tensors, chunk);
  const int64_t begin = int64_t{chunk - table.first_chunk[t]} * kChunk;
  return {table.entry[t], begin, min(begin + kChunk, table.entry[t].numel)};
}

// Element i of the chunk's k-th item for this thread, coalesced across the block.
__device__ __forceinline__ int64_t item(int64_t begin, int k) {
  return begin + int64_t{k} * kThreads + threadIdx.x;
}

// The model's copy of an updated master value: Copy = void writes nothing.
template <typename Copy>
__device__ __forceinline__ void store_copy(void* copy, int64_t i, float value) {
  if constexpr (std::is_same_v<Copy, __nv_bfloat16>) {
    static_cast<__nv_bfloat16*>(copy)[i] = __float2bfloat16_rn(value);
  } else if constexpr (std::is_same_v<Copy, __half>) {
    static_cast<__half*>(copy)[i] = __float2half_rn(value);
  }
}

// Launches kernel<<<chunks, kThreads>>>(table, scalars) once per kCapacity tensors; returns the
// first launch error (cudaErrorInvalidValue for more than INT32_MAX chunks in one table).
template <typename Entry, typename Scalars>
int apply(void (*kernel)(Table<Entry>, Scalars), const Entry* tensors, int num_tensors,
          const Scalars& scalars, Stream stream) {
  static_assert(sizeof(Table<Entry>) + sizeof(Scalars) + 16 < 32764, "kernel parameters too large");
  for (int first = 0; first < num_tensors; first += kCapacity) {
    const int count = std::min(kCapacity, num_tensors - first);
    Table<Entry> table{};
    table.num_tensors = count;
    int64_t chunks = 0;
    for (int j = 0; j < count; ++j) {
      table.entry[j] = tensors[first + j];
      table.first_chunk[j] = static_cast<int>(chunks);
      chunks += (tensors[first + j].numel + kChunk - 1) / kChunk;
    }
    table.first_chunk[count] = static_cast<int>(chunks);
    if (chunks == 0) continue;
    if (chunks > INT32_MAX) return static_cast<int>(cudaErrorInvalidValue);
    kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(table, scalars);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return static_cast<int>(cudaSuccess);
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(Grad{}, TypeTag<Copy>{}) for the launch's gradient and copy types (Copy = void: no
// copy); returns f's error code.
template <typename F>
int dispatch(InputType grad_type, CopyType copy_type, F&& f) {
  return dispatch_input(grad_type, [&](auto grad) {
    switch (copy_type) {
      case CopyType::kNone:
        return f(grad, TypeTag<void>{});
      case CopyType::kBFloat16:
        return f(grad, TypeTag<__nv_bfloat16>{});
      case CopyType::kHalf:
        return f(grad, TypeTag<__half>{});
      case CopyType::kFloat8E4M3:  // Adam's alone: launch_fused_adam dispatches it itself
        break;
    }
    return static_cast<int>(cudaErrorInvalidValue);
  });
}

}  // namespace amp8::cuda::multi_tensor
