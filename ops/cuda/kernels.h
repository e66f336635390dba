#pragma once
// Host launchers of the CUDA kernels. Plain C++: no LibTorch, no CUDA headers, so that .cu files
// stay free of LibTorch and .cc files free of kernels. Each returns a cudaError_t as int.

#include <cstdint>

struct CUstream_st;

namespace amp8::cuda {

using Stream = CUstream_st*;

enum class InputType { kFloat, kBFloat16, kHalf };

// amax (when non-null) is overwritten with max|x|, or max-merged into when accumulate_amax
// (it must then hold a non-negative float or NaN).
int launch_quantize(const void* x, InputType type, void* out, int64_t n, const float* scale,
                    float* scale_inv, float* amax, bool accumulate_amax, bool e5m2, Stream stream);

int launch_cast_transpose(const void* x, InputType type, void* out, void* out_t, int64_t rows,
                          int64_t cols, const float* scale, float* scale_inv, float* amax,
                          bool accumulate_amax, bool e5m2, Stream stream);

// The same with an explicit tile width (64 or 128 columns) for tuning; launch_cast_transpose
// uses kDefaultCastTransposeTileCols.
inline constexpr int kDefaultCastTransposeTileCols = 128;  // measured: bench/results
int launch_cast_transpose_tiled(const void* x, InputType type, void* out, void* out_t, int64_t rows,
                                int64_t cols, const float* scale, float* scale_inv, float* amax,
                                bool accumulate_amax, bool e5m2, int tile_cols, Stream stream);

int launch_amax(const void* x, InputType type, int64_t n, float* amax, Stream stream);

int launch_current_scale(const float* amax, float* scale, float fp8_max, float margin_divisor,
                         Stream stream);

struct ScalingGroupPointers {
  float* amax_history;  // [history_len, slots]
  float* scale;         // [slots]
  float* scale_inv;     // [slots]
  int64_t slots;
};

// One launch per 256 groups.
int launch_delayed_scaling_update(const ScalingGroupPointers* groups, int num_groups,
                                  int64_t history_len, bool most_recent, float fp8_max,
                                  float margin_divisor, Stream stream);

}  // namespace amp8::cuda
