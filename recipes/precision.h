#pragma once

#include "plugin/mixed_precision_plugin.h"

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

}  // namespace amp8::recipes
