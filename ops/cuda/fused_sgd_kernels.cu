// Multi-tensor SGD (momentum, dampening, nesterov, weight decay) over FP32 master weights
// (Apex's multi_tensor_sgd, TE's FusedSGD): one pass reads each element's master, momentum
// buffer and gradient and writes the master, the buffer and the model's half copy.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/launch_util.cuh"

namespace amp8::cuda {
namespace {

constexpr int kCapacity = 128;      // tensors per launch
constexpr int kThreads = 512;
constexpr int kItemsPerThread = 8;  // 4096 elements per block, loads coalesced across the block
constexpr int64_t kChunk = int64_t{kThreads} * kItemsPerThread;

struct SgdTable {
  float* param[kCapacity];
  float* momentum_buffer[kCapacity];
  const void* grad[kCapacity];
  void* model_copy[kCapacity];
  int64_t numel[kCapacity];
  bool first_step[kCapacity];
  int first_chunk[kCapacity + 1];  // prefix sums of chunks per tensor
  int num_tensors;
};
static_assert(sizeof(SgdTable) + sizeof(SgdScalars) + 16 < 32764, "kernel parameters too large");

template <typename Copy>
__device__ __forceinline__ void store_copy(void* copy, int64_t i, float value) {
  if constexpr (std::is_same_v<Copy, __nv_bfloat16>) {
    static_cast<__nv_bfloat16*>(copy)[i] = __float2bfloat16_rn(value);
  } else if constexpr (std::is_same_v<Copy, __half>) {
    static_cast<__half*>(copy)[i] = __float2half_rn(value);
  }
}

// Copy = void: no model copy.
template <typename Grad, typename Copy>
__global__ void __launch_bounds__(kThreads)
    fused_sgd_kernel(const __grid_constant__ SgdTable table, const SgdScalars s) {
  const int chunk = blockIdx.x;
  const int t = entry_of(table.first_chunk, table.num_tensors, chunk);
  const int64_t begin = int64_t{chunk - table.first_chunk[t]} * kChunk;
  const int64_t end = min(begin + kChunk, table.numel[t]);
  float* param = table.param[t];
  float* buffer = table.momentum_buffer[t];
  const Grad* grad = static_cast<const Grad*>(table.grad[t]);
  void* copy = table.model_copy[t];
  const bool first_step = table.first_step[t];

#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int64_t i = begin + int64_t{k} * kThreads + threadIdx.x;
    if (i >= end) break;
    // torch::optim::SGD's operations in their order, each rounded as ATen's CUDA kernels round
    // it (explicit intrinsics: no contraction left to the compiler): x.mul(s) one product;
    // x.add(y, a) / x.add_(y, a) fma(a, y, x).
    float d = to_float(grad[i]);
    if (s.grad_multiplier != 1.0f) d = __fmul_rn(d, s.grad_multiplier);
    float p = param[i];
    if (s.weight_decay != 0.0f) d = __fmaf_rn(s.weight_decay, p, d);
    if (s.momentum != 0.0f) {
      const float b =
          first_step ? d : __fmaf_rn(s.one_minus_dampening, d, __fmul_rn(buffer[i], s.momentum));
      buffer[i] = b;
      d = s.nesterov ? __fmaf_rn(s.momentum, b, d) : b;
    }
    p = __fmaf_rn(s.neg_lr, d, p);
    param[i] = p;
    if constexpr (!std::is_void_v<Copy>) store_copy<Copy>(copy, i, p);
  }
}

template <typename Grad, typename Copy>
int launch_batches(const SgdTensorPointers* tensors, int num_tensors, const SgdScalars& s,
                   Stream stream) {
  for (int first = 0; first < num_tensors; first += kCapacity) {
    const int count = std::min(kCapacity, num_tensors - first);
    SgdTable table{};
    table.num_tensors = count;
    int64_t chunks = 0;
    for (int j = 0; j < count; ++j) {
      const auto& t = tensors[first + j];
      table.param[j] = t.param;
      table.momentum_buffer[j] = t.momentum_buffer;
      table.grad[j] = t.grad;
      table.model_copy[j] = t.model_copy;
      table.numel[j] = t.numel;
      table.first_step[j] = t.first_step;
      table.first_chunk[j] = static_cast<int>(chunks);
      chunks += (t.numel + kChunk - 1) / kChunk;
    }
    table.first_chunk[count] = static_cast<int>(chunks);
    if (chunks == 0) continue;
    if (chunks > INT32_MAX) return static_cast<int>(cudaErrorInvalidValue);
    fused_sgd_kernel<Grad, Copy><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(table, s);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return static_cast<int>(cudaSuccess);
}

}  // namespace

int launch_fused_sgd(const SgdTensorPointers* tensors, int num_tensors, InputType grad_type,
                     CopyType copy_type, const SgdScalars& scalars, Stream stream) {
  return dispatch_input(grad_type, [&](auto grad) {
    using Grad = decltype(grad);
    switch (copy_type) {
      case CopyType::kNone:
        return launch_batches<Grad, void>(tensors, num_tensors, scalars, stream);
      case CopyType::kBFloat16:
        return launch_batches<Grad, __nv_bfloat16>(tensors, num_tensors, scalars, stream);
      case CopyType::kHalf:
        return launch_batches<Grad, __half>(tensors, num_tensors, scalars, stream);
    }
    return static_cast<int>(cudaErrorInvalidValue);
  });
}

}  // namespace amp8::cuda
