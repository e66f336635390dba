#pragma once
// A 128-row tile of FP8 bytes transposed through shared memory, as the cast+transpose kernels
// (quantize_kernels.cu) and the blockwise quantization (blockwise_kernels.cu) write xᵀ: the
// shared tile [kTileCols][kTileRows] bytes is XOR-swizzled in 16-byte chunks so that neither
// the byte stores into it nor its 16-byte reads conflict on banks, and it leaves as whole
// 128-byte lines of xᵀ (8 threads per output row, 16 bytes each).

#include <cuda_runtime.h>

#include <cstdint>

namespace amp8::cuda {

constexpr int kTileRows = 128;  // = bytes per transposed row in shared memory

// Byte offset of element (t_row, t_col) of the transposed tile: t_row a column of x, t_col a
// row of x within the tile.
__device__ __forceinline__ int swizzled(int t_row, int t_col) {
  return t_row * kTileRows + ((((t_col >> 4) ^ (t_row >> 3)) & 7) << 4) + (t_col & 15);
}

// A block's transposed FP8 tile (tile_t [kTileCols][kTileRows], swizzled) to out_t [.., rows]:
// its row c becomes out_t's row out_row0 + c (for c < valid_cols), columns row0 onwards, as whole
// 128-byte lines (8 threads per output row, 16 bytes each), by kThreads threads. Needs rows % 16
// == 0 and a 16-byte aligned out_t.
template <int kTileCols, int kThreads>
__device__ __forceinline__ void store_transposed_tile(const uint8_t* tile_t, uint8_t* out_t,
                                                      int64_t rows, int64_t row0,
                                                      int64_t out_row0, int64_t valid_cols) {
  constexpr int kStorePasses = kTileCols * (kTileRows / 16) / kThreads;
#pragma unroll
  for (int pass = 0; pass < kStorePasses; ++pass) {
    const int index = threadIdx.x + pass * kThreads;
    const int c = index / (kTileRows / 16);  // transposed row within the tile
    const int q = index % (kTileRows / 16);  // 16-byte chunk of that row
    const int64_t out_col = row0 + q * 16;
    if (c < valid_cols && out_col < rows) {
      *reinterpret_cast<uint4*>(out_t + (out_row0 + c) * rows + out_col) =
          *reinterpret_cast<const uint4*>(&tile_t[swizzled(c, q * 16)]);
    }
  }
}

}  // namespace amp8::cuda
