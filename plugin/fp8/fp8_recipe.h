#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>

#include "ops/fp8_format.h"
#include "ops/scaling.h"
#include "plugin/fp8/fp8_gemm_choice.h"  // kDefaultFp8MinGemmSize

namespace amp8 {

/// The largest useful fp8_margin: E4M3's largest value 448 / 2^18 = 0.0017 still rounds to its
/// smallest subnormal 2^-9; with 2^19 every value rounds to zero.
inline constexpr int kMaxFp8Margin = 18;

/// How each FP8 tensor's scale is chosen.
enum class Fp8Scaling {
  kDelayed,     ///< from the tensor's amax history (TE's DelayedScaling)
  kTensorwise,  ///< from the tensor's own amax, just before it is quantized (current scaling)
  kBlockwise,   ///< one scale per 1×128 tile (activations, gradients) or 128×128 block
                ///< (weights), from the tile's own amax (TE's Float8BlockScaling, DeepSeek-V3)
};

/// An Fp8RecipeOptions parsed and validated once (Fp8RecipeOptions::resolve): what regions,
/// modules and backward passes read on every call, without strings.
struct Fp8Recipe {
  Fp8Format forward_format = Fp8Format::kE4M3;   ///< activations and weights
  Fp8Format backward_format = Fp8Format::kE5M2;  ///< gradients: E5M2 under "hybrid", else E4M3
  int margin = 0;
  int64_t amax_history_len = 1024;
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::kMax;
  Fp8Scaling scaling = Fp8Scaling::kDelayed;

  bool delayed() const { return scaling == Fp8Scaling::kDelayed; }
  bool blockwise() const { return scaling == Fp8Scaling::kBlockwise; }
  bool operator==(const Fp8Recipe&) const = default;
};

/// The FP8 recipe: Transformer Engine's DelayedScaling knobs under NeMo's names. Defaults are
/// TE's and NeMo's FP8 presets; Megatron's MixedPrecisionPlugin defaults (history 1,
/// "most_recent") are the documented alternative.
///
///   Fp8RecipeOptions().fp8("hybrid").fp8_amax_history_len(1024).fp8_amax_compute_algo("max")
struct Fp8RecipeOptions {
  /// "hybrid": E4M3 for activations and weights (forward), E5M2 for gradients (backward);
  /// "e4m3": E4M3 everywhere. Default: "hybrid".
  TORCH_ARG(std::string, fp8) = "hybrid";
  /// scale = (fp8_max / amax) / 2^fp8_margin; a margin leaves headroom. In [0, kMaxFp8Margin]:
  /// a larger one scales every value below E4M3's smallest subnormal. Default: 0. It applies to
  /// the scales the modules compute; FP8 weights stored under fp8_params are written after each
  /// step from their masters' exact amax, without a margin.
  TORCH_ARG(int, fp8_margin) = 0;
  /// Steps of amax history per tensor. Default: 1024.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 1024;
  /// "max": the largest amax in the history; "most_recent": the last step's. Default: "max".
  TORCH_ARG(std::string, fp8_amax_compute_algo) = "max";
  /// "delayed": scales from the amax history (TE's DelayedScaling); "tensorwise": each tensor
  /// scaled from its own amax just before it is quantized (current scaling); "blockwise": one
  /// power-of-two scale per 1×128 tile of activations and gradients and per 128×128 block of
  /// weights (TE's Float8BlockScaling; Hopper GEMMs through cuBLASLt's block-scaled modes).
  /// "mxfp8" is refused (Blackwell only). Default: "delayed".
  TORCH_ARG(std::string, fp8_recipe) = "delayed";

 public:
  /// Throws c10::Error naming the first bad knob and its accepted values.
  void validate() const;
  /// validate(), then the knobs as enums: the only place their strings are read.
  Fp8Recipe resolve() const;
};

std::ostream& operator<<(std::ostream& os, const Fp8RecipeOptions& recipe);

}  // namespace amp8
