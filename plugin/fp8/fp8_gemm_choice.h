#pragma once
// Which GEMMs run in FP8: the fp8_min_gemm_size knob and its measured per-shape default.

#include <cstdint>

namespace amp8 {

/// fp8_min_gemm_size's value for "choose per GEMM shape" (fp8_gemm_pays_off), its default.
inline constexpr int64_t kFp8GemmSizeByShape = -1;

/// The one default of every `fp8_min_gemm_size` knob (Fp8LinearOptions, Fp8LayerNormLinearOptions,
/// Fp8LayerNormMLPOptions, Fp8ConversionOptions, MixedPrecisionOptions, gpt_pretrain's flag):
/// per shape, where FP8 was measured faster.
inline constexpr int64_t kDefaultFp8MinGemmSize = kFp8GemmSizeByShape;

/// Whether an Fp8Linear with rows × in_features × out_features GEMMs (forward, dgrad, wgrad)
/// was measured faster in FP8 (delayed scaling) than in high precision on an H200: against
/// torch::nn::Linear under bf16 autocast, or, with `fp8_params` (weights held only in FP8),
/// against the same layer kept in high precision, which dequantizes its weight each call.
/// `fp8_linear_bench grid` over rows 1024..16384 and features 1024..8192 (powers of two;
/// bench/results/fp8_linear_gemm_grid.jsonl → plugin/fp8/detail/fp8_gemm_table.h). Each
/// dimension is rounded down to the grid (a shape is judged by the largest measured one it
/// contains); below the grid's smallest value in any dimension: false.
bool fp8_gemm_pays_off(int64_t rows, int64_t in_features, int64_t out_features, bool fp8_params);

/// Whether such a GEMM runs in FP8 under `fp8_min_gemm_size`: kFp8GemmSizeByShape →
/// fp8_gemm_pays_off; a size ≥ 0 → rows × in_features × out_features ≥ it (0: every GEMM).
bool fp8_gemm_chosen(int64_t rows, int64_t in_features, int64_t out_features,
                     int64_t fp8_min_gemm_size, bool fp8_params);

/// Checks a knob's value (≥ 0, or kFp8GemmSizeByShape), naming `knob` in the error.
void check_fp8_min_gemm_size(int64_t fp8_min_gemm_size, const char* knob);

}  // namespace amp8
