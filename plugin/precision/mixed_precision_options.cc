// MixedPrecisionOptions: the precision's name, dtypes and validation (mixed_precision_plugin.h).
#include <c10/util/Exception.h>

#include <string>

#include "plugin/fp8/fp8_gemm_choice.h"
#include "plugin/optim/fused_optimizer.h"
#include "plugin/precision/loss_scaler.h"
#include "plugin/precision/mixed_precision_plugin.h"

namespace amp8 {
std::string MixedPrecisionOptions::canonical_precision() const {
  if (precision_ == "32" || precision_ == "32-true") return "32";
  if (precision_ == "16-mixed" || precision_ == "fp16-mixed") return "16-mixed";
  if (precision_ == "bf16-mixed") return "bf16-mixed";
  TORCH_CHECK(false,
              "precision must be \"32\" (or \"32-true\"), \"16-mixed\" (or \"fp16-mixed\") or "
              "\"bf16-mixed\", got \"",
              precision_, "\"");
}

c10::ScalarType MixedPrecisionOptions::compute_dtype() const {
  const auto precision = canonical_precision();
  if (precision == "16-mixed") return at::kHalf;
  if (precision == "bf16-mixed") return at::kBFloat16;
  return at::kFloat;
}

c10::ScalarType MixedPrecisionOptions::resolved_params_dtype() const {
  return params_dtype_ ? *params_dtype_ : compute_dtype();
}

Fp8RecipeOptions MixedPrecisionOptions::fp8_recipe_options() const {
  return Fp8RecipeOptions()
      .fp8(fp8_)
      .fp8_margin(fp8_margin_)
      .fp8_amax_history_len(fp8_amax_history_len_)
      .fp8_amax_compute_algo(fp8_amax_compute_algo_)
      .fp8_recipe(fp8_recipe_);
}

void MixedPrecisionOptions::validate() const {
  const auto precision = canonical_precision();
  if (params_dtype_) {
    const auto dtype = *params_dtype_;
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                "params_dtype must be float32, float16 or bfloat16, got ", c10::toString(dtype));
  }
  TORCH_CHECK(fp8_ == "none" || fp8_ == "hybrid" || fp8_ == "e4m3",
              "fp8 must be \"none\", \"hybrid\" or \"e4m3\", got \"", fp8_, "\"");
  if (fp8_enabled()) {
    TORCH_CHECK(precision != "32", "fp8 = \"", fp8_,
                "\" needs a mixed precision (\"bf16-mixed\" or \"16-mixed\"); precision \"32\" "
                "takes only fp8 = \"none\"");
    fp8_recipe_options().validate();
  }
  TORCH_CHECK(fp8_params_ == false || fp8_enabled(),
              "fp8_params = true needs fp8 = \"hybrid\" or \"e4m3\", got fp8 = \"none\"");
  check_fp8_min_gemm_size(fp8_min_gemm_size_, "fp8_min_gemm_size");
  const AdamMomentDtypes moments{exp_avg_dtype_, exp_avg_sq_dtype_};
  moments.check("MixedPrecisionOptions");
  TORCH_CHECK(moments.is_float32() || fused_optimizer_, "MixedPrecisionOptions: exp_avg_dtype / exp_avg_sq_dtype "
              "bfloat16 needs fused_optimizer = true (torch::optim's own step keeps float32 moments)");
  TORCH_CHECK(num_layers_at_start_in_bf16_ >= 0, "num_layers_at_start_in_bf16 must be >= 0, got ",
              num_layers_at_start_in_bf16_);
  TORCH_CHECK(num_layers_at_end_in_bf16_ >= 0, "num_layers_at_end_in_bf16 must be >= 0, got ",
              num_layers_at_end_in_bf16_);
  LossScalerOptions()
      .loss_scale(fp16_loss_scale_)
      .initial_scale(fp16_initial_loss_scale_)
      .min_scale(fp16_min_loss_scale_)
      .growth_interval(fp16_loss_scale_window_)
      .hysteresis(fp16_hysteresis_)
      .validate();
}

}  // namespace amp8
