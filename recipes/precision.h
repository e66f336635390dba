#pragma once

#include "plugin/precision/mixed_precision_plugin.h"

/// NeMo 2.0's precision presets (nemo/collections/llm/recipes/precision/mixed_precision.py),
/// as MixedPrecisionOptions with NeMo's values. Override any field by chaining, then build the
/// plugin (MixedPrecisionPlugin converts implicitly from its options):
///
///   amp8::MixedPrecisionPlugin plugin = amp8::recipes::bf16_with_fp8_mixed().fp8_params(false);
///   trainer.plugins = amp8::recipes::fp16_mixed();
namespace amp8::recipes {

/// precision "bf16-mixed", params_dtype bfloat16, autocast off, grad_reduce_in_fp32 true.
MixedPrecisionOptions bf16_mixed();
/// precision "16-mixed", params_dtype float16, autocast off, grad_reduce_in_fp32 false; dynamic
/// loss scaling from 2^32, window 1000, hysteresis 2, minimum 1.
MixedPrecisionOptions fp16_mixed();
/// bf16_mixed() with fp8 "hybrid", fp8_margin 0, fp8_amax_history_len 1024,
/// fp8_amax_compute_algo "max", fp8_params true.
MixedPrecisionOptions bf16_with_fp8_mixed();
/// fp16_mixed() with the same FP8 settings as bf16_with_fp8_mixed().
MixedPrecisionOptions fp16_with_fp8_mixed();

/// Megatron-Bridge's per-tensor current-scaling presets (megatron/bridge/training/
/// mixed_precision.py, `bf16_with_fp8_current_scaling_mixed`; NeMo 2.0's
/// nemo/collections/llm/recipes/precision/mixed_precision.py has the same): bf16_mixed() with
/// fp8 "hybrid", fp8_recipe "tensorwise", the first and the last transformer layer in bf16
/// (num_layers_at_start_in_bf16 1, num_layers_at_end_in_bf16 1) and FP8 parameters
/// (fp8_param_gather there, fp8_params here).
MixedPrecisionOptions bf16_with_fp8_current_scaling_mixed();
/// fp16_mixed() with the same FP8 settings as bf16_with_fp8_current_scaling_mixed().
MixedPrecisionOptions fp16_with_fp8_current_scaling_mixed();

/// Megatron-Bridge's subchannel presets (the same file, `bf16_with_fp8_subchannel_scaling_mixed`;
/// NeMo 2.0's alike): bf16_mixed() with fp8 "hybrid", fp8_recipe "blockwise" (1×128 tiles for
/// activations and gradients, 128×128 blocks for weights, power-of-two scales: TE's
/// Float8BlockScaling, DeepSeek-V3's recipe), no FP8 parameters (fp8_param_gather False there,
/// fp8_params false here), every transformer layer in FP8.
MixedPrecisionOptions bf16_with_fp8_subchannel_scaling_mixed();
/// fp16_mixed() with the same FP8 settings as bf16_with_fp8_subchannel_scaling_mixed().
MixedPrecisionOptions fp16_with_fp8_subchannel_scaling_mixed();

}  // namespace amp8::recipes
