// Saturating FP8 quantization, fused cast+transpose and amax kernels.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/activate.cuh"
#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/cuda/multi_tensor_apply.cuh"
#include "ops/cuda/transposed_tile.cuh"
#include "ops/detail/elementwise_formulas.h"
#include "ops/detail/gelu_formula.h"
#include "ops/detail/scale_formula.h"

namespace amp8::cuda {
namespace {

constexpr int kThreads = 256;

int max_resident_blocks() { return num_sms() * 8; }

int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, max_resident_blocks())));
}

// The elementwise quantization tests for NaN once per pair of values instead of clamping each
// (Fp8CastMode): 1.05–1.10× faster on an H100.
constexpr Fp8CastMode kQuantizeCastMode = Fp8CastMode::kNanBranch;

// Elementwise quantization over n elements; 8 per thread-iteration where `vectorized`.
template <typename T, bool kE5M2, bool kWriteOutput>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, int64_t n, int64_t n_packs,
                    const float* __restrict__ scale_ptr, float* __restrict__ scale_inv,
                    float* __restrict__ amax) {
  const float scale = kWriteOutput ? load_scale(scale_ptr, scale_inv) : 1.0f;
  uint32_t max_bits = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Two independent 16-byte loads in flight per thread.
  int64_t i = tid;
  for (; i + stride < n_packs; i += 2 * stride) {
    const Pack8<T> a = reinterpret_cast<const Pack8<T>*>(x)[i];
    const Pack8<T> b = reinterpret_cast<const Pack8<T>*>(x)[i + stride];
    if (kWriteOutput) {
      reinterpret_cast<uint64_t*>(out)[i] =
          saturating_cast8<kE5M2, kQuantizeCastMode>(a, scale, max_bits);
      reinterpret_cast<uint64_t*>(out)[i + stride] =
          saturating_cast8<kE5M2, kQuantizeCastMode>(b, scale, max_bits);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        max_bits = max(max_bits, max(abs_bits(to_float(a.v[j])), abs_bits(to_float(b.v[j]))));
      }
    }
  }
  for (; i < n_packs; i += stride) {
    const Pack8<T> a = reinterpret_cast<const Pack8<T>*>(x)[i];
    if (kWriteOutput) {
      reinterpret_cast<uint64_t*>(out)[i] =
          saturating_cast8<kE5M2, kQuantizeCastMode>(a, scale, max_bits);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) max_bits = max(max_bits, abs_bits(to_float(a.v[j])));
    }
  }
  for (int64_t i = n_packs * 8 + tid; i < n; i += stride) {
    const float v = to_float(x[i]);
    max_bits = max(max_bits, abs_bits(v));
    if (kWriteOutput) out[i] = saturating_cast<kE5M2>(v, scale);
  }
  if (amax != nullptr) block_amax_to_global(max_bits, amax);
}

// quantize_kernel's bytes for many tensors, each with its own scale: one block per chunk of a
// tensor (multi_tensor_apply). Where the tensor's input and output allow, each thread reads
// four elements in one load and writes their four codes in one 32-bit store, coalesced across
// the block (measured: one byte per thread and store ran 18% slower than a launch per tensor).
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

template <typename T, bool kE5M2>
__global__ void __launch_bounds__(multi_tensor::kThreads)
    quantize_many_kernel(const __grid_constant__ multi_tensor::Table<QuantizeManyTensor> table,
                         const QuantizeManyScalars) {
  const auto [tensor, begin, end] = multi_tensor::chunk_of(table);
  const T* x = static_cast<const T*>(tensor.x);
  const float scale = *tensor.scale;
  const bool packed = reinterpret_cast<uintptr_t>(x) % sizeof(Pack4<T>) == 0 &&
                      reinterpret_cast<uintptr_t>(tensor.out) % 4 == 0;  // begin: a multiple of 4096
  if (!packed) {
#pragma unroll
    for (int k = 0; k < multi_tensor::kItemsPerThread; ++k) {
      const int64_t i = multi_tensor::item(begin, k);
      if (i >= end) break;
      tensor.out[i] = saturating_cast<kE5M2>(to_float(x[i]), scale);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < multi_tensor::kItemsPerThread / 4; ++k) {
    const int64_t i = begin + (int64_t{k} * multi_tensor::kThreads + threadIdx.x) * 4;
    if (i >= end) break;
    if (i + 4 <= end) {
      const Pack4<T> a = *reinterpret_cast<const Pack4<T>*>(x + i);
      uint32_t codes = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) codes |= uint32_t{saturating_cast<kE5M2>(to_float(a.v[j]), scale)} << (8 * j);
      *reinterpret_cast<uint32_t*>(tensor.out + i) = codes;
    } else {
      for (int64_t j = i; j < end; ++j) tensor.out[j] = saturating_cast<kE5M2>(to_float(x[j]), scale);
    }
  }
}

// Fast cast+transpose: kTileRows x kTileCols tiles, 256 threads. Each thread loads 16-byte
// chunks, writes the row-major FP8 bytes with 8-byte stores, and drops them into a transposed
// shared tile; the transposed output then leaves as whole 128-byte lines (8 threads per output
// row, 16 bytes each). The shared tile is XOR-swizzled in 16-byte chunks so that neither the
// byte stores nor the 16-byte reads conflict on banks.
// Needs cols % 8 == 0, rows % 16 == 0, 16-byte aligned x and out_t and an 8-byte aligned out
// (rows out_stride bytes apart, a multiple of 8); partial tiles are handled chunk by chunk.
// The transposed tile's layout and store: transposed_tile.cuh.
// With kDbias, each tile also sums its columns (the bias gradient of a gradient tile, TE's
// cast_transpose_dbias) into dbias_part[blockIdx.y, col], from the values the cast quantizes.
// kAct: what is quantized (and summed, and its amax taken) is activation(x), not x (TE's
// activation-fused casts): gelu(x), x · gelu'(gate), or swiglu(x, gate).
// x and gate rows are x_stride elements apart (cols, but 2·cols for kSwiGlu, whose gate/up rows
// hold both halves); out's rows out_stride bytes (cols, or more where out is a column block of a
// wider matrix: cast_transpose_columns).
template <CastActivation kAct>
constexpr bool kTwoInputs = kAct == CastActivation::kDGelu || kAct == CastActivation::kSwiGlu;

// Loads in flight against blocks per SM, per variant (H100, bench/results/cast_transpose_occupancy/):
// the 128-column casts without an activation (plain and kDbias) and kSwiGlu (launched with
// 64-column tiles) cast each pass's loads before the next pass loads, at four blocks per SM
// (64 and 56 registers): the blocks' loads overlap each other's arithmetic, 1.02-1.16x (plain,
// kDbias) and 1.39-1.45x (kSwiGlu) against loading every pass first. The others load every pass
// first (more loads in flight per thread), which measured faster for them: 64-column plain
// tiles (one block per SM asked), kGelu (four), kDGelu (two: it holds a second tile of loads,
// GELU's input; one pass at a time at four blocks measured 0.95-0.98x at 8192 and 16384
// rows, 1.12x at 4096).
template <CastActivation kAct, int kTileCols>
constexpr bool kCastPassByPass =
    (kAct == CastActivation::kNone && kTileCols == 128) || kAct == CastActivation::kSwiGlu;

template <CastActivation kAct, int kTileCols, bool kDbias>
constexpr int kCastTransposeMinBlocks =
    kAct == CastActivation::kDGelu ? 2
    : (kDbias || kAct != CastActivation::kNone || kCastPassByPass<kAct, kTileCols>) ? 4
                                                                                    : 1;

template <typename T, bool kE5M2, int kTileCols, bool kDbias = false,
          CastActivation kAct = CastActivation::kNone>
__global__ void __launch_bounds__(kThreads, (kCastTransposeMinBlocks<kAct, kTileCols, kDbias>))
    cast_transpose_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                          uint8_t* __restrict__ out_t, int64_t rows, int64_t cols,
                          const float* __restrict__ scale_ptr, float* __restrict__ scale_inv,
                          float* __restrict__ amax, float* __restrict__ dbias_part = nullptr,
                          const T* __restrict__ gate = nullptr, int64_t x_stride = 0,
                          int64_t out_stride = 0) {
  constexpr int kChunksPerRow = kTileCols / 8;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  constexpr int kLoadPasses = kTileRows / kRowsPerPass;
  __shared__ alignas(16) uint8_t tile_t[kTileCols * kTileRows];  // [col][row], swizzled

  const float scale = load_scale(scale_ptr, scale_inv);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  uint32_t max_bits = 0;

  const int chunk = threadIdx.x % kChunksPerRow;
  const int row_in_pass = threadIdx.x / kChunksPerRow;
  const int64_t gc = col0 + chunk * 8;
  constexpr bool kGated = kTwoInputs<kAct>;
  const int64_t stride = x_stride > 0 ? x_stride : cols;
  const int64_t ostride = out_stride > 0 ? out_stride : cols;
  // kDbias: this thread's 8 columns summed over its rows as the cast reads them (summing in a
  // loop of their own kept every pack and sum live at once: 103 registers instead of 48, half
  // the occupancy, measured); then the kRowsPerPass threads of a column chunk add up through
  // shared memory after the barrier below, in a fixed order.
  float sums[kDbias ? 8 : 1] = {};
  // The passes in groups of kGroup, each group loaded, then cast: one pass (kCastPassByPass)
  // or all of them.
  constexpr int kGroup = kCastPassByPass<kAct, kTileCols> ? 1 : kLoadPasses;
#pragma unroll
  for (int group = 0; group < kLoadPasses; group += kGroup) {
    Pack8<T> packs[kGroup];
    Pack8<T> gates[kGated ? kGroup : 1];
#pragma unroll
    for (int p = 0; p < kGroup; ++p) {
      const int64_t gr = row0 + row_in_pass + (group + p) * kRowsPerPass;
      if (gr < rows && gc < cols) {
        packs[p] = *reinterpret_cast<const Pack8<T>*>(x + gr * stride + gc);
        if constexpr (kGated) gates[p] = *reinterpret_cast<const Pack8<T>*>(gate + gr * stride + gc);
      }
    }
#pragma unroll
    for (int p = 0; p < kGroup; ++p) {
      const int r = row_in_pass + (group + p) * kRowsPerPass;
      const int64_t gr = row0 + r;
      uint64_t packed = 0;
      if (gr < rows && gc < cols) {
        float v[8];
        activate8<kAct>(packs[p], gates[kGated ? p : 0], v);
        if constexpr (kDbias) {
#pragma unroll
          for (int j = 0; j < 8; ++j) sums[j] += v[j];
        }
        packed = saturating_cast8<kE5M2>(v, scale, max_bits);
        *reinterpret_cast<uint64_t*>(out + gr * ostride + gc) = packed;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        tile_t[swizzled(chunk * 8 + j, r)] = static_cast<uint8_t>(packed >> (8 * j));
      }
    }
  }
  [[maybe_unused]] __shared__ float column_sums[kDbias ? kRowsPerPass : 1][kDbias ? kTileCols : 1];
  if constexpr (kDbias) {
#pragma unroll
    for (int j = 0; j < 8; ++j) column_sums[row_in_pass][chunk * 8 + j] = sums[j];
  }
  __syncthreads();
  if constexpr (kDbias) {
    if (threadIdx.x < kTileCols && col0 + threadIdx.x < cols) {
      float total = 0.0f;
#pragma unroll
      for (int r = 0; r < kRowsPerPass; ++r) total += column_sums[r][threadIdx.x];
      dbias_part[static_cast<int64_t>(blockIdx.y) * cols + col0 + threadIdx.x] = total;
    }
  }
  store_transposed_tile<kTileCols, kThreads>(tile_t, out_t, rows, row0, col0, cols - col0);
  if (amax != nullptr) block_amax_to_global(max_bits, amax);
}

// SwiGLU's backward inside the cast of the gradient it gives (TE's LayerNormMLP "swiglu": dSwiGLU
// fused with the gradient's cast-transpose). dy [rows, ffn] is the gradient of SwiGLU's output,
// gate_up [rows, 2·ffn] its input; what is quantized is [d gate | d up] [rows, 2·ffn]
// (detail::swiglu_backward, float32). A block reads a kTileRows × 64 tile of dy, gate and up once
// and writes both tiles they give, ffn columns apart, in both layouts: a grid over the output's
// 2·ffn columns would read dy and the gate twice. Each pass's three loads are cast before the
// next pass loads: 63 registers, four resident blocks per SM, whose loads overlap each other's
// arithmetic (all four passes loaded first took 128 registers, two blocks per SM, and ran at
// 0.73 of the copy rate on an H100 against 0.93 so: bench/results/dswiglu_occupancy/).
// Needs ffn % 8 == 0, rows % 16 == 0 and 16-byte aligned pointers.
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kThreads, 4)
    cast_transpose_dswiglu_kernel(const T* __restrict__ dy, const T* __restrict__ gate_up,
                                  uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                  int64_t rows, int64_t ffn, const float* __restrict__ scale_ptr,
                                  float* __restrict__ scale_inv, float* __restrict__ amax) {
  constexpr int kTileCols = 64;
  constexpr int kChunksPerRow = kTileCols / 8;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  constexpr int kLoadPasses = kTileRows / kRowsPerPass;
  __shared__ alignas(16) uint8_t gate_t[kTileCols * kTileRows];  // d gate, [col][row], swizzled
  __shared__ alignas(16) uint8_t up_t[kTileCols * kTileRows];    // d up, the same

  const float scale = load_scale(scale_ptr, scale_inv);
  const int64_t cols = 2 * ffn;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  uint32_t max_bits = 0;
  const int chunk = threadIdx.x % kChunksPerRow;
  const int row_in_pass = threadIdx.x / kChunksPerRow;
  const int64_t gc = col0 + chunk * 8;
#pragma unroll
  for (int pass = 0; pass < kLoadPasses; ++pass) {
    const int r = row_in_pass + pass * kRowsPerPass;
    const int64_t gr = row0 + r;
    uint64_t packed_gate = 0, packed_up = 0;
    if (gr < rows && gc < ffn) {
      const auto grad = *reinterpret_cast<const Pack8<T>*>(dy + gr * ffn + gc);
      const auto gate = *reinterpret_cast<const Pack8<T>*>(gate_up + gr * cols + gc);
      const auto up = *reinterpret_cast<const Pack8<T>*>(gate_up + gr * cols + ffn + gc);
      float d_gate[8], d_up[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const auto d = detail::swiglu_backward(to_float(grad.v[j]), to_float(gate.v[j]),
                                               to_float(up.v[j]));
        d_gate[j] = d.gate;
        d_up[j] = d.up;
      }
      packed_gate = saturating_cast8<kE5M2>(d_gate, scale, max_bits);
      packed_up = saturating_cast8<kE5M2>(d_up, scale, max_bits);
      *reinterpret_cast<uint64_t*>(out + gr * cols + gc) = packed_gate;
      *reinterpret_cast<uint64_t*>(out + gr * cols + ffn + gc) = packed_up;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      gate_t[swizzled(chunk * 8 + j, r)] = static_cast<uint8_t>(packed_gate >> (8 * j));
      up_t[swizzled(chunk * 8 + j, r)] = static_cast<uint8_t>(packed_up >> (8 * j));
    }
  }
  __syncthreads();
  store_transposed_tile<kTileCols, kThreads>(gate_t, out_t, rows, row0, col0, ffn - col0);
  store_transposed_tile<kTileCols, kThreads>(up_t, out_t, rows, row0, ffn + col0, ffn - col0);
  if (amax != nullptr) block_amax_to_global(max_bits, amax);
}

// max|activation values| of what cast_transpose_kernel (kGelu, kDGelu, kSwiGlu) or
// cast_transpose_dswiglu_kernel (kDSwiGlu) would quantize, from one read of their inputs and
// nothing written but the amax: current scaling's measuring pass before the fused cast. Each
// row of the inputs holds `width` positions: x's columns (kGelu, kDGelu with `gate` GELU's
// input), the output's (kSwiGlu: x is gate/up [rows, 2·width]) or dy's (kDSwiGlu: x is dy
// [rows, width], `gate` gate/up [rows, 2·width], two values per position). Blocks take rows
// grid-stride, their threads the row's positions, 8 at a time where `vectorized` (width % 8 == 0,
// 16-byte aligned inputs).
template <typename T, CastActivation kAct>
__global__ void __launch_bounds__(kThreads)
    activation_amax_kernel(const T* __restrict__ x, const T* __restrict__ gate, int64_t rows,
                           int64_t width, bool vectorized, float* __restrict__ amax) {
  const int64_t x_row = kAct == CastActivation::kSwiGlu ? 2 * width : width;
  const int64_t gate_row = kAct == CastActivation::kDSwiGlu ? 2 * width : width;
  uint32_t max_bits = 0;
  // The value(s) at one position, from x, the second input b (GELU's input, the up half, or
  // the gate half) and the third u (the up half, kDSwiGlu).
  auto measure = [&](float xv, float b, float u) {
    if constexpr (kAct == CastActivation::kGelu) {
      max_bits = max(max_bits, abs_bits(detail::gelu_tanh(xv)));
    } else if constexpr (kAct == CastActivation::kDGelu) {
      max_bits = max(max_bits, abs_bits(detail::gelu_tanh_backward(xv, b)));
    } else if constexpr (kAct == CastActivation::kSwiGlu) {
      max_bits = max(max_bits, abs_bits(detail::swiglu(xv, b)));
    } else {
      const auto d = detail::swiglu_backward(xv, b, u);
      max_bits = max(max_bits, max(abs_bits(d.gate), abs_bits(d.up)));
    }
  };
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_row;
    // kDGelu: GELU's input; kSwiGlu: the up half; kDSwiGlu: the gate half (the up half after it).
    const T* br = kAct == CastActivation::kSwiGlu ? xr + width
                                                   : (gate != nullptr ? gate + r * gate_row : xr);
    const T* ur = kAct == CastActivation::kDSwiGlu ? br + width : br;
    if (vectorized) {
      for (int64_t c = int64_t{threadIdx.x} * 8; c < width; c += int64_t{kThreads} * 8) {
        const Pack8<T> a = *reinterpret_cast<const Pack8<T>*>(xr + c);
        Pack8<T> b = a, u = a;
        if constexpr (kAct != CastActivation::kGelu) b = *reinterpret_cast<const Pack8<T>*>(br + c);
        if constexpr (kAct == CastActivation::kDSwiGlu) u = *reinterpret_cast<const Pack8<T>*>(ur + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) measure(to_float(a.v[j]), to_float(b.v[j]), to_float(u.v[j]));
      }
    } else {
      for (int64_t c = threadIdx.x; c < width; c += kThreads) {
        const float a = to_float(xr[c]);
        const float b = kAct == CastActivation::kGelu ? a : to_float(br[c]);
        const float u = kAct == CastActivation::kDSwiGlu ? to_float(ur[c]) : a;
        measure(a, b, u);
      }
    }
  }
  block_amax_to_global(max_bits, amax);
}

// Any shape: 32x32 tiles, one element per thread-iteration; out's rows out_stride bytes apart.
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_general_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                                  uint8_t* __restrict__ out_t, int64_t rows, int64_t cols,
                                  const float* __restrict__ scale_ptr,
                                  float* __restrict__ scale_inv, float* __restrict__ amax,
                                  int64_t out_stride) {
  __shared__ uint8_t tile[32][33];
  const float scale = load_scale(scale_ptr, scale_inv);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * 32;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 32;
  uint32_t max_bits = 0;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t gr = row0 + r, gc = col0 + threadIdx.x;
    if (gr < rows && gc < cols) {
      const float v = to_float(x[gr * cols + gc]);
      max_bits = max(max_bits, abs_bits(v));
      const uint8_t q = saturating_cast<kE5M2>(v, scale);
      out[gr * out_stride + gc] = q;
      tile[r][threadIdx.x] = q;
    }
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t out_row = col0 + r, out_col = row0 + threadIdx.x;
    if (out_row < cols && out_col < rows) out_t[out_row * rows + out_col] = tile[threadIdx.x][r];
  }
  if (amax != nullptr) block_amax_to_global(max_bits, amax);
}

__global__ void current_scale_kernel(const float* __restrict__ amax, float* __restrict__ scale,
                                     int64_t n, float fp8_max, float margin_divisor) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    scale[i] = detail::scale_from_amax(amax[i], 1.0f, fp8_max, margin_divisor);
  }
}

}  // namespace

int launch_quantize(const void* x, InputType type, void* out, int64_t n, const float* scale,
                    float* scale_inv, float* amax, bool accumulate_amax, bool e5m2, Stream stream) {
  if (amax != nullptr && !accumulate_amax) {
    if (auto err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return err;
  }
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const bool vectorized = aligned16(x) && aligned16(out);
    const int64_t n_packs = vectorized ? n / 8 : 0;
    const int grid = grid_for(vectorized ? std::max<int64_t>(n_packs, 1) : n);
    const auto* in = static_cast<const T*>(x);
    auto* o = static_cast<uint8_t*>(out);
    if (e5m2) {
      quantize_kernel<T, true, true>
          <<<grid, kThreads, 0, stream>>>(in, o, n, n_packs, scale, scale_inv, amax);
    } else {
      quantize_kernel<T, false, true>
          <<<grid, kThreads, 0, stream>>>(in, o, n, n_packs, scale, scale_inv, amax);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

namespace {

// max|x| of a 4096-element chunk of one tensor, max-merged into the tensor's amax.
template <typename T>
__global__ void __launch_bounds__(multi_tensor::kThreads)
    amax_many_kernel(const __grid_constant__ multi_tensor::Table<AmaxManyTensor> table,
                     const AmaxManyScalars) {
  const auto [tensor, begin, end] = multi_tensor::chunk_of(table);
  const T* x = static_cast<const T*>(tensor.x);
  uint32_t max_bits = 0;
#pragma unroll
  for (int k = 0; k < multi_tensor::kItemsPerThread; ++k) {
    const int64_t i = multi_tensor::item(begin, k);
    if (i < end) max_bits = max(max_bits, abs_bits(to_float(x[i])));
  }
  block_amax_to_global(max_bits, tensor.amax);
}

}  // namespace

int launch_amax_many(const AmaxManyTensor* tensors, int num_tensors, InputType type, Stream stream) {
  return dispatch_input(type, [&](auto zero) {
    using T = decltype(zero);
    return multi_tensor::apply(amax_many_kernel<T>, tensors, num_tensors, AmaxManyScalars{}, stream);
  });
}

int launch_quantize_many(const QuantizeManyTensor* tensors, int num_tensors, InputType type,
                         const QuantizeManyScalars& scalars, Stream stream) {
  return dispatch_input(type, [&](auto zero) {
    using T = decltype(zero);
    return scalars.e5m2 ? multi_tensor::apply(quantize_many_kernel<T, true>, tensors, num_tensors, scalars, stream)
                        : multi_tensor::apply(quantize_many_kernel<T, false>, tensors, num_tensors, scalars, stream);
  });
}

int launch_amax(const void* x, InputType type, int64_t n, float* amax, Stream stream) {
  if (auto err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return err;
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const int64_t n_packs = aligned16(x) ? n / 8 : 0;
    const int grid = grid_for(n_packs > 0 ? n_packs : n);
    quantize_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x), nullptr, n, n_packs, nullptr, nullptr, amax);
    return static_cast<int>(cudaGetLastError());
  });
}

int launch_cast_transpose_tiled(const void* x, InputType type, void* out, void* out_t, int64_t rows,
                                int64_t cols, const float* scale, float* scale_inv, float* amax,
                                bool accumulate_amax, bool e5m2, int tile_cols, Stream stream,
                                int64_t out_stride) {
  if (out_stride == 0) out_stride = cols;
  if (amax != nullptr && !accumulate_amax) {
    if (auto err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return err;
  }
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const auto* in = static_cast<const T*>(x);
    auto* o = static_cast<uint8_t*>(out);
    auto* ot = static_cast<uint8_t*>(out_t);
    // The row-major bytes leave in 8-byte stores: out needs 8-byte alignment only (a column
    // block of a wider matrix starts at any multiple of 8 columns).
    const bool fast = cols % 8 == 0 && rows % 16 == 0 && out_stride % 8 == 0 && aligned16(x) &&
                      aligned8(out) && aligned16(out_t);
    if (fast) {
      auto launch = [&](auto tile_tag) {
        constexpr int kCols = decltype(tile_tag)::value;
        const dim3 grid((cols + kCols - 1) / kCols, (rows + kTileRows - 1) / kTileRows);
        if (e5m2) {
          cast_transpose_kernel<T, true, kCols><<<grid, kThreads, 0, stream>>>(
              in, o, ot, rows, cols, scale, scale_inv, amax, nullptr, nullptr, 0, out_stride);
        } else {
          cast_transpose_kernel<T, false, kCols><<<grid, kThreads, 0, stream>>>(
              in, o, ot, rows, cols, scale, scale_inv, amax, nullptr, nullptr, 0, out_stride);
        }
      };
      if (tile_cols == 128) {
        launch(std::integral_constant<int, 128>{});
      } else {
        launch(std::integral_constant<int, 64>{});
      }
    } else {
      const dim3 grid((cols + 31) / 32, (rows + 31) / 32);
      const dim3 block(32, kThreads / 32);
      if (e5m2) {
        cast_transpose_general_kernel<T, true>
            <<<grid, block, 0, stream>>>(in, o, ot, rows, cols, scale, scale_inv, amax, out_stride);
      } else {
        cast_transpose_general_kernel<T, false>
            <<<grid, block, 0, stream>>>(in, o, ot, rows, cols, scale, scale_inv, amax, out_stride);
      }
    }
    return static_cast<int>(cudaGetLastError());
  });
}

int64_t cast_transpose_dbias_parts(int64_t rows) { return (rows + kTileRows - 1) / kTileRows; }

namespace {

// launch_cast_transpose_fused's kDSwiGlu: dy [rows, cols / 2], gate_up and the outputs
// [rows, cols]; no bias gradient (the SwiGLU MLPs this serves have no FC1 bias).
int launch_cast_transpose_dswiglu(const void* dy, const void* gate_up, InputType type, void* out,
                                  void* out_t, int64_t rows, int64_t cols, const float* scale,
                                  float* scale_inv, float* amax, bool accumulate_amax, bool e5m2,
                                  bool with_dbias, Stream stream) {
  const int64_t ffn = cols / 2;
  if (with_dbias || cols % 16 != 0 || rows % 16 != 0 || !aligned16(dy) || !aligned16(gate_up) ||
      !aligned16(out) || !aligned16(out_t)) {
    return kUnsupportedShape;
  }
  if (amax != nullptr && !accumulate_amax) {
    if (auto err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return err;
  }
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid((ffn + 63) / 64, static_cast<unsigned>((rows + kTileRows - 1) / kTileRows));
    const auto* g = static_cast<const T*>(dy);
    const auto* gu = static_cast<const T*>(gate_up);
    auto* o = static_cast<uint8_t*>(out);
    auto* ot = static_cast<uint8_t*>(out_t);
    if (e5m2) {
      cast_transpose_dswiglu_kernel<T, true>
          <<<grid, kThreads, 0, stream>>>(g, gu, o, ot, rows, ffn, scale, scale_inv, amax);
    } else {
      cast_transpose_dswiglu_kernel<T, false>
          <<<grid, kThreads, 0, stream>>>(g, gu, o, ot, rows, ffn, scale, scale_inv, amax);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace

int launch_cast_transpose_fused(const void* x, const void* gate, InputType type,
                                CastActivation activation, void* out, void* out_t, int64_t rows,
                                int64_t cols, const float* scale, float* scale_inv, float* amax,
                                bool accumulate_amax, bool e5m2, float* part, void* dbias,
                                InputType dbias_type, Stream stream, int64_t out_stride) {
  if (out_stride == 0) out_stride = cols;
  if (activation == CastActivation::kDSwiGlu) {
    if (out_stride != cols) return kUnsupportedShape;
    return launch_cast_transpose_dswiglu(x, gate, type, out, out_t, rows, cols, scale, scale_inv,
                                         amax, accumulate_amax, e5m2, dbias != nullptr, stream);
  }
  constexpr int kCols = kDefaultCastTransposeTileCols;
  const bool gated = activation == CastActivation::kDGelu;
  const bool swiglu = activation == CastActivation::kSwiGlu;
  const bool with_dbias = dbias != nullptr;
  if (!(cols % 8 == 0 && rows % 16 == 0 && out_stride % 8 == 0 && aligned16(x) &&
        aligned8(out) && aligned16(out_t) && (!gated || aligned16(gate)))) {
    return kUnsupportedShape;
  }
  // The variants instantiated: what the layers use (a gradient's cast with its bias gradient;
  // GELU's and SwiGLU's output casts; GELU's backward with or without a bias gradient).
  const bool instantiated = (activation == CastActivation::kNone && with_dbias) ||
                            ((activation == CastActivation::kGelu || swiglu) && !with_dbias) ||
                            gated;
  if (!instantiated) return kUnsupportedShape;
  if (amax != nullptr && !accumulate_amax) {
    if (auto err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return err;
  }
  const int64_t parts = cast_transpose_dbias_parts(rows);
  const int err = dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const auto* in = static_cast<const T*>(x);
    // SwiGLU: the up half of each gate/up row follows its gate half.
    const auto* g = swiglu ? in + cols : static_cast<const T*>(gate);
    const int64_t x_stride = swiglu ? 2 * cols : cols;
    auto* o = static_cast<uint8_t*>(out);
    auto* ot = static_cast<uint8_t*>(out_t);
    auto launch = [&](auto e5m2_tag, auto dbias_tag, auto act_tag) {
      // SwiGLU's two loads per element fit four blocks per SM with 64-column tiles.
      constexpr int kTile = decltype(act_tag)::value == CastActivation::kSwiGlu ? 64 : kCols;
      const dim3 grid((cols + kTile - 1) / kTile, static_cast<unsigned>(parts));
      cast_transpose_kernel<T, decltype(e5m2_tag)::value, kTile, decltype(dbias_tag)::value,
                            decltype(act_tag)::value><<<grid, kThreads, 0, stream>>>(
          in, o, ot, rows, cols, scale, scale_inv, amax, part, g, x_stride, out_stride);
    };
    auto with_format = [&](auto dbias_tag, auto act_tag) {
      if (e5m2) {
        launch(std::true_type{}, dbias_tag, act_tag);
      } else {
        launch(std::false_type{}, dbias_tag, act_tag);
      }
    };
    using None = std::integral_constant<CastActivation, CastActivation::kNone>;
    using Gelu = std::integral_constant<CastActivation, CastActivation::kGelu>;
    using DGelu = std::integral_constant<CastActivation, CastActivation::kDGelu>;
    using SwiGlu = std::integral_constant<CastActivation, CastActivation::kSwiGlu>;
    if (activation == CastActivation::kNone) {
      with_format(std::true_type{}, None{});
    } else if (activation == CastActivation::kGelu) {
      with_format(std::false_type{}, Gelu{});
    } else if (swiglu) {
      with_format(std::false_type{}, SwiGlu{});
    } else if (with_dbias) {
      with_format(std::true_type{}, DGelu{});
    } else {
      with_format(std::false_type{}, DGelu{});
    }
    return static_cast<int>(cudaGetLastError());
  });
  if (err != 0 || !with_dbias) return err;
  return launch_column_sum(part, static_cast<int>(parts), cols, dbias, dbias_type, stream);
}

int launch_cast_transpose(const void* x, InputType type, void* out, void* out_t, int64_t rows,
                          int64_t cols, const float* scale, float* scale_inv, float* amax,
                          bool accumulate_amax, bool e5m2, Stream stream, int64_t out_stride) {
  return launch_cast_transpose_tiled(x, type, out, out_t, rows, cols, scale, scale_inv, amax,
                                     accumulate_amax, e5m2, kDefaultCastTransposeTileCols, stream,
                                     out_stride);
}

int launch_activation_amax(const void* x, const void* gate, InputType type,
                           CastActivation activation, int64_t rows, int64_t cols, float* amax,
                           Stream stream) {
  if (activation == CastActivation::kNone) return kUnsupportedShape;
  if (auto err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return err;
  // Positions per row: the output's columns, but dy's (half of them) for kDSwiGlu.
  const int64_t width = activation == CastActivation::kDSwiGlu ? cols / 2 : cols;
  const bool vectorized = width % 8 == 0 && aligned16(x) && (gate == nullptr || aligned16(gate));
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, max_resident_blocks())));
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const auto* in = static_cast<const T*>(x);
    const auto* g = static_cast<const T*>(gate);
    switch (activation) {
      case CastActivation::kGelu:
        activation_amax_kernel<T, CastActivation::kGelu>
            <<<grid, kThreads, 0, stream>>>(in, nullptr, rows, width, vectorized, amax);
        break;
      case CastActivation::kDGelu:
        activation_amax_kernel<T, CastActivation::kDGelu>
            <<<grid, kThreads, 0, stream>>>(in, g, rows, width, vectorized, amax);
        break;
      case CastActivation::kSwiGlu:
        activation_amax_kernel<T, CastActivation::kSwiGlu>
            <<<grid, kThreads, 0, stream>>>(in, nullptr, rows, width, vectorized, amax);
        break;
      default:
        activation_amax_kernel<T, CastActivation::kDSwiGlu>
            <<<grid, kThreads, 0, stream>>>(in, g, rows, width, vectorized, amax);
        break;
    }
    return static_cast<int>(cudaGetLastError());
  });
}

int launch_current_scale(const float* amax, float* scale, int64_t n, float fp8_max,
                         float margin_divisor, Stream stream) {
  if (n < 1) return static_cast<int>(cudaErrorInvalidValue);
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 1024));
  current_scale_kernel<<<blocks, threads, 0, stream>>>(amax, scale, n, fp8_max, margin_divisor);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace amp8::cuda
