// Rotary position embeddings (ops/rotary.h): one pass over x [batch, seq, heads, head_dim]
// (any strides but the last), out contiguous; the pair formula in
// ops/detail/elementwise_formulas.h.

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/detail/elementwise_formulas.h"

namespace amp8::cuda {
namespace {

constexpr int kThreads = 256;

struct RotaryShape {
  int64_t batch, seq, heads, head_dim;
  int64_t stride_batch, stride_seq, stride_head;  // x's, in elements
};

// Each thread turns kVec / 2 pairs: kVec = 8 through 16-byte accesses (head_dim and x's strides
// multiples of 8, aligned pointers), kVec = 2 one pair, any shape.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ cos,
                  const float* __restrict__ sin, RotaryShape shape, bool inverse) {
  const int64_t rows = shape.batch * shape.seq * shape.heads;  // (b, t, h) in out's order
  const int64_t half_dim = shape.head_dim / 2;
  for_each_column_group<kVec>(rows, shape.head_dim, [&](int64_t row, int64_t col) {
    const int64_t h = row % shape.heads;
    const int64_t t = (row / shape.heads) % shape.seq;
    const int64_t b = row / (shape.heads * shape.seq);
    const T* src = x + b * shape.stride_batch + t * shape.stride_seq + h * shape.stride_head + col;
    T* dst = out + row * shape.head_dim + col;
    const float* c = cos + t * half_dim + col / 2;
    const float* s = sin + t * half_dim + col / 2;
    if constexpr (kVec == 8) {
      const auto in = *reinterpret_cast<const Pack8<T>*>(src);
      const float4 cv = *reinterpret_cast<const float4*>(c);
      const float4 sv = *reinterpret_cast<const float4*>(s);
      const float cs[4] = {cv.x, cv.y, cv.z, cv.w}, ss[4] = {sv.x, sv.y, sv.z, sv.w};
      Pack8<T> y;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const auto r = detail::rotate_pair(to_float(in.v[2 * p]), to_float(in.v[2 * p + 1]), cs[p],
                                           ss[p], inverse);
        y.v[2 * p] = from_float<T>(r.first);
        y.v[2 * p + 1] = from_float<T>(r.second);
      }
      *reinterpret_cast<Pack8<T>*>(dst) = y;
    } else {
      const auto r = detail::rotate_pair(to_float(src[0]), to_float(src[1]), c[0], s[0], inverse);
      dst[0] = from_float<T>(r.first);
      dst[1] = from_float<T>(r.second);
    }
  });
}

}  // namespace

int launch_rotary(const void* x, InputType type, void* out, int64_t batch, int64_t seq,
                  int64_t heads, int64_t head_dim, int64_t stride_batch, int64_t stride_seq,
                  int64_t stride_head, const float* cos, const float* sin, bool inverse,
                  Stream stream) {
  const RotaryShape shape{batch, seq, heads, head_dim, stride_batch, stride_seq, stride_head};
  const int64_t rows = batch * seq * heads;
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const auto* src = static_cast<const T*>(x);
    auto* dst = static_cast<T*>(out);
    const bool vec = head_dim % 8 == 0 && stride_batch % 8 == 0 && stride_seq % 8 == 0 &&
                     stride_head % 8 == 0 && aligned16(src) && aligned16(dst) && aligned16(cos) &&
                     aligned16(sin);
    if (vec) {
      rotary_kernel<T, 8><<<grid_stride_blocks(rows * head_dim / 8, kThreads), kThreads, 0, stream>>>(
          src, dst, cos, sin, shape, inverse);
    } else {
      rotary_kernel<T, 2><<<grid_stride_blocks(rows * head_dim / 2, kThreads), kThreads, 0, stream>>>(
          src, dst, cos, sin, shape, inverse);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace amp8::cuda
