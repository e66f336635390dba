// LayerNorm and RMSNorm forward (high-precision or FP8 output) and backward.
//
// One row per block iteration; each thread keeps its share of the row in registers, so x is
// read once and the statistics are an exact two-pass mean/variance in float32. RMSNorm is the
// same kernel with the mean fixed at 0: a runtime flag in the forward (uniform over the grid, no
// instances added), a template parameter in the backward (where the flag cost a fifth of its speed).

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/fp8_convert.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/launch_util.cuh"

namespace amp8::cuda {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// p[0..kVec) into out; p is 16-byte aligned when kVec is a multiple of 4.
template <int kVec>
__device__ __forceinline__ void load_floats(const float* __restrict__ p, float (&out)[kVec]) {
  if constexpr (kVec % 4 == 0) {
#pragma unroll
    for (int j = 0; j < kVec; j += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + j);
      out[j] = q.x;
      out[j + 1] = q.y;
      out[j + 2] = q.z;
      out[j + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = p[j];
  }
}

// gamma or beta p[0..kVec) as float32; W is float32 or the rows' half type (p is aligned to
// the whole vector when kVec is the row's wide vector).
template <int kVec, typename W>
__device__ __forceinline__ void load_weights(const W* __restrict__ p, float (&out)[kVec]) {
  if constexpr (std::is_same_v<W, float>) {
    load_floats<kVec>(p, out);
  } else {
    const Vec<W, kVec> q = *reinterpret_cast<const Vec<W, kVec>*>(p);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = to_float(q.v[j]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sums over the block (blockDim.x a multiple of 32, blockDim.y == 1) in a fixed order, through
// `smem` (32 slots). One barrier: the slots are not reused until every thread has passed the
// barrier of a reduction that uses other slots, so callers alternate between two sets
// (kReduceSlots apart) and there is no trailing barrier.
constexpr int kReduceSlots = 32;

__device__ __forceinline__ void write_warp_sums(float a, float b, float2* smem) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = make_float2(a, b);
  __syncthreads();
}

// The forward's: each thread adds the warps' sums in a loop.
__device__ __forceinline__ float block_sum(float a, float2* smem) {
  write_warp_sums(a, 0.0f, smem);
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += smem[w].x;
  return total;
}

// The backward's two sums: each lane reads one warp's sums and the warp adds them with
// warp_sum's butterfly (each step adds the same pair on both lanes, so every lane gets the same
// bits): one shared load per thread instead of one load and add per warp, a shorter chain on
// the way to each row's dx. The forward keeps the loop: with the butterfly its 32-element
// instance (hidden 4096, 128 threads) spilled.
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* smem) {
  write_warp_sums(a, b, smem);
  const int lane = threadIdx.x % 32;
  const float2 mine = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : make_float2(0.0f, 0.0f);
  return make_float2(warp_sum(mine.x), warp_sum(mine.y));
}

// kOut: 0 = x's dtype, 1 = E4M3, 2 = E5M2.
constexpr int kMaxThreads = 512;
// At least two blocks of kMaxThreads per SM caps the forward at 64 registers per thread. Without
// it the bf16 → bf16 instance at hidden 4096 (8 × 4 elements per thread) took 87 registers,
// which leaves room for 5 blocks of 128 threads per SM instead of 8. float32 inputs with 32
// elements per thread would spill under the cap, so they keep one.
template <typename T, int kVec, int kIters>
constexpr int kFwdMinBlocks = (sizeof(T) == 4 && kVec * kIters > 16) ? 1 : 2;

template <typename T, typename W, int kVec, int kIters, int kOut>
__global__ void __launch_bounds__(kMaxThreads, (kFwdMinBlocks<T, kVec, kIters>))
    layer_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ gamma,
                          const W* __restrict__ beta, int64_t rows, int hidden, float eps,
                          bool rms_norm, void* __restrict__ out, float* __restrict__ mean_out,
                          float* __restrict__ rstd_out, const float* __restrict__ scale_ptr,
                          float* __restrict__ scale_inv, float* __restrict__ amax) {
  constexpr bool kFp8 = kOut != 0;
  constexpr bool kE5M2 = kOut == 2;
  // LayerNorm: slots 0..31 for the mean, 32..63 for the variance (see block_sum2). RMSNorm has
  // one reduction per row: its rows alternate between the two sets.
  __shared__ float2 smem[2 * kReduceSlots];
  int rms_slots = 0;
  const float scale = kFp8 ? load_scale(scale_ptr, scale_inv) : 1.0f;
  const int nvec = hidden / kVec;
  const float inv_hidden = 1.0f / static_cast<float>(hidden);

  uint32_t max_bits = 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x, rms_slots ^= kReduceSlots) {
    const auto* xr = reinterpret_cast<const Vec<T, kVec>*>(x + row * hidden);
    float v[kIters][kVec];
    float sum = 0.0f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = threadIdx.x + it * blockDim.x;
      if (i < nvec) {
        const Vec<T, kVec> p = xr[i];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          v[it][j] = to_float(p.v[j]);
          sum += v[it][j];
        }
      }
    }
    const float mean = rms_norm ? 0.0f : block_sum(sum, smem) * inv_hidden;
    float squares = 0.0f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      if (threadIdx.x + it * blockDim.x < nvec) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = v[it][j] - mean;
          squares += d * d;
        }
      }
    }
    const int squares_slots = rms_norm ? rms_slots : kReduceSlots;
    const float rstd = rsqrtf(block_sum(squares, smem + squares_slots) * inv_hidden + eps);
    if (threadIdx.x == 0) {
      if (!rms_norm) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = threadIdx.x + it * blockDim.x;
      if (i >= nvec) continue;
      float y[kVec], g[kVec], b[kVec];
      if (gamma != nullptr) {
        load_weights<kVec>(gamma + i * kVec, g);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) g[j] = 1.0f;
      }
      if (beta != nullptr) {
        load_weights<kVec>(beta + i * kVec, b);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) b[j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] = (v[it][j] - mean) * rstd * g[j] + b[j];
      const int64_t offset = row * nvec + i;
      if constexpr (kFp8) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) max_bits = max(max_bits, abs_bits(y[j]));
        if constexpr (kVec == 1) {
          static_cast<uint8_t*>(out)[offset] = saturating_cast<kE5M2>(y[0], scale);
        } else {
          // Packed with shifts into one 4- or 8-byte word (kVec is 4 or 8): a byte array
          // indexed per element went through local memory.
          static_assert(kVec == 4 || kVec == 8, "FP8 output packs 4 or 8 elements");
          using Word = std::conditional_t<kVec == 8, unsigned long long, uint32_t>;
          Word packed = 0;
#pragma unroll
          for (int j = 0; j < kVec; j += 2) {
            packed |= static_cast<Word>(saturating_cast2<kE5M2>(y[j], y[j + 1], scale)) << (8 * j);
          }
          static_cast<Word*>(out)[offset] = packed;
        }
      } else {
        Vec<T, kVec> o;
#pragma unroll
        for (int j = 0; j < kVec; ++j) o.v[j] = from_float<T>(y[j]);
        static_cast<Vec<T, kVec>*>(out)[offset] = o;
      }
    }
  }
  if (kFp8 && amax != nullptr) block_amax_to_global(max_bits, amax);
}

// dx per row (plus dresidual's row with kResidual: read only as dx is written, so the
// registers that hold x and dy are not joined by a third row); dgamma/dbeta partial sums per
// block (rows strided by gridDim.x), reduced later.
// RMSNorm is a template parameter here, not a runtime flag as in the forward: as a flag it
// slowed the LayerNorm backward from 0.61 to 0.50 of the copy rate
// (bench/results/layer_norm_bwd_rms_template/). So is the residual: as a null-pointer test it
// cost the backward without one 6–7% on an H100 (bench/results/residual_backward/).
template <typename T, typename W, int kVec, int kIters, bool kRmsNorm, bool kResidual>
__global__ void __launch_bounds__(kMaxThreads)
    layer_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                          const float* __restrict__ mean, const float* __restrict__ rstd,
                          const W* __restrict__ gamma, int64_t rows, int hidden,
                          const T* __restrict__ dresidual, T* __restrict__ dx,
                          float* __restrict__ dgamma_part,
                          float* __restrict__ dbeta_part) {
  // Two slot sets, alternating row by row (see block_sum2).
  __shared__ float2 smem[2 * kReduceSlots];
  const int nvec = hidden / kVec;
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  float dg[kIters][kVec], db[kIters][kVec];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) dg[it][j] = db[it][j] = 0.0f;
  }
  auto gamma_at = [&](int i, float(&g)[kVec]) {
    if (gamma != nullptr) {
      load_weights<kVec>(gamma + i * kVec, g);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) g[j] = 1.0f;
    }
  };
  int slots = 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x, slots ^= kReduceSlots) {
    const auto* xr = reinterpret_cast<const Vec<T, kVec>*>(x + row * hidden);
    const auto* dyr = reinterpret_cast<const Vec<T, kVec>*>(dy + row * hidden);
    const float mu = kRmsNorm ? 0.0f : mean[row], rs = rstd[row];
    float xv[kIters][kVec], dv[kIters][kVec];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = threadIdx.x + it * blockDim.x;
      if (i < nvec) {
        const Vec<T, kVec> xp = xr[i], dp = dyr[i];
        float g[kVec];
        gamma_at(i, g);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          xv[it][j] = to_float(xp.v[j]);
          dv[it][j] = to_float(dp.v[j]);
          const float xhat = (xv[it][j] - mu) * rs;
          const float wdy = dv[it][j] * g[j];
          s1 += wdy;
          s2 += wdy * xhat;
          dg[it][j] += dv[it][j] * xhat;
          db[it][j] += dv[it][j];
        }
      }
    }
    const float2 sums = block_sum2(s1, s2, smem + slots);
    // RMSNorm's output does not depend on x's mean: no mean(g) term.
    const float mean_wdy = kRmsNorm ? 0.0f : sums.x * inv_hidden;
    const float mean_wdy_xhat = sums.y * inv_hidden;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = threadIdx.x + it * blockDim.x;
      if (i >= nvec) continue;
      float g[kVec];
      gamma_at(i, g);
      Vec<T, kVec> r;
      if constexpr (kResidual) {
        r = reinterpret_cast<const Vec<T, kVec>*>(dresidual + row * hidden)[i];
      }
      Vec<T, kVec> o;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = (xv[it][j] - mu) * rs;
        const float d = rs * (dv[it][j] * g[j] - mean_wdy - xhat * mean_wdy_xhat);
        // __fadd_rn: never contracted into an FMA, so that in float32 the sum is the bytes of
        // dx + dresidual added apart (autograd's sum of the two gradients).
        o.v[j] = from_float<T>(kResidual ? __fadd_rn(d, to_float(r.v[j])) : d);
      }
      reinterpret_cast<Vec<T, kVec>*>(dx + row * hidden)[i] = o;
    }
  }
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = threadIdx.x + it * blockDim.x;
    if (i >= nvec) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = static_cast<int64_t>(blockIdx.x) * hidden + i * kVec + j;
      if (dgamma_part != nullptr) dgamma_part[c] = dg[it][j];
      if (dbeta_part != nullptr) dbeta_part[c] = db[it][j];
    }
  }
}

// How a row of `hidden` elements is spread over a block: `vec` elements per access, `iters`
// accesses per thread (at most max_elems elements per thread, so the row fits in registers),
// `threads` threads (a multiple of 32; preferred_threads or fewer when possible, never more
// than kMaxThreads).
struct RowPlan {
  int vec = 0;
  int iters = 0;
  int threads = 0;
  bool ok() const { return vec != 0; }
};

RowPlan plan_row(int64_t hidden, int elem_bytes, bool aligned, int preferred_threads,
                 int max_elems) {
  const int wide = 16 / elem_bytes;
  const int vec = (aligned && hidden % wide == 0) ? wide : 1;
  const int64_t nvec = hidden / vec;
  for (int limit : {preferred_threads, kMaxThreads}) {
    for (int iters : {1, 2, 4, 8}) {
      if (iters * vec > max_elems) break;
      const int64_t threads = std::max<int64_t>(32, ((nvec + iters - 1) / iters + 31) / 32 * 32);
      if (threads <= limit) return RowPlan{vec, iters, static_cast<int>(threads)};
    }
  }
  return RowPlan{};
}

// Calls f(std::integral_constant<int, kVec>, std::integral_constant<int, kIters>) for a plan.
template <int kWide, typename F>
int dispatch_plan(const RowPlan& plan, F&& f) {
  auto with_iters = [&](auto vec) {
    switch (plan.iters) {
      case 1:
        return f(vec, std::integral_constant<int, 1>{});
      case 2:
        return f(vec, std::integral_constant<int, 2>{});
      case 4:
        return f(vec, std::integral_constant<int, 4>{});
      default:
        return f(vec, std::integral_constant<int, 8>{});
    }
  };
  if (plan.vec == 1) return with_iters(std::integral_constant<int, 1>{});
  return with_iters(std::integral_constant<int, kWide>{});
}

// Registers: the forward keeps kIters × kVec inputs per thread, the backward four times as
// many values (x, dy and the dgamma/dbeta partials), hence the smaller limit.
constexpr int kFwdMaxElems = 32;
constexpr int kBwdPreferredThreads = 512, kBwdMaxElems = 16;

// Calls f(W{}) with W the type gamma and beta are read in (and dgamma, dbeta written in):
// float32 or the rows' own type T, nothing else (a parameter in another half type is cast to
// float32 by the caller).
template <typename T, typename F>
int dispatch_weight(InputType weight_type, InputType type, F&& f) {
  if (weight_type == InputType::kFloat) return f(float{});
  if (weight_type == type) return f(T{});
  return static_cast<int>(cudaErrorInvalidValue);
}

// The backward kernel instance for a normalization and a residual (or none).
template <typename T, typename W, int kVec, int kIters>
auto bwd_kernel(bool rms_norm, bool residual) {
  return rms_norm ? (residual ? layer_norm_bwd_kernel<T, W, kVec, kIters, true, true>
                              : layer_norm_bwd_kernel<T, W, kVec, kIters, true, false>)
                  : (residual ? layer_norm_bwd_kernel<T, W, kVec, kIters, false, true>
                              : layer_norm_bwd_kernel<T, W, kVec, kIters, false, false>);
}

// Blocks of the backward kernel for `plan` resident on one SM at once. The occupancy API, not
// 2048 / threads: the kernel's registers decide it (61 per thread for bf16 rows of 8-element
// vectors: two blocks of 512 threads, not four). Cached per instance: this runs on every call.
template <typename T, typename W>
int bwd_blocks_per_sm(const RowPlan& plan, bool rms_norm, bool residual) {
  constexpr int kWide = 16 / sizeof(T);
  // [rms_norm][residual][vec is 1 or kWide][log2 iters][threads / 32 - 1]; 0 = not asked yet.
  static std::atomic<int> cache[2][2][2][4][kMaxThreads / 32];
  const int iters_log2 = plan.iters == 1 ? 0 : plan.iters == 2 ? 1 : plan.iters == 4 ? 2 : 3;
  std::atomic<int>& slot = cache[rms_norm ? 1 : 0][residual ? 1 : 0][plan.vec == 1 ? 0 : 1]
                                [iters_log2][plan.threads / 32 - 1];
  if (const int known = slot.load(std::memory_order_relaxed)) return known;
  int blocks = 0;
  dispatch_plan<kWide>(plan, [&](auto vec, auto iters) {
    constexpr int kVec = decltype(vec)::value, kIters = decltype(iters)::value;
    if constexpr (kVec * kIters <= kBwdMaxElems) {
      const auto kernel = bwd_kernel<T, W, kVec, kIters>(rms_norm, residual);
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, plan.threads, 0) !=
          cudaSuccess) {
        blocks = 0;
      }
    }
    return 0;
  });
  blocks = std::max(1, blocks);
  slot.store(blocks, std::memory_order_relaxed);
  return blocks;
}

// At most one wave of resident blocks, each a grid-strided share of the rows and one row of
// dgamma and dbeta partial sums: more blocks would add partial rows (written, then read by the
// column sum) without adding rows in flight. And at least kMinRowsPerPart rows per block: a
// partial row costs 8 bytes per column (dgamma and dbeta, written and read back) against 6 per
// element of a row, so with fewer rows per block the partials become a sizeable share of the
// traffic. Measured (bench/results/layer_norm_bwd_rows_per_part/, H100): at 8192 × 1024 one
// wave is 1056 blocks of 7.75 rows, 0.36 of the copy rate; 528 blocks of 15.5 rows, 0.41.
constexpr int64_t kMinRowsPerPart = 16;

template <typename T, typename W>
int bwd_parts(int64_t rows, const RowPlan& plan, bool rms_norm, bool residual) {
  const int64_t resident =
      static_cast<int64_t>(num_sms()) * bwd_blocks_per_sm<T, W>(plan, rms_norm, residual);
  return static_cast<int>(std::max<int64_t>(1, std::min(rows / kMinRowsPerPart, resident)));
}

}  // namespace

int launch_layer_norm_fwd(const void* x, InputType type, const void* gamma, const void* beta,
                          InputType weight_type, int64_t rows, int64_t hidden, float eps,
                          bool rms_norm, void* out, int out_fp8, float* mean, float* rstd, const float* scale,
                          float* scale_inv, float* amax, bool accumulate_amax, Stream stream,
                          int preferred_threads) {
  if (preferred_threads < 32 || preferred_threads > kMaxThreads || preferred_threads % 32 != 0 ||
      (rms_norm && beta != nullptr) || (!rms_norm && mean == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (out_fp8 != 0 && amax != nullptr && !accumulate_amax) {
    if (auto err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return err;
  }
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    return dispatch_weight<T>(weight_type, type, [&](auto weight_tag) {
      using W = decltype(weight_tag);
      constexpr int kWide = 16 / sizeof(T);
      const bool aligned = aligned16(x) && aligned16(out) &&
                           (gamma == nullptr || aligned16(gamma)) &&
                           (beta == nullptr || aligned16(beta)) &&
                           (out_fp8 == 0 || (reinterpret_cast<uintptr_t>(out) % kWide == 0));
      const RowPlan plan = plan_row(hidden, sizeof(T), aligned, preferred_threads, kFwdMaxElems);
      if (!plan.ok() || hidden > (int64_t{1} << 30)) return kUnsupportedShape;
      const int64_t resident = static_cast<int64_t>(num_sms()) * (2048 / plan.threads);
      const int grid = static_cast<int>(std::min(rows, resident));
      return dispatch_plan<kWide>(plan, [&](auto vec, auto iters) {
        constexpr int kVec = decltype(vec)::value, kIters = decltype(iters)::value;
        if constexpr (kVec * kIters > kFwdMaxElems) {
          return kUnsupportedShape;  // never planned
        } else {
          const auto* in = static_cast<const T*>(x);
          const auto* g = static_cast<const W*>(gamma);
          const auto* b = static_cast<const W*>(beta);
          const int h = static_cast<int>(hidden);
          switch (out_fp8) {
            case 0:
              layer_norm_fwd_kernel<T, W, kVec, kIters, 0><<<grid, plan.threads, 0, stream>>>(
                  in, g, b, rows, h, eps, rms_norm, out, mean, rstd, scale, scale_inv, amax);
              break;
            case 1:
              layer_norm_fwd_kernel<T, W, kVec, kIters, 1><<<grid, plan.threads, 0, stream>>>(
                  in, g, b, rows, h, eps, rms_norm, out, mean, rstd, scale, scale_inv, amax);
              break;
            default:
              layer_norm_fwd_kernel<T, W, kVec, kIters, 2><<<grid, plan.threads, 0, stream>>>(
                  in, g, b, rows, h, eps, rms_norm, out, mean, rstd, scale, scale_inv, amax);
              break;
          }
          return static_cast<int>(cudaGetLastError());
        }
      });
    });
  });
}

namespace {
RowPlan bwd_plan(const void* dy, const void* x, const void* dresidual, const void* dx,
                 const void* gamma, int64_t hidden, int elem_bytes) {
  const bool aligned = aligned16(dy) && aligned16(x) && aligned16(dx) &&
                       (dresidual == nullptr || aligned16(dresidual)) &&
                       (gamma == nullptr || aligned16(gamma));
  if (hidden > (int64_t{1} << 30)) return RowPlan{};
  return plan_row(hidden, elem_bytes, aligned, kBwdPreferredThreads, kBwdMaxElems);
}
}  // namespace

int layer_norm_bwd_parts(const void* dy, const void* x, const void* dresidual, const void* dx,
                         const void* gamma, InputType type, InputType weight_type, int64_t rows,
                         int64_t hidden, bool rms_norm) {
  if (weight_type != InputType::kFloat && weight_type != type) return 0;
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    const RowPlan plan = bwd_plan(dy, x, dresidual, dx, gamma, hidden, sizeof(T));
    if (!plan.ok()) return 0;
    return dispatch_weight<T>(weight_type, type, [&](auto weight_tag) {
      return bwd_parts<T, decltype(weight_tag)>(rows, plan, rms_norm, dresidual != nullptr);
    });
  });
}

int launch_layer_norm_bwd(const void* dy, const void* x, InputType type, bool rms_norm,
                          const float* mean, const float* rstd, const void* gamma,
                          InputType weight_type, int64_t rows, int64_t hidden,
                          const void* dresidual, void* dx, float* part, int parts, void* dgamma,
                          void* dbeta, Stream stream) {
  if ((rms_norm && dbeta != nullptr) || (!rms_norm && mean == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return dispatch_input(type, [&](auto tag) {
    using T = decltype(tag);
    return dispatch_weight<T>(weight_type, type, [&](auto weight_tag) {
      using W = decltype(weight_tag);
      constexpr int kWide = 16 / sizeof(T);
      const RowPlan plan = bwd_plan(dy, x, dresidual, dx, gamma, hidden, sizeof(T));
      if (!plan.ok()) return kUnsupportedShape;
      if (parts < 1) return static_cast<int>(cudaErrorInvalidValue);
      float* dgamma_part = dgamma != nullptr ? part : nullptr;
      float* dbeta_part = dbeta != nullptr ? part + static_cast<int64_t>(parts) * hidden : nullptr;
      const int err = dispatch_plan<kWide>(plan, [&](auto vec, auto iters) {
        constexpr int kVec = decltype(vec)::value, kIters = decltype(iters)::value;
        if constexpr (kVec * kIters > kBwdMaxElems) {
          return kUnsupportedShape;  // never planned
        } else {
          const auto kernel = bwd_kernel<T, W, kVec, kIters>(rms_norm, dresidual != nullptr);
          kernel<<<parts, plan.threads, 0, stream>>>(
              static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd,
              static_cast<const W*>(gamma), rows, static_cast<int>(hidden),
              static_cast<const T*>(dresidual), static_cast<T*>(dx), dgamma_part, dbeta_part);
          return static_cast<int>(cudaGetLastError());
        }
      });
      if (err != 0) return err;
      // dgamma's and dbeta's partial sums are adjacent in `part`: one launch sums both.
      if (dgamma != nullptr && dbeta != nullptr) {
        return launch_column_sum(part, parts, hidden, dgamma, weight_type, stream, dbeta);
      }
      if (dgamma != nullptr) {
        return launch_column_sum(dgamma_part, parts, hidden, dgamma, weight_type, stream);
      }
      if (dbeta != nullptr) {
        return launch_column_sum(dbeta_part, parts, hidden, dbeta, weight_type, stream);
      }
      return 0;
    });
  });
}

}  // namespace amp8::cuda
