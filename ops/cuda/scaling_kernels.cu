// Bulk delayed-scaling update: amax from history, history roll, scale and scale_inv, for every
// slot of up to kLargeCapacity groups in one launch.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda/kernels.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/detail/scale_formula.h"

namespace amp8::cuda {
namespace {

// The group table travels as kernel parameters (no copy to the device first). Two sizes, so
// that a call with few groups does not pay for passing a 30 KB table; CUDA >= 12.1 allows up
// to 32764 bytes of parameters.
constexpr int kSmallCapacity = 64;
constexpr int kLargeCapacity = 960;
// 8 consecutive float slots are one 32-byte sector: each history row is read in whole sectors,
// and 1000 slots spread over 125 blocks.
constexpr int kSlotsPerBlock = 8;
// 1024 threads: a history of up to 1024 rows is read in one pass, one load wave.
constexpr int kRowThreads = 128;
constexpr int kRowsPerThread = 8;
constexpr int kRowsPerPass = kRowThreads * kRowsPerThread;

template <int kCapacity>
struct BulkParams {
  float* amax_history[kCapacity];
  float* scale[kCapacity];
  float* scale_inv[kCapacity];
  int slots[kCapacity];
  int first_slot[kCapacity + 1];  // prefix sums of slots
  int num_groups;
  int history_len;
};
static_assert(sizeof(BulkParams<kLargeCapacity>) + 16 < 32764, "kernel parameters too large");

template <int kCapacity>
__global__ void __launch_bounds__(kSlotsPerBlock* kRowThreads)
    delayed_scaling_kernel(const __grid_constant__ BulkParams<kCapacity> p, bool most_recent,
                           float fp8_max, float margin_divisor) {
  __shared__ float partial[kRowThreads][kSlotsPerBlock];
  const int lane = threadIdx.x % kSlotsPerBlock;
  const int row_thread = threadIdx.x / kSlotsPerBlock;
  const int global_slot = blockIdx.x * kSlotsPerBlock + lane;
  const bool active = global_slot < p.first_slot[p.num_groups];

  const int group = entry_of(p.first_slot, p.num_groups, global_slot);
  float* history = p.amax_history[group];
  const int slots = p.slots[group];
  const int slot = global_slot - p.first_slot[group];
  const int history_len = p.history_len;

  const float newest = active ? history[slot] : 0.0f;
  float amax = newest;
  __syncthreads();  // row 0 is read by all before pass 0 overwrites it

  // Roll one row towards the front: new[r] = old[r + 1], new[last] = old[0], then new[0] = 0.
  // Each pass reads its rows before a barrier and writes them after it; the row read past the
  // end of a pass is written only by the next pass.
  for (int base = 0; base < history_len; base += kRowsPerPass) {
    float values[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = base + row_thread * kRowsPerThread + i;
      values[i] = 0.0f;
      if (active && r < history_len) {
        values[i] =
            r + 1 < history_len ? history[static_cast<int64_t>(r + 1) * slots + slot] : newest;
        if (!most_recent) amax = detail::nan_max(amax, values[i]);
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = base + row_thread * kRowsPerThread + i;
      if (active && r < history_len) {
        history[static_cast<int64_t>(r) * slots + slot] = r == 0 ? 0.0f : values[i];
      }
    }
    __syncthreads();
  }

  partial[row_thread][lane] = amax;
  __syncthreads();
  if (row_thread == 0 && active) {
    float result = partial[0][lane];
#pragma unroll
    for (int j = 1; j < kRowThreads; ++j) result = detail::nan_max(result, partial[j][lane]);
    const float previous = p.scale[group][slot];
    const float next = detail::scale_from_amax(result, previous, fp8_max, margin_divisor);
    p.scale[group][slot] = next;
    p.scale_inv[group][slot] = 1.0f / next;
  }
}

template <int kCapacity>
int launch_chunks(const ScalingGroupPointers* groups, int num_groups, int64_t history_len,
                  bool most_recent, float fp8_max, float margin_divisor, Stream stream) {
  for (int begin = 0; begin < num_groups; begin += kCapacity) {
    BulkParams<kCapacity> params{};
    params.num_groups = std::min(kCapacity, num_groups - begin);
    params.history_len = static_cast<int>(history_len);
    params.first_slot[0] = 0;
    for (int i = 0; i < params.num_groups; ++i) {
      const auto& g = groups[begin + i];
      params.amax_history[i] = g.amax_history;
      params.scale[i] = g.scale;
      params.scale_inv[i] = g.scale_inv;
      params.slots[i] = static_cast<int>(g.slots);
      params.first_slot[i + 1] = params.first_slot[i] + static_cast<int>(g.slots);
    }
    const int total = params.first_slot[params.num_groups];
    if (total == 0) continue;
    const int blocks = (total + kSlotsPerBlock - 1) / kSlotsPerBlock;
    delayed_scaling_kernel<kCapacity><<<blocks, kSlotsPerBlock * kRowThreads, 0, stream>>>(
        params, most_recent, fp8_max, margin_divisor);
    if (auto err = cudaGetLastError()) return static_cast<int>(err);
  }
  return static_cast<int>(cudaSuccess);
}

}  // namespace

int launch_delayed_scaling_update(const ScalingGroupPointers* groups, int num_groups,
                                  int64_t history_len, bool most_recent, float fp8_max,
                                  float margin_divisor, Stream stream) {
  if (num_groups <= kSmallCapacity) {
    return launch_chunks<kSmallCapacity>(groups, num_groups, history_len, most_recent, fp8_max,
                                         margin_divisor, stream);
  }
  return launch_chunks<kLargeCapacity>(groups, num_groups, history_len, most_recent, fp8_max,
                                       margin_divisor, stream);
}

}  // namespace amp8::cuda
