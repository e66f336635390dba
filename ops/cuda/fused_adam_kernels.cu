// Multi-tensor Adam / AdamW over FP32 master weights (Apex's multi_tensor_apply, TE's FusedAdam
// with master weights): one pass reads each element's master, moments and gradient and writes
// the master, the moments and the model's half copy.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/launch_util.cuh"

namespace amp8::cuda {
namespace {

constexpr int kCapacity = 128;      // tensors per launch
constexpr int kThreads = 512;
constexpr int kItemsPerThread = 8;  // 4096 elements per block, loads coalesced across the block
constexpr int64_t kChunk = int64_t{kThreads} * kItemsPerThread;

struct AdamTable {
  float* param[kCapacity];
  float* exp_avg[kCapacity];
  float* exp_avg_sq[kCapacity];
  const void* grad[kCapacity];
  void* model_copy[kCapacity];
  int64_t numel[kCapacity];
  float step_size[kCapacity];
  float bias_correction2_sqrt[kCapacity];
  int first_chunk[kCapacity + 1];  // prefix sums of chunks per tensor
  int num_tensors;
};
static_assert(sizeof(AdamTable) + sizeof(AdamScalars) + 16 < 32764, "kernel parameters too large");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

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
    fused_adam_kernel(const __grid_constant__ AdamTable table, const AdamScalars s) {
  const int chunk = blockIdx.x;
  const int t = entry_of(table.first_chunk, table.num_tensors, chunk);
  const int64_t begin = int64_t{chunk - table.first_chunk[t]} * kChunk;
  const int64_t end = min(begin + kChunk, table.numel[t]);
  float* param = table.param[t];
  float* exp_avg = table.exp_avg[t];
  float* exp_avg_sq = table.exp_avg_sq[t];
  const Grad* grad = static_cast<const Grad*>(table.grad[t]);
  void* copy = table.model_copy[t];
  const float neg_step_size = -table.step_size[t];
  const float inv_bias_correction2_sqrt = 1.0f / table.bias_correction2_sqrt[t];

#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int64_t i = begin + int64_t{k} * kThreads + threadIdx.x;
    if (i >= end) break;
    // torch::optim::Adam / AdamW's operations in their order, each rounded as ATen's CUDA
    // kernels round it (explicit intrinsics: no contraction left to the compiler):
    // x.mul_(s) one product; x.add_(y, a) fma(a, y, x); x.addcmul_(y, y, a) fma(a·y, y, x);
    // x / scalar a product with the scalar's float reciprocal; x.addcdiv_(y, z, a) fma(a, y/z, x).
    float g = to_float(grad[i]);
    if (s.grad_multiplier != 1.0f) g = __fmul_rn(g, s.grad_multiplier);
    float p = param[i];
    if (s.param_decay != 1.0f) p = __fmul_rn(p, s.param_decay);
    if (s.weight_decay_l2 != 0.0f) g = __fmaf_rn(s.weight_decay_l2, p, g);
    const float m = __fmaf_rn(s.one_minus_beta1, g, __fmul_rn(exp_avg[i], s.beta1));
    const float v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], s.beta2));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_bias_correction2_sqrt), s.eps);
    p = __fmaf_rn(neg_step_size, __fdiv_rn(m, denom), p);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (!std::is_void_v<Copy>) store_copy<Copy>(copy, i, p);
  }
}

template <typename Grad, typename Copy>
int launch_batches(const AdamTensorPointers* tensors, int num_tensors, const AdamScalars& s,
                   Stream stream) {
  for (int first = 0; first < num_tensors; first += kCapacity) {
    const int count = std::min(kCapacity, num_tensors - first);
    AdamTable table{};
    table.num_tensors = count;
    int64_t chunks = 0;
    for (int j = 0; j < count; ++j) {
      const auto& t = tensors[first + j];
      table.param[j] = t.param;
      table.exp_avg[j] = t.exp_avg;
      table.exp_avg_sq[j] = t.exp_avg_sq;
      table.grad[j] = t.grad;
      table.model_copy[j] = t.model_copy;
      table.numel[j] = t.numel;
      table.step_size[j] = t.step_size;
      table.bias_correction2_sqrt[j] = t.bias_correction2_sqrt;
      table.first_chunk[j] = static_cast<int>(chunks);
      chunks += (t.numel + kChunk - 1) / kChunk;
    }
    table.first_chunk[count] = static_cast<int>(chunks);
    if (chunks == 0) continue;
    if (chunks > INT32_MAX) return static_cast<int>(cudaErrorInvalidValue);
    fused_adam_kernel<Grad, Copy><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(table, s);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return static_cast<int>(cudaSuccess);
}

}  // namespace

int launch_fused_adam(const AdamTensorPointers* tensors, int num_tensors, InputType grad_type,
                      CopyType copy_type, const AdamScalars& scalars, Stream stream) {
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
