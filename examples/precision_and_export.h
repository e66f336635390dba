#pragma once
// What the example trainers (typed_mlp, sequential_lm) share: the precision named on the command line, and the check that
// the exported FP32 model loads into the plain model.
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "amp8/amp8.h"  // the installed package's <amp8/amp8.h>; this repository's root here

namespace example {

// NeMo's preset for a precision name: "32", "bf16-mixed" or "16-mixed" (CPU and GPU), or
// "bf16-mixed+fp8" (NeMo's bf16_with_fp8_mixed, an NVIDIA Hopper GPU; gpt_pretrain --compare's spelling).
inline amp8::MixedPrecisionOptions preset(const std::string& name) {
  if (name == "bf16-mixed") return amp8::recipes::bf16_mixed();
  if (name == "16-mixed") return amp8::recipes::fp16_mixed();
  if (name == "bf16-mixed+fp8") return amp8::recipes::bf16_with_fp8_mixed();
  return amp8::MixedPrecisionOptions(name);  // "32"; anything else is refused, naming the knob
}

// Writes `trained`'s FP32 weights with amp8::export_fp32_model, loads them into `plain` (a
// fresh model of the same class, never touched by amp8) and checks every parameter equals the
// plugin's FP32 value. Returns false, saying which, when one differs.
template <typename Model>
bool exported_weights_load_into_the_plain_model(Model& trained, const amp8::PrecisionPlugin& plugin,
                                                const std::string& path) {
  amp8::export_fp32_model(*trained, plugin, path);
  Model plain;
  torch::load(plain, path);
  const auto plain_params = plain->named_parameters();
  for (const auto& item : trained->named_parameters()) {
    const torch::Tensor expected = plugin.fp32_value(item.value()).to(torch::kCPU);
    if (!plain_params[item.key()].equal(expected)) {
      std::printf("the exported %s does not equal the trained FP32 value\n", item.key().c_str());
      return false;
    }
  }
  return true;
}

}  // namespace example
