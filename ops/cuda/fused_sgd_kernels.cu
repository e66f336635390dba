// Multi-tensor SGD (momentum, dampening, nesterov, weight decay) over FP32 master weights
// (Apex's multi_tensor_sgd, TE's FusedSGD): one pass reads each element's master, momentum
// buffer and gradient and writes the master, the buffer and the model's half copy.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/multi_tensor_apply.cuh"

namespace amp8::cuda {
namespace {

using namespace multi_tensor;

// Copy = void: no model copy.
template <typename Grad, typename Copy>
__global__ void __launch_bounds__(kThreads)
    fused_sgd_kernel(const __grid_constant__ Table<SgdTensorPointers> table, const SgdScalars s) {
  const auto [tensor, begin, end] = chunk_of(table);
  const Grad* grad = static_cast<const Grad*>(tensor.grad);

#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int64_t i = item(begin, k);
    if (i >= end) break;
    // torch::optim::SGD's operations in their order, each rounded as ATen's CUDA kernels round
    // it (explicit intrinsics: no contraction left to the compiler): x.mul(s) one product;
    // x.add(y, a) / x.add_(y, a) fma(a, y, x).
    float d = to_float(grad[i]);
    if (s.grad_multiplier != 1.0f) d = __fmul_rn(d, s.grad_multiplier);
    float p = tensor.param[i];
    if (s.weight_decay != 0.0f) d = __fmaf_rn(s.weight_decay, p, d);
    if (s.momentum != 0.0f) {
      const float b = tensor.first_step
                          ? d
                          : __fmaf_rn(s.one_minus_dampening, d,
                                      __fmul_rn(tensor.momentum_buffer[i], s.momentum));
      tensor.momentum_buffer[i] = b;
      d = s.nesterov ? __fmaf_rn(s.momentum, b, d) : b;
    }
    p = __fmaf_rn(s.neg_lr, d, p);
    tensor.param[i] = p;
    store_copy<Copy>(tensor.model_copy, i, p);
  }
}

}  // namespace

int launch_fused_sgd(const SgdTensorPointers* tensors, int num_tensors, InputType grad_type,
                     CopyType copy_type, const SgdScalars& scalars, Stream stream) {
  return dispatch(grad_type, copy_type, [&](auto grad, auto copy) {
    using Grad = decltype(grad);
    using Copy = typename decltype(copy)::type;
    return apply(fused_sgd_kernel<Grad, Copy>, tensors, num_tensors, scalars, stream);
  });
}

}  // namespace amp8::cuda
