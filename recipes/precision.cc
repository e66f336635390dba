#include "recipes/precision.h"

namespace amp8::recipes {
namespace {

MixedPrecisionOptions with_fp8(MixedPrecisionOptions options) {
  return options.fp8("hybrid")
      .fp8_margin(0)
      .fp8_amax_history_len(1024)
      .fp8_amax_compute_algo("max")
      .fp8_params(true);
}

// Megatron-Bridge's current-scaling presets: FP8 "hybrid" with per-tensor current scaling,
// the first and the last transformer layer in bf16, FP8 parameters (fp8_param_gather).
MixedPrecisionOptions with_fp8_current_scaling(MixedPrecisionOptions options) {
  return options.fp8("hybrid")
      .fp8_recipe("tensorwise")
      .num_layers_at_start_in_bf16(1)
      .num_layers_at_end_in_bf16(1)
      .fp8_params(true);
}

// Megatron-Bridge's subchannel presets: FP8 "hybrid" with blockwise scaling (1×128 tiles for
// activations and gradients, 128×128 blocks for weights), no FP8 parameters
// (fp8_param_gather = False), every layer in FP8.
MixedPrecisionOptions with_fp8_subchannel_scaling(MixedPrecisionOptions options) {
  return options.fp8("hybrid").fp8_recipe("blockwise").fp8_params(false);
}

}  // namespace

MixedPrecisionOptions bf16_mixed() {
  return MixedPrecisionOptions("bf16-mixed")
      .params_dtype(at::kBFloat16)
      .autocast_enabled(false)
      .grad_reduce_in_fp32(true);
}

MixedPrecisionOptions fp16_mixed() {
  return MixedPrecisionOptions("16-mixed")
      .params_dtype(at::kHalf)
      .autocast_enabled(false)
      .grad_reduce_in_fp32(false)
      .fp16_initial_loss_scale(4294967296.0)
      .fp16_loss_scale_window(1000)
      .fp16_hysteresis(2)
      .fp16_min_loss_scale(1.0);
}

MixedPrecisionOptions bf16_with_fp8_mixed() { return with_fp8(bf16_mixed()); }

MixedPrecisionOptions fp16_with_fp8_mixed() { return with_fp8(fp16_mixed()); }

MixedPrecisionOptions bf16_with_fp8_current_scaling_mixed() {
  return with_fp8_current_scaling(bf16_mixed());
}

MixedPrecisionOptions fp16_with_fp8_current_scaling_mixed() {
  return with_fp8_current_scaling(fp16_mixed());
}

MixedPrecisionOptions bf16_with_fp8_subchannel_scaling_mixed() {
  return with_fp8_subchannel_scaling(bf16_mixed());
}

MixedPrecisionOptions fp16_with_fp8_subchannel_scaling_mixed() {
  return with_fp8_subchannel_scaling(fp16_mixed());
}

}  // namespace amp8::recipes
