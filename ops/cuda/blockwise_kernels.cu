// Blockwise FP8 quantization (ops/blockwise.h): one scale per 1×128 row tile or 128×128 block,
// computed from the tile's amax by the rules of amp8::blockwise_scale, byte for byte as the
// CPU reference.

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/activate.cuh"
#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/cuda/transposed_tile.cuh"

namespace amp8::cuda {
namespace {

// These kernels are bound by their instructions, not by memory: their paired conversions test
// for NaN once per pair instead of clamping each value (Fp8CastMode).
constexpr Fp8CastMode kCastMode = Fp8CastMode::kNanBranch;

constexpr int kBlockLen = 128;

template <bool kE5M2>
__device__ __forceinline__ float tile_scale(float amax, const BlockwiseScaling& s) {
  if (amax < s.amax_epsilon) amax = s.amax_epsilon;
  if (amax == 0.0f || !isfinite(amax)) return 1.0f;
  float scale = __fdiv_rn(Fp8Traits<kE5M2>::kMax, amax);
  if (isinf(scale)) scale = 3.402823466e+38f;  // FLT_MAX
  if (s.power_of_2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  return scale;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// 1×128 tiles along rows: one warp per tile, four elements per lane.
template <typename T, bool kE5M2>
__global__ void quantize_1x128_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                           BlockwiseScaling s, uint8_t* __restrict__ out,
                                           float* __restrict__ scale_inv) {
  const int64_t col_blocks = (cols + kBlockLen - 1) / kBlockLen;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (tile >= rows * col_blocks) return;
  const int64_t r = tile / col_blocks, cb = tile % col_blocks;
  const int lane = threadIdx.x % 32;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t c = cb * kBlockLen + i * 32 + lane;
    v[i] = c < cols ? to_float(x[r * cols + c]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  amax = warp_max(amax);
  const float scale = tile_scale<kE5M2>(amax, s);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t c = cb * kBlockLen + i * 32 + lane;
    if (c < cols) out[r * cols + c] = saturating_cast<kE5M2>(v[i], scale);
  }
  if (lane == 0) scale_inv[cb * rows + r] = __fdiv_rn(1.0f, scale);
}

// xᵀ [cols, rows] in its own 1×128 tiles, i.e. 128 consecutive rows of one column of x: a block
// takes 128 rows × 32 columns of x through shared memory.
constexpr int kTransposeCols = 32;
constexpr int kTransposeThreads = 256;

template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kTransposeThreads)
    quantize_1x128_transposed_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                     BlockwiseScaling s, uint8_t* __restrict__ out_t,
                                     float* __restrict__ scale_inv_t) {
  __shared__ float tile[kBlockLen][kTransposeCols + 1];
  __shared__ float partial[kTransposeThreads / kTransposeCols][kTransposeCols];
  __shared__ float scales[kTransposeCols];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlockLen;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTransposeCols;
  const int t = threadIdx.x;
  const int col = t % kTransposeCols, part = t / kTransposeCols;  // 8 parts of 16 rows
  constexpr int kRowsPerPart = kBlockLen / (kTransposeThreads / kTransposeCols);
  float amax = 0.0f;
  for (int i = 0; i < kRowsPerPart; ++i) {
    const int row = part * kRowsPerPart + i;
    const int64_t r = r0 + row, c = c0 + col;
    const float v = (r < rows && c < cols) ? to_float(x[r * cols + c]) : 0.0f;
    tile[row][col] = v;
    amax = fmaxf(amax, fabsf(v));
  }
  partial[part][col] = amax;
  __syncthreads();
  if (t < kTransposeCols) {
    float column_amax = partial[0][t];
    for (int p = 1; p < kTransposeThreads / kTransposeCols; ++p)
      column_amax = fmaxf(column_amax, partial[p][t]);
    const float scale = tile_scale<kE5M2>(column_amax, s);
    scales[t] = scale;
    if (c0 + t < cols) scale_inv_t[(r0 / kBlockLen) * cols + c0 + t] = __fdiv_rn(1.0f, scale);
  }
  __syncthreads();
  // Row j of xᵀ (column c0 + j of x) gets 128 consecutive bytes: 8 threads of 16 each, one
  // 16-byte store where the row allows it.
  const int j = t / 8, chunk = (t % 8) * 16;
  const int64_t c = c0 + j;
  if (c >= cols) return;
  alignas(16) uint8_t bytes[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) bytes[i] = saturating_cast<kE5M2>(tile[chunk + i][j], scales[j]);
  uint8_t* row = out_t + c * rows + r0 + chunk;
  if (r0 + chunk + 16 <= rows && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    *reinterpret_cast<uint4*>(row) = *reinterpret_cast<const uint4*>(bytes);
  } else {
    for (int i = 0; i < 16 && r0 + chunk + i < rows; ++i) row[i] = bytes[i];
  }
}

// The one-read kernels below share a thread layout over a 128 × 128 tile of x at (r0, c0): 256
// threads, a half-warp per row, each thread holding the 16 bytes at columns gc = c0 + 8·chunk of
// rows r0 + row_in_pass + 16·pass (8 passes).
constexpr int kTileThreads = 256;
constexpr int kTileChunks = kBlockLen / 8;                    // threads per row: 16
constexpr int kTileRowsPerPass = kTileThreads / kTileChunks;  // 16
constexpr int kTilePasses = kBlockLen / kTileRowsPerPass;     // 8

// A thread's packs of the tile, every load issued before any is used; zero bits outside x (a
// zero changes no amax), written a whole 16-byte word at a time (element-wise 2-byte writes cost
// spills).
template <typename T>
__device__ __forceinline__ void load_tile_packs(const T* __restrict__ x, int64_t rows, int64_t cols,
                                                int64_t r0, int64_t gc, int row_in_pass,
                                                Pack8<T> (&packs)[kTilePasses]) {
#pragma unroll
  for (int pass = 0; pass < kTilePasses; ++pass) {
    const int64_t gr = r0 + row_in_pass + pass * kTileRowsPerPass;
    if (gr < rows && gc < cols) {
      packs[pass] = *reinterpret_cast<const Pack8<T>*>(x + gr * cols + gc);
    } else {
#pragma unroll
      for (int w = 0; w < static_cast<int>(sizeof(Pack8<T>) / 16); ++w)
        reinterpret_cast<uint4*>(&packs[pass])[w] = make_uint4(0, 0, 0, 0);
    }
  }
}

// A thread's 8 values v of row gr in its 1×128 row tile (blockIdx.x): the tile's amax over the
// half-warp holding the row (every lane must call it), the tile's scale, the 8 bytes stored in
// out (rows out_ld bytes apart), and 1 / scale into scale_inv [col tiles, rows] by the row's
// first thread.
template <bool kE5M2>
__device__ __forceinline__ void quantize_row_tile_share(const float (&v)[8], int64_t gr, int64_t gc,
                                                        int64_t rows, int64_t cols, int chunk,
                                                        const BlockwiseScaling& s,
                                                        uint8_t* __restrict__ out, int64_t out_ld,
                                                        float* __restrict__ scale_inv) {
  float amax = 0.0f;  // fmaxf drops a NaN
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int offset = kTileChunks / 2; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  const float scale = tile_scale<kE5M2>(amax, s);
  if (gr < rows) {
    uint32_t unused = 0;
    if (gc < cols)
      *reinterpret_cast<uint64_t*>(out + gr * out_ld + gc) =
          saturating_cast8<kE5M2, kCastMode>(v, scale, unused);
    if (chunk == 0) scale_inv[static_cast<int64_t>(blockIdx.x) * rows + gr] = __fdiv_rn(1.0f, scale);
  }
}

// 1×128 tiles of x, and with kTransposed those of xᵀ, from one read of a 128 × 128 tile of x
// (TE's 1-D blockwise quantization with its transpose). 256 threads: a half-warp per row, each
// thread loading 16 bytes of 8 rows. A row tile's amax is a half-warp reduction and its bytes
// leave as 8-byte stores; a column tile's (128 rows of one column of x) amax goes through
// shared memory, and its bytes through the swizzled transposed tile as whole 128-byte lines of
// xᵀ. The two kernels above read x twice with 2- and 64-byte accesses: a quarter of the copy
// rate, a fifth of a 1b GPT's blockwise step. Needs cols % 8 == 0 and a 16-byte aligned x; with
// kTransposed, rows % 16 == 0 and a 16-byte aligned out_t. With kTransposed it now serves float32
// inputs only: 2-byte ones take the staged kernel below (this one holds its 8 packs across the
// column pass: 80 registers, three resident blocks).

template <typename T, bool kE5M2, bool kTransposed>
__global__ void __launch_bounds__(kTileThreads, 3)
    quantize_1x128_tile_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                               BlockwiseScaling s, uint8_t* __restrict__ out,
                               float* __restrict__ scale_inv, uint8_t* __restrict__ out_t,
                               float* __restrict__ scale_inv_t) {
  constexpr int kChunks = kTileChunks, kRowsPerPass = kTileRowsPerPass, kPasses = kTilePasses;
  constexpr int kT = kTransposed ? 1 : 0;
  __shared__ alignas(16) uint8_t tile_t[kT ? kBlockLen * kTileRows : 1];  // [col][row], swizzled
  __shared__ float column_part[kT ? kRowsPerPass : 1][kT ? kBlockLen : 1];
  __shared__ float column_scale[kT ? kBlockLen : 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlockLen;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kBlockLen;
  const int chunk = threadIdx.x % kChunks, row_in_pass = threadIdx.x / kChunks;
  const int64_t gc = c0 + chunk * 8;
  Pack8<T> packs[kPasses];
  load_tile_packs(x, rows, cols, r0, gc, row_in_pass, packs);
  const auto values = [&](int pass, float (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(packs[pass].v[j]);
  };
  float column_amax[8] = {};
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int64_t gr = r0 + row_in_pass + pass * kRowsPerPass;
    float v[8];
    values(pass, v);
    if constexpr (kTransposed) {
#pragma unroll
      for (int j = 0; j < 8; ++j) column_amax[j] = fmaxf(column_amax[j], fabsf(v[j]));
    }
    quantize_row_tile_share<kE5M2>(v, gr, gc, rows, cols, chunk, s, out, cols, scale_inv);
  }
  if constexpr (kTransposed) {
#pragma unroll
    for (int j = 0; j < 8; ++j) column_part[row_in_pass][chunk * 8 + j] = column_amax[j];
    __syncthreads();
    if (threadIdx.x < kBlockLen) {
      float amax = column_part[0][threadIdx.x];
      for (int p = 1; p < kRowsPerPass; ++p) amax = fmaxf(amax, column_part[p][threadIdx.x]);
      const float scale = tile_scale<kE5M2>(amax, s);
      column_scale[threadIdx.x] = scale;
      if (c0 + threadIdx.x < cols) {
        scale_inv_t[static_cast<int64_t>(blockIdx.y) * cols + c0 + threadIdx.x] = __fdiv_rn(1.0f, scale);
      }
    }
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      float v[8];
      values(pass, v);
      const int r = row_in_pass + pass * kRowsPerPass;
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const int c = chunk * 8 + j;
        const uint32_t pair = saturating_cast2<kE5M2, kCastMode>(v[j], v[j + 1], column_scale[c],
                                                                 column_scale[c + 1]);
        tile_t[swizzled(c, r)] = static_cast<uint8_t>(pair);
        tile_t[swizzled(c + 1, r)] = static_cast<uint8_t>(pair >> 8);
      }
    }
    __syncthreads();
    store_transposed_tile<kBlockLen, kTileThreads>(tile_t, out_t, rows, r0, c0, cols - c0);
  }
}

// Element `half` (0: the low 16 bits) of a word holding two 2-byte values, in float32.
template <typename T>
__device__ __forceinline__ float half_to_float(uint32_t word, int half);
template <>
__device__ __forceinline__ float half_to_float<__nv_bfloat16>(uint32_t word, int half) {
  return __uint_as_float(half == 0 ? word << 16 : word & 0xFFFF0000u);
}
template <>
__device__ __forceinline__ float half_to_float<__half>(uint32_t word, int half) {
  return to_float(__ushort_as_half(static_cast<unsigned short>(word >> (16 * half))));
}

// The same tiles for 2-byte inputs (bf16, fp16) with xᵀ, through a staged copy of the input
// tile instead of the quantized transposed bytes. The row pass is the tile kernel's (a half-warp
// per row, 8-byte stores), and it also leaves each thread's 16-byte packs in shared memory. The
// column pass then reads them back a column pair (one 4-byte word) at a time: a thread takes two
// columns over 16 rows, their amaxes are reduced over the 8 threads holding the other rows by
// shuffles, and each thread stores its two 16-byte pieces of xᵀ's rows, 8 threads filling a
// whole 128-byte line. No byte-wide shared stores, no transposed tile, no shared reduction of
// column amaxes; the packs do not stay in registers across the barrier (fewer registers, more
// resident blocks). The staged rows' 16-byte chunks are XOR-swizzled by row / 16, so that
// neither the row pass's 16-byte stores nor the column pass's reads (8 row groups × 4 words per
// warp) meet on a bank. Needs what the tile kernel needs with kTransposed.
// With kDbias, the column pass also sums each column over the tile's rows (a thread's 16 rows in
// order, then the 8 threads by a fixed shuffle tree) into dbias_part [row tiles, cols]: a
// layer's bias gradient from the read that quantizes its output gradient (TE's
// cast_transpose_dbias).
// With an activation (kGelu: gelu(x); kDGelu: x · gelu'(gate), `gate` GELU's input, laid out as
// x), each loaded value is replaced by the activation's, rounded to T, before anything else: the
// tiles of the activation written in T and then quantized (how TE's blockwise quantizers take an
// activation), from one read, the activation never written. The dGELU variant holds the gate's
// packs too: three resident blocks instead of four, at 80 registers and a 20-byte spill (two
// blocks would take 103 registers and no spill).
// `ld` is the row length of the outputs whose rows x's columns make (out, scale_inv_t,
// dbias_part): cols for an x of its own, the whole width where x is a column piece of a wider
// tensor (launch_quantize_1x128_columns; the caller offsets the pointers).
template <typename T, bool kE5M2, bool kDbias, CastActivation kAct = CastActivation::kNone>
__global__ void __launch_bounds__(kTileThreads, kAct == CastActivation::kDGelu ? 3 : 4)
    quantize_1x128_staged_kernel(const T* __restrict__ x, const T* __restrict__ gate, int64_t rows,
                                 int64_t cols, int64_t ld, BlockwiseScaling s,
                                 uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                                 uint8_t* __restrict__ out_t, float* __restrict__ scale_inv_t,
                                 float* __restrict__ dbias_part) {
  static_assert(sizeof(T) == 2, "the column pass reads column pairs as 4-byte words");
  static_assert(kAct == CastActivation::kNone || kAct == CastActivation::kGelu ||
                    kAct == CastActivation::kDGelu,
                "the staged kernel applies GELU or its backward only");
  constexpr int kChunks = kTileChunks, kRowsPerPass = kTileRowsPerPass, kPasses = kTilePasses;
  __shared__ uint4 staged[kBlockLen][kChunks];  // [row][chunk ^ (row / 16)], 32 KB
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlockLen;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kBlockLen;
  const int chunk = threadIdx.x % kChunks, row_in_pass = threadIdx.x / kChunks;
  const int64_t gc = c0 + chunk * 8;
  Pack8<T> packs[kPasses];
  load_tile_packs(x, rows, cols, r0, gc, row_in_pass, packs);
  // Zeros outside x stay zero through an activation: gelu(0) = 0 and 0 · gelu'(g) = 0.
  Pack8<T> gates[kAct == CastActivation::kDGelu ? kPasses : 1];
  if constexpr (kAct == CastActivation::kDGelu) load_tile_packs(gate, rows, cols, r0, gc, row_in_pass, gates);
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = row_in_pass + pass * kRowsPerPass;  // r / 16 == pass
    if constexpr (kAct != CastActivation::kNone) {
      float a[8];
      activate8<kAct>(packs[pass], gates[kAct == CastActivation::kDGelu ? pass : 0], a);
      uint4 rounded;
      uint32_t* words = reinterpret_cast<uint32_t*>(&rounded);
#pragma unroll
      for (int q = 0; q < 4; ++q) words[q] = round_pair<T>(a[2 * q], a[2 * q + 1]);
      *reinterpret_cast<uint4*>(&packs[pass]) = rounded;
    }
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(packs[pass].v[j]);
    quantize_row_tile_share<kE5M2>(v, r0 + r, gc, rows, cols, chunk, s, out, ld, scale_inv);
    staged[r][chunk ^ pass] = *reinterpret_cast<const uint4*>(&packs[pass]);
  }
  __syncthreads();
  // Lane l of warp w: column pair w·4 + l % 4 (+ 32 in the second round), rows (l / 4)·16 on.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4;  // rows group·16 .. group·16 + 15 of the tile
  const int64_t out_row0 = r0 + group * 16;
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    const int pair_chunk = round * 8 + warp;  // the 16-byte chunk holding the column pair
    const int pair = pair_chunk * 4 + lane % 4;
    uint32_t words[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      words[i] = reinterpret_cast<const uint32_t*>(&staged[group * 16 + i][pair_chunk ^ group])[lane % 4];
    }
    const auto value = [&](int i, int half) { return half_to_float<T>(words[i], half); };
    float amax0 = 0.0f, amax1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      amax0 = fmaxf(amax0, fabsf(value(i, 0)));
      amax1 = fmaxf(amax1, fabsf(value(i, 1)));
    }
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) {
      amax0 = fmaxf(amax0, __shfl_xor_sync(0xFFFFFFFFu, amax0, offset));
      amax1 = fmaxf(amax1, __shfl_xor_sync(0xFFFFFFFFu, amax1, offset));
    }
    const float scale0 = tile_scale<kE5M2>(amax0, s), scale1 = tile_scale<kE5M2>(amax1, s);
    const int64_t c = c0 + 2 * pair;  // x's columns c and c + 1: xᵀ's rows
    if (group == 0) {
      float* scales = scale_inv_t + static_cast<int64_t>(blockIdx.y) * ld;
      if (c < cols) scales[c] = __fdiv_rn(1.0f, scale0);
      if (c + 1 < cols) scales[c + 1] = __fdiv_rn(1.0f, scale1);
    }
    if constexpr (kDbias) {
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        sum0 += value(i, 0);
        sum1 += value(i, 1);
      }
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) {
        sum0 += __shfl_xor_sync(0xFFFFFFFFu, sum0, offset);
        sum1 += __shfl_xor_sync(0xFFFFFFFFu, sum1, offset);
      }
      if (group == 0) {
        float* sums = dbias_part + static_cast<int64_t>(blockIdx.y) * ld;
        if (c < cols) sums[c] = sum0;
        if (c + 1 < cols) sums[c + 1] = sum1;
      }
    }
    uint4 bytes0, bytes1;
    uint32_t* b0 = reinterpret_cast<uint32_t*>(&bytes0);
    uint32_t* b1 = reinterpret_cast<uint32_t*>(&bytes1);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      b0[q] = saturating_cast2<kE5M2, kCastMode>(value(4 * q, 0), value(4 * q + 1, 0), scale0) |
              (saturating_cast2<kE5M2, kCastMode>(value(4 * q + 2, 0), value(4 * q + 3, 0), scale0)
               << 16);
      b1[q] = saturating_cast2<kE5M2, kCastMode>(value(4 * q, 1), value(4 * q + 1, 1), scale1) |
              (saturating_cast2<kE5M2, kCastMode>(value(4 * q + 2, 1), value(4 * q + 3, 1), scale1)
               << 16);
    }
    if (out_row0 < rows) {
      if (c < cols) *reinterpret_cast<uint4*>(out_t + c * rows + out_row0) = bytes0;
      if (c + 1 < cols) *reinterpret_cast<uint4*>(out_t + (c + 1) * rows + out_row0) = bytes1;
    }
  }
}

// 128×128 blocks: one thread block per block, its amax reduced across the block; the bytes
// written to x's layout and, when asked, to xᵀ's (the same block, the same scale).
constexpr int kSquareThreads = 256;

template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kSquareThreads)
    quantize_128x128_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                            BlockwiseScaling s, uint8_t* __restrict__ out,
                            float* __restrict__ scale_inv, int64_t scale_ld,
                            uint8_t* __restrict__ out_t, float* __restrict__ scale_inv_t,
                            int64_t scale_ld_t) {
  __shared__ float warp_amax[kSquareThreads / 32];
  __shared__ float block_scale;
  // The quantized block, for xᵀ's coalesced rows (one padding byte per row against bank
  // conflicts).
  __shared__ uint8_t block[kBlockLen][kBlockLen + 4];
  const int64_t rb = blockIdx.y, cb = blockIdx.x;
  const int64_t r0 = rb * kBlockLen, c0 = cb * kBlockLen;
  const int t = threadIdx.x;
  constexpr int kPerThread = kBlockLen * kBlockLen / kSquareThreads;
  float amax = 0.0f;
  for (int i = 0; i < kPerThread; ++i) {
    const int index = i * kSquareThreads + t;
    const int64_t r = r0 + index / kBlockLen, c = c0 + index % kBlockLen;
    if (r < rows && c < cols) amax = fmaxf(amax, fabsf(to_float(x[r * cols + c])));
  }
  amax = warp_max(amax);
  if (t % 32 == 0) warp_amax[t / 32] = amax;
  __syncthreads();
  if (t == 0) {
    float m = warp_amax[0];
    for (int w = 1; w < kSquareThreads / 32; ++w) m = fmaxf(m, warp_amax[w]);
    const float scale = tile_scale<kE5M2>(m, s);
    block_scale = scale;
    const float inv = __fdiv_rn(1.0f, scale);
    scale_inv[rb * scale_ld + cb] = inv;
    if (scale_inv_t != nullptr) scale_inv_t[cb * scale_ld_t + rb] = inv;
  }
  __syncthreads();
  const float scale = block_scale;
  for (int i = 0; i < kPerThread; ++i) {
    const int index = i * kSquareThreads + t;
    const int row = index / kBlockLen, col = index % kBlockLen;
    const int64_t r = r0 + row, c = c0 + col;
    if (r < rows && c < cols) {
      const uint8_t q = saturating_cast<kE5M2>(to_float(x[r * cols + c]), scale);
      out[r * cols + c] = q;
      block[row][col] = q;
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  // xᵀ's rows (x's columns), 128 consecutive bytes each, read down the shared block.
  for (int i = 0; i < kPerThread; ++i) {
    const int index = i * kSquareThreads + t;
    const int col = index / kBlockLen, row = index % kBlockLen;
    const int64_t r = r0 + row, c = c0 + col;
    if (r < rows && c < cols) out_t[c * rows + r] = block[row][col];
  }
}

// The same blocks with 16-byte loads held in registers (8 elements per thread and pass: one load
// of bf16 or fp16, two of float32, e.g. an FP32 master weight): the block's amax from one read,
// then its bytes from the same registers as 8-byte stores, and xᵀ's (the same bytes, the same
// scale) through the swizzled transposed tile as whole 128-byte lines, as cast_transpose writes
// them. Needs cols % 8 == 0, a 16-byte aligned x and an 8-byte aligned out; with xᵀ also
// rows % 16 == 0 and a 16-byte aligned out_t.
// (No minimum of resident blocks: asked for three, ptxas spills at the 80 registers it uses
// without spilling when left alone.)
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kTileThreads)
    quantize_128x128_vector_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                   BlockwiseScaling s, uint8_t* __restrict__ out,
                                   float* __restrict__ scale_inv, int64_t scale_ld,
                                   uint8_t* __restrict__ out_t, float* __restrict__ scale_inv_t,
                                   int64_t scale_ld_t) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "8 elements per one or two 16-byte loads");
  constexpr int kChunks = kTileChunks, kRowsPerPass = kTileRowsPerPass, kPasses = kTilePasses;
  __shared__ alignas(16) uint8_t tile_t[kBlockLen * kTileRows];  // [col][row], swizzled
  __shared__ float warp_amax[kTileThreads / 32];
  const int64_t rb = blockIdx.y, cb = blockIdx.x;
  const int64_t r0 = rb * kBlockLen, c0 = cb * kBlockLen;
  const int chunk = threadIdx.x % kChunks, row_in_pass = threadIdx.x / kChunks;
  const int64_t gc = c0 + chunk * 8;
  Pack8<T> packs[kPasses];
  load_tile_packs(x, rows, cols, r0, gc, row_in_pass, packs);
  float amax = 0.0f;  // fmaxf drops a NaN
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(to_float(packs[pass].v[j])));
  }
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int w = 1; w < kTileThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
  const float scale = tile_scale<kE5M2>(amax, s);
  if (threadIdx.x == 0) {
    const float inv = __fdiv_rn(1.0f, scale);
    scale_inv[rb * scale_ld + cb] = inv;
    if (scale_inv_t != nullptr) scale_inv_t[cb * scale_ld_t + rb] = inv;
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = row_in_pass + pass * kRowsPerPass;
    const int64_t gr = r0 + r;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(packs[pass].v[j]);
    uint32_t unused = 0;
    const uint64_t packed = saturating_cast8<kE5M2, kCastMode>(v, scale, unused);
    if (gr < rows && gc < cols) *reinterpret_cast<uint64_t*>(out + gr * cols + gc) = packed;
    if (out_t != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j) tile_t[swizzled(chunk * 8 + j, r)] = static_cast<uint8_t>(packed >> (8 * j));
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  store_transposed_tile<kBlockLen, kTileThreads>(tile_t, out_t, rows, r0, c0, cols - c0);
}

// ---- a weight's 128×128 blocks from the shards of it ranks hold (blockwise fp8_params) ----
// One thread block per (shard, block of its weight); its threads walk the block's rows 128
// elements at a time (one warp per row segment, coalesced) and take only the elements the shard
// holds. A table of up to kShardCapacity shards is a kernel parameter; each launch's blocks are
// numbered through the shards' prefix sums of blocks.
constexpr int kShardCapacity = 64;
struct ShardTable {
  BlockwiseShard shard[kShardCapacity];
  int64_t first_block_row[kShardCapacity];  // the first block row a launch block covers
  int first_tile[kShardCapacity + 1];
  int count;
};

struct ShardTile {
  const BlockwiseShard& shard;
  int64_t block_row, block_col;
};

__device__ __forceinline__ ShardTile shard_tile_of(const ShardTable& table) {
  const int tile = blockIdx.x;
  int k = 0;
  while (k + 1 < table.count && table.first_tile[k + 1] <= tile) ++k;
  const auto& shard = table.shard[k];
  const int64_t grid_cols = (shard.cols + kBlockLen - 1) / kBlockLen;
  const int64_t local = tile - table.first_tile[k];
  return {shard, table.first_block_row[k] + local / grid_cols, local % grid_cols};
}

// Calls f(shard index, element index in the block) for the shard's elements in the tile.
template <typename F>
__device__ __forceinline__ void for_each_shard_element(const ShardTile& tile, F&& f) {
  const auto& s = tile.shard;
  const int64_t r0 = tile.block_row * kBlockLen, c0 = tile.block_col * kBlockLen;
  const int64_t lo = s.offset, hi = s.offset + s.numel;
  const int64_t r_end = min(r0 + kBlockLen, s.rows), c_end = min(c0 + kBlockLen, s.cols);
  if (r0 * s.cols + c0 >= hi || (r_end - 1) * s.cols + c_end <= lo) return;
  for (int i = threadIdx.x; i < kBlockLen * kBlockLen; i += kSquareThreads) {
    const int64_t r = r0 + i / kBlockLen, c = c0 + i % kBlockLen;
    if (r < r_end && c < c_end) {
      const int64_t flat = r * s.cols + c;
      if (flat >= lo && flat < hi) f(flat - lo);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kSquareThreads) blockwise_shard_amax_kernel(ShardTable table) {
  __shared__ float warp_amax[kSquareThreads / 32];
  const auto tile = shard_tile_of(table);
  const T* values = static_cast<const T*>(tile.shard.values);
  float amax = 0.0f;  // fmaxf drops a NaN, as the CPU reference's std::fmax
  for_each_shard_element(tile, [&](int64_t i) { amax = fmaxf(amax, fabsf(to_float(values[i]))); });
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_amax[0];
    for (int w = 1; w < kSquareThreads / 32; ++w) m = fmaxf(m, warp_amax[w]);
    const int64_t grid_cols = (tile.shard.cols + kBlockLen - 1) / kBlockLen;
    // Non-negative floats order as their bits do.
    atomicMax(reinterpret_cast<int*>(tile.shard.amax + tile.block_row * grid_cols + tile.block_col),
              __float_as_int(m));
  }
}

template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kSquareThreads)
    quantize_shards_blockwise_kernel(ShardTable table, BlockwiseScaling s) {
  __shared__ float block_scale;
  const auto tile = shard_tile_of(table);
  const auto& shard = tile.shard;
  if (threadIdx.x == 0) {
    const int64_t grid_cols = (shard.cols + kBlockLen - 1) / kBlockLen;
    const float scale = tile_scale<kE5M2>(shard.amax[tile.block_row * grid_cols + tile.block_col], s);
    block_scale = scale;
    shard.scale_inv[tile.block_row * shard.scale_ld + tile.block_col] = __fdiv_rn(1.0f, scale);
  }
  __syncthreads();
  const float scale = block_scale;
  const T* values = static_cast<const T*>(shard.values);
  uint8_t* out = static_cast<uint8_t*>(shard.out);
  for_each_shard_element(tile, [&](int64_t i) { out[i] = saturating_cast<kE5M2>(to_float(values[i]), scale); });
}

// Launches kernel once per kShardCapacity shards; `all_block_rows`: a block for every block of
// each weight (quantizing writes every scale_inv), else only the block rows the shard reaches.
template <typename Kernel, typename... Args>
int launch_over_shards(Kernel kernel, const BlockwiseShard* shards, int count, bool all_block_rows,
                       Stream stream, Args... args) {
  for (int first = 0; first < count; first += kShardCapacity) {
    ShardTable table{};
    table.count = min(kShardCapacity, count - first);
    int64_t tiles = 0;
    for (int k = 0; k < table.count; ++k) {
      const auto& s = shards[first + k];
      table.shard[k] = s;
      const int64_t grid_rows = (s.rows + kBlockLen - 1) / kBlockLen;
      const int64_t grid_cols = (s.cols + kBlockLen - 1) / kBlockLen;
      int64_t row_first = 0, row_last = grid_rows - 1;
      if (!all_block_rows) {
        if (s.numel == 0) {
          row_first = 0;
          row_last = -1;
        } else {
          row_first = s.offset / s.cols / kBlockLen;
          row_last = (s.offset + s.numel - 1) / s.cols / kBlockLen;
        }
      }
      table.first_block_row[k] = row_first;
      table.first_tile[k] = static_cast<int>(tiles);
      tiles += (row_last - row_first + 1) * grid_cols;
    }
    table.first_tile[table.count] = static_cast<int>(tiles);
    if (tiles > INT32_MAX) return static_cast<int>(cudaErrorInvalidValue);
    if (tiles == 0) continue;
    kernel<<<static_cast<unsigned>(tiles), kSquareThreads, 0, stream>>>(table, args...);
    if (const auto error = cudaGetLastError(); error != cudaSuccess) return static_cast<int>(error);
  }
  return cudaSuccess;
}

template <typename F>
int dispatch_format(bool e5m2, F&& f) {
  return e5m2 ? f(std::true_type{}) : f(std::false_type{});
}

// The staged kernel with xᵀ for a 2-byte x (and gate) that quantize_1x128_sums_columns takes
// (checked by the callers), its outputs' rows `ld` long (the kernel's comment); with the tiles'
// column sums into dbias_part when it is non-null.
template <CastActivation kAct>
int launch_staged_kernel(const void* x, const void* gate, InputType type, int64_t rows,
                         int64_t cols, int64_t ld, BlockwiseScaling s, void* out, float* scale_inv,
                         void* out_t, float* scale_inv_t, Stream stream, float* dbias_part) {
  return dispatch_input(type, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (sizeof(T) == 2) {
      return dispatch_format(s.e5m2, [&](auto e5m2) {
        constexpr bool kE5M2 = decltype(e5m2)::value;
        const dim3 grid(static_cast<unsigned>((cols + kBlockLen - 1) / kBlockLen),
                        static_cast<unsigned>((rows + kBlockLen - 1) / kBlockLen));
        const auto launch = [&](auto kernel) {
          kernel<<<grid, kTileThreads, 0, stream>>>(
              static_cast<const T*>(x), static_cast<const T*>(gate), rows, cols, ld, s,
              static_cast<uint8_t*>(out), scale_inv, static_cast<uint8_t*>(out_t), scale_inv_t,
              dbias_part);
          return static_cast<int>(cudaGetLastError());
        };
        if constexpr (kAct != CastActivation::kGelu) {
          if (dbias_part != nullptr) {
            return launch(quantize_1x128_staged_kernel<T, kE5M2, true, kAct>);
          }
        }
        return launch(quantize_1x128_staged_kernel<T, kE5M2, false, kAct>);
      });
    } else {
      return kUnsupportedShape;  // not reached: checked by the callers
    }
  });
}

// The staged kernel for an x of its own, then the column sums into dbias when it is non-null.
template <CastActivation kAct>
int launch_staged(const void* x, const void* gate, InputType type, int64_t rows, int64_t cols,
                  BlockwiseScaling s, void* out, float* scale_inv, void* out_t, float* scale_inv_t,
                  Stream stream, float* dbias_part, void* dbias, InputType dbias_type) {
  if (!quantize_1x128_sums_columns(type, rows, cols, x, out_t) ||
      (kAct == CastActivation::kDGelu && reinterpret_cast<uintptr_t>(gate) % 16 != 0) ||
      (kAct == CastActivation::kGelu && dbias != nullptr)) {
    return kUnsupportedShape;
  }
  const int err = launch_staged_kernel<kAct>(x, gate, type, rows, cols, cols, s, out, scale_inv,
                                             out_t, scale_inv_t, stream,
                                             dbias != nullptr ? dbias_part : nullptr);
  if (err != 0 || dbias == nullptr) return err;
  return launch_column_sum(dbias_part, static_cast<int>(quantize_1x128_dbias_parts(rows)), cols,
                           dbias, dbias_type, stream);
}

}  // namespace

int64_t quantize_1x128_dbias_parts(int64_t rows) { return (rows + kBlockLen - 1) / kBlockLen; }

bool quantize_1x128_sums_columns(InputType type, int64_t rows, int64_t cols, const void* x,
                                 const void* out_t) {
  return (type == InputType::kBFloat16 || type == InputType::kHalf) && out_t != nullptr &&
         rows > 0 && cols > 0 && cols % 8 == 0 && rows % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(out_t) % 16 == 0;
}

int launch_quantize_1x128(const void* x, InputType type, int64_t rows, int64_t cols,
                          BlockwiseScaling s, void* out, float* scale_inv, void* out_t,
                          float* scale_inv_t, Stream stream, float* dbias_part, void* dbias,
                          InputType dbias_type) {
  if (dbias != nullptr) {
    // Only the staged kernel sums columns.
    return launch_staged<CastActivation::kNone>(x, nullptr, type, rows, cols, s, out, scale_inv,
                                                out_t, scale_inv_t, stream, dbias_part, dbias,
                                                dbias_type);
  }
  if (rows == 0 || cols == 0) return cudaSuccess;
  return dispatch_input(type, [&](auto zero) {
    using T = decltype(zero);
    return dispatch_format(s.e5m2, [&](auto e5m2) {
      constexpr bool kE5M2 = decltype(e5m2)::value;
      const bool transposed = out_t != nullptr;
      if (cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
          (!transposed || (rows % 16 == 0 && reinterpret_cast<uintptr_t>(out_t) % 16 == 0))) {
        const dim3 grid(static_cast<unsigned>((cols + kBlockLen - 1) / kBlockLen),
                        static_cast<unsigned>((rows + kBlockLen - 1) / kBlockLen));
        if (!transposed) {
          quantize_1x128_tile_kernel<T, kE5M2, false><<<grid, kTileThreads, 0, stream>>>(
              static_cast<const T*>(x), rows, cols, s, static_cast<uint8_t*>(out), scale_inv,
              nullptr, nullptr);
        } else if constexpr (sizeof(T) == 2) {
          quantize_1x128_staged_kernel<T, kE5M2, false><<<grid, kTileThreads, 0, stream>>>(
              static_cast<const T*>(x), nullptr, rows, cols, cols, s, static_cast<uint8_t*>(out),
              scale_inv, static_cast<uint8_t*>(out_t), scale_inv_t, nullptr);
        } else {
          quantize_1x128_tile_kernel<T, kE5M2, true><<<grid, kTileThreads, 0, stream>>>(
              static_cast<const T*>(x), rows, cols, s, static_cast<uint8_t*>(out), scale_inv,
              static_cast<uint8_t*>(out_t), scale_inv_t);
        }
        return static_cast<int>(cudaGetLastError());
      }
      const int64_t tiles = rows * ((cols + kBlockLen - 1) / kBlockLen);
      constexpr int kThreads = 256, kTilesPerBlock = kThreads / 32;
      quantize_1x128_rows_kernel<T, kE5M2>
          <<<static_cast<unsigned>((tiles + kTilesPerBlock - 1) / kTilesPerBlock), kThreads, 0,
             stream>>>(static_cast<const T*>(x), rows, cols, s, static_cast<uint8_t*>(out),
                       scale_inv);
      if (out_t != nullptr) {
        const dim3 grid(static_cast<unsigned>((cols + kTransposeCols - 1) / kTransposeCols),
                        static_cast<unsigned>((rows + kBlockLen - 1) / kBlockLen));
        quantize_1x128_transposed_kernel<T, kE5M2><<<grid, kTransposeThreads, 0, stream>>>(
            static_cast<const T*>(x), rows, cols, s, static_cast<uint8_t*>(out_t), scale_inv_t);
      }
      return static_cast<int>(cudaGetLastError());
    });
  });
}

int launch_quantize_1x128_activation(const void* x, const void* gate, InputType type,
                                     CastActivation activation, int64_t rows, int64_t cols,
                                     BlockwiseScaling s, void* out, float* scale_inv, void* out_t,
                                     float* scale_inv_t, Stream stream, float* dbias_part,
                                     void* dbias, InputType dbias_type) {
  switch (activation) {
    case CastActivation::kGelu:
      return launch_staged<CastActivation::kGelu>(x, nullptr, type, rows, cols, s, out, scale_inv,
                                                  out_t, scale_inv_t, stream, dbias_part, dbias,
                                                  dbias_type);
    case CastActivation::kDGelu:
      return launch_staged<CastActivation::kDGelu>(x, gate, type, rows, cols, s, out, scale_inv,
                                                   out_t, scale_inv_t, stream, dbias_part, dbias,
                                                   dbias_type);
    default:
      return kUnsupportedShape;
  }
}

int launch_quantize_1x128_columns(const void* const* pieces, const int64_t* piece_cols, int count,
                                  InputType type, int64_t rows, BlockwiseScaling s, void* out,
                                  float* scale_inv, void* out_t, float* scale_inv_t, Stream stream,
                                  float* dbias_part, void* dbias, InputType dbias_type) {
  if (count < 1) return kUnsupportedShape;
  int64_t width = 0;
  for (int i = 0; i < count; ++i) {
    // Every piece but the last ends on a tile edge, so that no 1×128 row tile spans two pieces;
    // a piece's part of out_t starts at row `width` of xᵀ, 16-byte aligned as out_t is.
    const bool whole_tiles = i == count - 1 || piece_cols[i] % kBlockLen == 0;
    if (!whole_tiles ||
        !quantize_1x128_sums_columns(type, rows, piece_cols[i], pieces[i],
                                     static_cast<const uint8_t*>(out_t) + width * rows)) {
      return kUnsupportedShape;
    }
    width += piece_cols[i];
  }
  int64_t first = 0;  // the piece's first column in x
  for (int i = 0; i < count; ++i) {
    const int err = launch_staged_kernel<CastActivation::kNone>(
        pieces[i], nullptr, type, rows, piece_cols[i], width, s,
        static_cast<uint8_t*>(out) + first, scale_inv + (first / kBlockLen) * rows,
        static_cast<uint8_t*>(out_t) + first * rows, scale_inv_t + first,
        stream, dbias != nullptr ? dbias_part + first : nullptr);
    if (err != 0) return err;
    first += piece_cols[i];
  }
  if (dbias == nullptr) return cudaSuccess;
  return launch_column_sum(dbias_part, static_cast<int>(quantize_1x128_dbias_parts(rows)), width,
                           dbias, dbias_type, stream);
}

int launch_quantize_128x128(const void* x, InputType type, int64_t rows, int64_t cols,
                            BlockwiseScaling s, void* out, float* scale_inv, int64_t scale_ld,
                            void* out_t, float* scale_inv_t, int64_t scale_ld_t, Stream stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return dispatch_input(type, [&](auto zero) {
    using T = decltype(zero);
    return dispatch_format(s.e5m2, [&](auto e5m2) {
      constexpr bool kE5M2 = decltype(e5m2)::value;
      const dim3 grid(static_cast<unsigned>((cols + kBlockLen - 1) / kBlockLen),
                      static_cast<unsigned>((rows + kBlockLen - 1) / kBlockLen));
      const bool transposed = out_t != nullptr;
      if (cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(out) % 8 == 0 &&
          (!transposed || (rows % 16 == 0 && reinterpret_cast<uintptr_t>(out_t) % 16 == 0))) {
        quantize_128x128_vector_kernel<T, kE5M2><<<grid, kTileThreads, 0, stream>>>(
            static_cast<const T*>(x), rows, cols, s, static_cast<uint8_t*>(out), scale_inv,
            scale_ld, static_cast<uint8_t*>(out_t), scale_inv_t, scale_ld_t);
        return static_cast<int>(cudaGetLastError());
      }
      quantize_128x128_kernel<T, kE5M2><<<grid, kSquareThreads, 0, stream>>>(
          static_cast<const T*>(x), rows, cols, s, static_cast<uint8_t*>(out), scale_inv,
          scale_ld, static_cast<uint8_t*>(out_t), scale_inv_t, scale_ld_t);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

int launch_blockwise_shard_amax(const BlockwiseShard* shards, int count, InputType type,
                                Stream stream) {
  return dispatch_input(type, [&](auto zero) {
    using T = decltype(zero);
    return launch_over_shards(blockwise_shard_amax_kernel<T>, shards, count,
                              /*all_block_rows=*/false, stream);
  });
}

int launch_quantize_shards_blockwise(const BlockwiseShard* shards, int count, InputType type,
                                     BlockwiseScaling scaling, Stream stream) {
  return dispatch_input(type, [&](auto zero) {
    using T = decltype(zero);
    return dispatch_format(scaling.e5m2, [&](auto e5m2) {
      return launch_over_shards(quantize_shards_blockwise_kernel<T, decltype(e5m2)::value>, shards,
                                count, /*all_block_rows=*/true, stream, scaling);
    });
  });
}

}  // namespace amp8::cuda
