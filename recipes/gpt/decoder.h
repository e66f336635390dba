#pragma once
// The model a pretraining run trains, chosen by its config name: a GPT (GptConfig::named) or a
// Llama 3 (LlamaConfig::named). Everything else of the recipe (data, precision, trainer,
// checkpoints, metrics, pictures) is the same for both.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "recipes/gpt/gpt_model.h"
#include "recipes/llama/llama_model.h"

namespace amp8::recipes {

using DecoderConfig = std::variant<GptConfig, LlamaConfig>;

/// GptConfig::named or LlamaConfig::named; throws naming every accepted name.
DecoderConfig decoder_config(const std::string& name);
/// The GPT names, then the Llama ones.
std::vector<std::string> decoder_config_names();
int64_t max_seq_len(const DecoderConfig& config);
int64_t vocab_size(const DecoderConfig& config);
void set_vocab_size(DecoderConfig& config, int64_t vocab_size);
const RecomputeOptions& recompute(const DecoderConfig& config);
/// Throws naming the field and what was expected.
void validate(const DecoderConfig& config);

/// A built decoder: tokens [batch, seq] (int64) → logits [batch, seq, vocab_size]. Copies
/// share the model (as torch::nn module holders do).
class Decoder {
 public:
  explicit Decoder(const DecoderConfig& config);
  torch::nn::Module& module() const;
  torch::Tensor forward(const torch::Tensor& tokens) const;
  int64_t parameter_count() const;
  /// Model FLOPs per token of training at sequence length `seq` (6 N + 12 layers hidden seq).
  double flops_per_token(int64_t seq) const;

 private:
  std::variant<GptModel, LlamaModel> model_;
};

}  // namespace amp8::recipes
