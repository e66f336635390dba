#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "plugin/fp8/fp8_recipe.h"

namespace amp8 {

/// How convert_to_fp8 builds the FP8 modules.
struct Fp8ConversionOptions {
  /// As Fp8LinearOptions::fp8_amax_history_len. Default: 1024.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 1024;
  /// As Fp8LinearOptions::fp8_min_gemm_size; set on every Fp8Linear of the model, swapped in
  /// or already there. Default: kDefaultFp8MinGemmSize (per shape).
  TORCH_ARG(int64_t, fp8_min_gemm_size) = kDefaultFp8MinGemmSize;
  /// Build the Fp8Linear modules with their weights kept only in FP8 (as under Fp8ModelInit).
  /// Default: false.
  TORCH_ARG(bool, fp8_params) = false;
  /// Layers at the start / end of the model left in high precision (NeMo's knobs; see
  /// convert_to_fp8 for what a layer is). Default: 0.
  TORCH_ARG(int64_t, num_layers_at_start_in_bf16) = 0;
  /// Default: 0.
  TORCH_ARG(int64_t, num_layers_at_end_in_bf16) = 0;
  /// Fuse runs of a torch::nn::Sequential's children the way Transformer Engine's modules are
  /// fused: LayerNorm → Linear → GELU(tanh) → Linear into one Fp8LayerNormMLP, LayerNorm →
  /// Linear into one Fp8LayerNormLinear (see convert_to_fp8). Default: true.
  TORCH_ARG(bool, fuse_modules) = true;
};

/// The slot of a torch::nn::Sequential whose module convert_to_fp8 fused into the module of an
/// earlier slot (a Linear or GELU folded into an Fp8LayerNormLinear / Fp8LayerNormMLP). Its
/// forward passes the input through. It names the part of the fused module that now holds the
/// parameters of the module it replaced, so that export_fp32_model writes the model in its
/// original layout. Positions and parts, not names: a clone of the Sequential (which renames its
/// children "0", "1", ...) stays right.
class FusedSlotImpl : public torch::nn::Cloneable<FusedSlotImpl> {
 public:
  FusedSlotImpl() = default;
  FusedSlotImpl(std::string replaced, int64_t fused_offset, std::string part, std::string fused_slot_part)
      : replaced(std::move(replaced)),
        fused_offset(fused_offset),
        part(std::move(part)),
        fused_slot_part(std::move(fused_slot_part)) {}

  void reset() override {}
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input) { return input; }

  /// The module this slot held, as it printed (e.g. "torch::nn::GELU(approximate=tanh)").
  std::string replaced;
  /// How many slots before this one the fused module sits (1 for the slot right after it).
  int64_t fused_offset = 1;
  /// The fused module's part holding the replaced module's parameters ("ln_fc1.linear"); empty
  /// when it had none (GELU).
  std::string part;
  /// Set on the slot right after the fused module only: the part holding the parameters of the
  /// module the fused module's own slot held (its LayerNorm, "ln_fc1.layer_norm").
  std::string fused_slot_part;
};

TORCH_MODULE(FusedSlot);

/// One module swapped by convert_to_fp8.
struct ConvertedModule {
  std::string path;                               ///< e.g. "blocks.3.fc1"
  /// The Fp8Linear / Fp8LayerNorm, or the Fp8LayerNormLinear / Fp8LayerNormMLP a run of a
  /// Sequential was fused into (`path` its first slot; the FusedSlot modules are not listed).
  std::shared_ptr<torch::nn::Module> replacement;
  /// The parent calls its children through its registry (torch::nn::Sequential, ModuleList,
  /// ModuleDict), so the swap is certain to take effect. Otherwise the parent may hold the old
  /// module in a typed member that a swap cannot reach; MixedPrecisionPlugin then checks that
  /// the replacement is the module that actually runs.
  bool parent_is_container = false;
  /// The module swapped out. Alive after convert_to_fp8 only while something outside the
  /// registry holds it: in practice a typed member of the parent, which its forward calls.
  std::weak_ptr<torch::nn::Module> original;
};

struct Fp8Conversion {
  std::vector<ConvertedModule> modules;
  /// (old parameter, new parameter) for every parameter of a swapped module, so that an
  /// optimizer built before the swap can be pointed at the new ones. Without fp8_params the
  /// new parameter shares the old one's storage. The old parameters stay allocated while this
  /// list holds them: clear it once the optimizer is re-pointed (MixedPrecisionPlugin does so
  /// in convert_optimizer).
  std::vector<std::pair<torch::Tensor, torch::Tensor>> replaced_params;
  /// Modules FP8 could take that were left in high precision (bf16 layers), and
  /// torch::nn::Linear modules whose shape FP8 cannot take (a dimension not a multiple of 16).
  std::vector<std::string> kept_in_high_precision;
  /// Fp8Linear modules that will run FP8 GEMMs: swapped in, or already in the model.
  int64_t fp8_linear_count = 0;
};

/// Replaces every torch::nn::Linear whose in/out features are multiples of 16 with an
/// Fp8Linear, and every torch::nn::LayerNorm with an Fp8LayerNorm, anywhere in `model`'s tree,
/// moving the parameters (same values; without fp8_params the same storage).
///
/// With fuse_modules, runs of a torch::nn::Sequential's children (the one container whose data
/// flow its order states) become the fused modules a Transformer Engine model is built from:
///   LayerNorm({h}) → Linear(h, f) → GELU(tanh) → Linear(f, h)   an Fp8LayerNormMLP
///   LayerNorm({h}) → Linear(h, n)                                an Fp8LayerNormLinear
/// (the LayerNorm with its affine parameters; the linear layers FP8-eligible, the MLP's two
/// with or both without bias; none kept in bf16, none held by the Sequential twice). The fused module takes the run's first slot
/// and FusedSlot modules the others, so the parameters are named after the fused module's parts
/// ("mlp.0.ln_fc1.linear.weight"); export_fp32_model writes them under the original names. GELU
/// without the tanh approximation is not fused (TE's LayerNormMLP computes the tanh form).
///
/// Fp8Linear modules
/// already in the model (also inside Fp8LayerNormLinear) are kept, with fp8_min_gemm_size set
/// and, inside a kept layer, keep_in_high_precision.
///
/// Layers for num_layers_at_start/end_in_bf16: the children of the model's layer stack — the
/// torch::nn::ModuleList or Sequential with the most children that contain a linear layer
/// (a GPT's blocks) — or, when the model has none, each eligible linear layer in registration
/// order. Everything inside a kept layer (linear and LayerNorm) stays as it is.
///
/// Throws when the model has no linear layer FP8 could run (naming the knobs), when more
/// layers are kept in bf16 than the model has, and, with fp8_params, when Fp8Linear modules
/// already in the model that run FP8 hold high-precision weights (naming them; they were not
/// built under Fp8ModelInit, and fp8_params cannot reach them).
Fp8Conversion convert_to_fp8(torch::nn::Module& model, const Fp8ConversionOptions& options = {});

}  // namespace amp8
