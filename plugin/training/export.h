#pragma once

// Back to plain LibTorch: a trained model's FP32 weights in a file its unmodified architecture
// loads with torch::load.

#include <torch/nn/module.h>

#include <string>

#include "plugin/precision/precision_plugin.h"

namespace amp8 {

/// Writes `model` as torch::save(model, path) would, but with every parameter in float32 at
/// the value training holds for it (plugin.fp32_value: the FP32 master under a
/// MixedPrecisionPlugin, not the bf16 / fp16 / FP8 copy the forward pass used), under the
/// model's own names. Buffers are written as they are, except those of amp8's FP8 modules
/// (scales and amax histories), which the modules they replaced never had. A plain LibTorch
/// model of the original architecture (torch::nn::Linear / LayerNorm where convert_module put
/// Fp8Linear / Fp8LayerNorm, and the Sequential runs it fused into an Fp8LayerNormLinear /
/// Fp8LayerNormMLP, written under their original names) loads the file with
/// `torch::load(model, path)`. The file is
/// written atomically (plugin/training/checkpoint.h, without amp8's checkpoint trailer).
void export_fp32_model(const torch::nn::Module& model, const PrecisionPlugin& plugin, const std::string& path);

}  // namespace amp8
