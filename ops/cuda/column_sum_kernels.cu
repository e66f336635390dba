// out[c] = Σ_p part[p, c] over float32 partial sums: the second pass of every column reduction
// (LayerNorm's dgamma / dbeta, the bias gradients of the fused casts).

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/launch_util.cuh"

namespace amp8::cuda {
namespace {

// out[c] = Σ_p part[p, c], in a fixed order (it depends only on `parts`). Block (kSumCols,
// kSumLanes): a warp reads 4 partial rows × 8 columns, one full 32-byte sector per row, and each
// lane keeps four independent sums so that four loads are in flight. Narrow column groups give
// a hidden size of 1024 128 blocks instead of 32 (the first version: 32 columns × 8 lanes, a
// quarter of the SMs busy and one load in flight per lane).
constexpr int kSumCols = 8, kSumLanes = 64, kSumUnroll = 4;
static_assert(kSumUnroll == 4, "column_sum_kernel adds its four sums by hand");
// blockIdx.y picks the block of partial sums: 0 → out, 1 → out2 (launch_column_sum's second).
template <typename O>
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    column_sum_kernel(const float* __restrict__ part, int parts, int cols, O* __restrict__ out,
                      O* __restrict__ out2) {
  __shared__ float acc[kSumLanes][kSumCols + 1];
  if (blockIdx.y == 1) {
    part += static_cast<int64_t>(parts) * cols;
    out = out2;
  }
  const int c = blockIdx.x * kSumCols + threadIdx.x;
  float sum[kSumUnroll] = {};
  if (c < cols) {
    const float* column = part + c;
    int p = threadIdx.y;
    for (; p + (kSumUnroll - 1) * kSumLanes < parts; p += kSumUnroll * kSumLanes) {
#pragma unroll
      for (int k = 0; k < kSumUnroll; ++k) {
        sum[k] += column[static_cast<int64_t>(p + k * kSumLanes) * cols];
      }
    }
    for (; p < parts; p += kSumLanes) sum[0] += column[static_cast<int64_t>(p) * cols];
  }
  acc[threadIdx.y][threadIdx.x] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll 8
    for (int k = 0; k < kSumLanes; ++k) total += acc[k][threadIdx.x];
    out[c] = from_float<O>(total);
  }
}

}  // namespace

int launch_column_sum(const float* part, int parts, int64_t cols, void* out, InputType out_type,
                      Stream stream, void* out2) {
  if (parts < 1 || cols < 1 || cols > (int64_t{1} << 30)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const dim3 block(kSumCols, kSumLanes);
  const dim3 grid(static_cast<unsigned>((cols + kSumCols - 1) / kSumCols), out2 != nullptr ? 2 : 1);
  return dispatch_input(out_type, [&](auto tag) {
    using O = decltype(tag);
    column_sum_kernel<O><<<grid, block, 0, stream>>>(part, parts, static_cast<int>(cols),
                                                     static_cast<O*>(out), static_cast<O*>(out2));
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace amp8::cuda
