// The FP8 byte transpose: out [cols, rows] = in [rows, cols]ᵀ (the columnwise copy of FP8
// data whose transpose was not written by its cast).

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/kernels.h"

namespace amp8::cuda {
namespace {

// 64×64-byte tiles through shared memory; kVec4 moves 4 bytes per access (rows and cols
// multiples of 4).
template <bool kVec4>
__global__ void __launch_bounds__(256)
    byte_transpose_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int64_t rows,
                          int64_t cols) {
  __shared__ alignas(4) uint8_t tile[64][68];
  const int tid = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * 64;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 64;
  if constexpr (kVec4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = tid / 16 + 16 * k, c = (tid % 16) * 4;
      if (row0 + r < rows && col0 + c < cols) {
        *reinterpret_cast<uint32_t*>(&tile[r][c]) =
            *reinterpret_cast<const uint32_t*>(in + (row0 + r) * cols + col0 + c);
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int oc = tid / 16 + 16 * k, orow = (tid % 16) * 4;
      if (col0 + oc < cols && row0 + orow < rows) {
        const uint32_t packed = tile[orow][oc] | (tile[orow + 1][oc] << 8) |
                                (tile[orow + 2][oc] << 16) | (tile[orow + 3][oc] << 24);
        *reinterpret_cast<uint32_t*>(out + (col0 + oc) * rows + row0 + orow) = packed;
      }
    }
  } else {
    for (int k = 0; k < 16; ++k) {
      const int idx = tid + 256 * k, r = idx / 64, c = idx % 64;
      if (row0 + r < rows && col0 + c < cols) tile[r][c] = in[(row0 + r) * cols + col0 + c];
    }
    __syncthreads();
    for (int k = 0; k < 16; ++k) {
      const int idx = tid + 256 * k, oc = idx / 64, orow = idx % 64;
      if (col0 + oc < cols && row0 + orow < rows) {
        out[(col0 + oc) * rows + row0 + orow] = tile[orow][oc];
      }
    }
  }
}

}  // namespace

int launch_byte_transpose(const void* in, void* out, int64_t rows, int64_t cols, Stream stream) {
  const dim3 grid(static_cast<unsigned>((cols + 63) / 64), static_cast<unsigned>((rows + 63) / 64));
  if (grid.y > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  const bool vec4 = rows % 4 == 0 && cols % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 4 == 0;
  if (vec4) {
    byte_transpose_kernel<true><<<grid, 256, 0, stream>>>(src, dst, rows, cols);
  } else {
    byte_transpose_kernel<false><<<grid, 256, 0, stream>>>(src, dst, rows, cols);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace amp8::cuda
