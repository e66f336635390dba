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
  TORCH_CHECK(fp8_params_scaling_ == "current" || fp8_params_scaling_ == "delayed",
              "fp8_params_scaling must be \"current\" or \"delayed\", got \"", fp8_params_scaling_, "\"");
  TORCH_CHECK(fp8_params_scaling_ == "current" || (fp8_params_ && fp8_recipe_ != "blockwise"),
              "fp8_params_scaling \"delayed\" applies to fp8_params with one scale per weight (fp8_params = ",
              fp8_params_ ? "true" : "false", ", fp8_recipe \"", fp8_recipe_, "\"): it would be ignored");
  TORCH_CHECK(fp8_params_ == false || fp8_enabled(),
              "fp8_params = true needs fp8 = \"hybrid\" or \"e4m3\", got fp8 = \"none\"");
  // Settings of a part this precision does not run would be dropped: errors instead.
  const MixedPrecisionOptions defaults;
  std::string unused;
  const auto note = [&](bool changed, const char* knob) {
    if (changed) unused += (unused.empty() ? "" : ", ") + std::string(knob);
  };
  if (!fp8_enabled()) {
    note(fp8_recipe_ != defaults.fp8_recipe_, "fp8_recipe");
    note(fp8_margin_ != defaults.fp8_margin_, "fp8_margin");
    note(fp8_amax_history_len_ != defaults.fp8_amax_history_len_, "fp8_amax_history_len");
    note(fp8_amax_compute_algo_ != defaults.fp8_amax_compute_algo_, "fp8_amax_compute_algo");
    note(fp8_min_gemm_size_ != defaults.fp8_min_gemm_size_, "fp8_min_gemm_size");
    note(num_layers_at_start_in_bf16_ != defaults.num_layers_at_start_in_bf16_, "num_layers_at_start_in_bf16");
    note(num_layers_at_end_in_bf16_ != defaults.num_layers_at_end_in_bf16_, "num_layers_at_end_in_bf16");
    note(fp8_fuse_modules_ != defaults.fp8_fuse_modules_, "fp8_fuse_modules");
    TORCH_CHECK(unused.empty(), "the FP8 settings ", unused, " need fp8 = \"hybrid\" or \"e4m3\", got fp8 = "
                "\"none\": they would be ignored");
  }
  if (precision != "16-mixed") {
    note(fp16_loss_scale_.has_value(), "fp16_loss_scale");
    note(fp16_initial_loss_scale_ != defaults.fp16_initial_loss_scale_, "fp16_initial_loss_scale");
    note(fp16_min_loss_scale_ != defaults.fp16_min_loss_scale_, "fp16_min_loss_scale");
    note(fp16_loss_scale_window_ != defaults.fp16_loss_scale_window_, "fp16_loss_scale_window");
    note(fp16_hysteresis_ != defaults.fp16_hysteresis_, "fp16_hysteresis");
    TORCH_CHECK(unused.empty(), "the loss-scaling settings ", unused, " apply to precision \"16-mixed\" only "
                "(bf16 and float32 need no loss scale), got \"", precision, "\": they would be ignored");
  }
  // Dynamic settings beside a static fp16_loss_scale: refused by the scaler's own check below.
  if (params_dtype_) {
    TORCH_CHECK(*params_dtype_ == at::kFloat || *params_dtype_ == compute_dtype(), "params_dtype ",
                c10::toString(*params_dtype_), " contradicts precision \"", precision, "\": use float32 or its "
                "compute dtype ", c10::toString(compute_dtype()),
                " (float16 params without 16-mixed's loss scaling would lose small gradients)");
    // Float32 parameters compute in half precision only under autocast; without it the run
    // would be float32 throughout under a mixed precision's name (and 16-mixed would scale its
    // loss for nothing).
    TORCH_CHECK(*params_dtype_ != at::kFloat || precision == "32" || autocast_enabled_, "params_dtype Float "
                "under precision \"", precision, "\" needs autocast_enabled = true: otherwise nothing runs in ",
                c10::toString(compute_dtype()), " and the run is float32 throughout");
  }
  TORCH_CHECK(!autocast_enabled_ || precision != "32", "autocast_enabled = true needs a mixed precision "
              "(\"bf16-mixed\" or \"16-mixed\"); precision \"32\" computes in float32: it would be ignored");
  check_fp8_min_gemm_size(fp8_min_gemm_size_, "fp8_min_gemm_size");
  const AdamMomentDtypes moments{exp_avg_dtype_, exp_avg_sq_dtype_};
  moments.check("MixedPrecisionOptions");
  TORCH_CHECK(moments.is_float32() || fused_optimizer_, "MixedPrecisionOptions: exp_avg_dtype / exp_avg_sq_dtype "
              "bfloat16 needs fused_optimizer = true (torch::optim's own step keeps float32 moments)");
  TORCH_CHECK(num_layers_at_start_in_bf16_ >= 0, "num_layers_at_start_in_bf16 must be >= 0, got ",
              num_layers_at_start_in_bf16_);
  TORCH_CHECK(num_layers_at_end_in_bf16_ >= 0, "num_layers_at_end_in_bf16 must be >= 0, got ",
              num_layers_at_end_in_bf16_);
  loss_scaler_options().validate("fp16_");
}

LossScalerOptions MixedPrecisionOptions::loss_scaler_options() const {
  return LossScalerOptions()
      .loss_scale(fp16_loss_scale_)
      .initial_scale(fp16_initial_loss_scale_)
      .min_scale(fp16_min_loss_scale_)
      .growth_interval(fp16_loss_scale_window_)
      .hysteresis(fp16_hysteresis_);
}

}  // namespace amp8
