// Float32 sums of many gradients (Megatron's main_grad accumulation): one block per 4096-element
// chunk of a tensor adds the chunk's gradient into its float32 sum, or writes it there for the
// first micro-batch of a sum. One launch per 128 tensors: a 350m GPT's ~290 gradients took
// ~290 launches of ATen's mixed-dtype add per micro-batch.
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/multi_tensor_apply.cuh"

namespace amp8::cuda {
namespace {

using namespace multi_tensor;

template <typename G>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(const __grid_constant__ Table<AccumulateTensor> table, const AccumulateScalars) {
  const auto [tensor, begin, end] = chunk_of(table);
  const G* grad = static_cast<const G*>(tensor.grad);
  float* sum = tensor.sum;
  float values[kItemsPerThread];
#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int64_t i = item(begin, k);
    values[k] = i < end ? to_float(grad[i]) : 0.0f;
  }
  if (!tensor.overwrite) {
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      const int64_t i = item(begin, k);
      if (i < end) values[k] = __fadd_rn(sum[i], values[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int64_t i = item(begin, k);
    if (i < end) sum[i] = values[k];
  }
}

}  // namespace

int launch_accumulate_in_float32(const AccumulateTensor* tensors, int num_tensors, InputType type, Stream stream) {
  return dispatch_input(type, [&](auto zero) {
    using G = decltype(zero);
    return apply(accumulate_kernel<G>, tensors, num_tensors, AccumulateScalars{}, stream);
  });
}

}  // namespace amp8::cuda
