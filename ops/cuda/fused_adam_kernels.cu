// Multi-tensor Adam / AdamW over FP32 master weights (Apex's multi_tensor_apply, TE's FusedAdam
// with master weights): one pass reads each element's master, moments and gradient and writes
// the master, the moments and the model's half copy, and measures the updated master's amax for
// an FP8 weight's scale. Moments stored in bfloat16 (TE's FusedAdam
// exp_avg_dtype, Megatron-Core's precision-aware optimizer) are widened when read and rounded to
// nearest even when written; the update in between is the float32 one.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/multi_tensor_apply.cuh"

namespace amp8::cuda {
namespace {

using namespace multi_tensor;

template <typename Moment>
__device__ __forceinline__ void store_moment(void* moments, int64_t i, float value) {
  if constexpr (std::is_same_v<Moment, float>) {
    static_cast<float*>(moments)[i] = value;
  } else {
    static_cast<__nv_bfloat16*>(moments)[i] = __float2bfloat16_rn(value);
  }
}

// The FP8 (E4M3) model copy's tag: written as quantize writes it, at the tensor's copy_scale.
struct Fp8E4M3Copy {};

// Copy = void: no model copy; Fp8E4M3Copy: FP8 bytes at copy_scale. ExpAvg, ExpAvgSq: float or
// __nv_bfloat16.
template <typename Grad, typename Copy, typename ExpAvg, typename ExpAvgSq>
__global__ void __launch_bounds__(kThreads)
    fused_adam_kernel(const __grid_constant__ Table<AdamTensorPointers> table, const AdamScalars s) {
  const auto [tensor, begin, end] = chunk_of(table);
  const Grad* grad = static_cast<const Grad*>(tensor.grad);
  const float neg_step_size = -tensor.step_size;
  const float inv_bias_correction2_sqrt = 1.0f / tensor.bias_correction2_sqrt;
  uint32_t max_bits = 0;  // max|p| as ordered bits (NaN above +inf), when tensor.amax is set
  [[maybe_unused]] float copy_scale = 0.0f;
  if constexpr (std::is_same_v<Copy, Fp8E4M3Copy>) copy_scale = *tensor.copy_scale;

#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int64_t i = item(begin, k);
    if (i >= end) break;
    // torch::optim::Adam / AdamW's operations in their order, each rounded as ATen's CUDA
    // kernels round it (explicit intrinsics: no contraction left to the compiler):
    // x.mul_(s) one product; x.add_(y, a) fma(a, y, x); x.addcmul_(y, y, a) fma(a·y, y, x);
    // x / scalar a product with the scalar's float reciprocal; x.addcdiv_(y, z, a) fma(a, y/z, x).
    float g = to_float(grad[i]);
    if (s.grad_multiplier != 1.0f) g = __fmul_rn(g, s.grad_multiplier);
    float p = tensor.param[i];
    if (s.param_decay != 1.0f) p = __fmul_rn(p, s.param_decay);
    if (s.weight_decay_l2 != 0.0f) g = __fmaf_rn(s.weight_decay_l2, p, g);
    const float m_old = to_float(static_cast<const ExpAvg*>(tensor.exp_avg)[i]);
    const float v_old = to_float(static_cast<const ExpAvgSq*>(tensor.exp_avg_sq)[i]);
    const float m = __fmaf_rn(s.one_minus_beta1, g, __fmul_rn(m_old, s.beta1));
    const float v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(v_old, s.beta2));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_bias_correction2_sqrt), s.eps);
    p = __fmaf_rn(neg_step_size, __fdiv_rn(m, denom), p);
    tensor.param[i] = p;
    store_moment<ExpAvg>(tensor.exp_avg, i, m);
    store_moment<ExpAvgSq>(tensor.exp_avg_sq, i, v);
    if constexpr (std::is_same_v<Copy, Fp8E4M3Copy>) {
      static_cast<uint8_t*>(tensor.model_copy)[i] = saturating_cast<false>(p, copy_scale);
    } else {
      store_copy<Copy>(tensor.model_copy, i, p);
    }
    max_bits = max(max_bits, abs_bits(p));
  }
  // The block's chunk is one tensor's, so the branch is the same for every thread of it.
  if (tensor.amax != nullptr) block_amax_to_global(max_bits, tensor.amax);
}

}  // namespace

namespace {

// Calls f(TypeTag<Moment>{}) for a moment's storage type.
template <typename F>
int dispatch_moment(MomentType type, F&& f) {
  switch (type) {
    case MomentType::kFloat:
      return f(TypeTag<float>{});
    case MomentType::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int launch_fused_adam(const AdamTensorPointers* tensors, int num_tensors, const AdamLaunchTypes& types,
                      const AdamScalars& scalars, Stream stream) {
  // The FP8 copy here, not in multi_tensor::dispatch, which the SGD kernel shares.
  const auto with_copy = [&](auto&& f) {
    if (types.copy == CopyType::kFloat8E4M3) {
      return dispatch_input(types.grad, [&](auto grad) { return f(grad, TypeTag<Fp8E4M3Copy>{}); });
    }
    return dispatch(types.grad, types.copy, f);
  };
  return with_copy([&](auto grad, auto copy) {
    return dispatch_moment(types.exp_avg, [&](auto exp_avg) {
      return dispatch_moment(types.exp_avg_sq, [&](auto exp_avg_sq) {
        using Grad = decltype(grad);
        using Copy = typename decltype(copy)::type;
        using ExpAvg = typename decltype(exp_avg)::type;
        using ExpAvgSq = typename decltype(exp_avg_sq)::type;
        return apply(fused_adam_kernel<Grad, Copy, ExpAvg, ExpAvgSq>, tensors, num_tensors, scalars, stream);
      });
    });
  });
}

}  // namespace amp8::cuda
