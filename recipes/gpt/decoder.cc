#include "recipes/gpt/decoder.h"

#include <algorithm>

namespace amp8::recipes {

DecoderConfig decoder_config(const std::string& name) {
  const auto gpt = GptConfig::names(), llama = LlamaConfig::names();
  if (std::find(gpt.begin(), gpt.end(), name) != gpt.end()) return GptConfig::named(name);
  if (std::find(llama.begin(), llama.end(), name) != llama.end()) return LlamaConfig::named(name);
  std::string accepted;
  for (const auto& n : decoder_config_names()) accepted += (accepted.empty() ? "\"" : ", \"") + n + "\"";
  TORCH_CHECK(false, "config must be one of ", accepted, ", got \"", name, "\"");
}

std::vector<std::string> decoder_config_names() {
  auto names = GptConfig::names();
  for (const auto& name : LlamaConfig::names()) names.push_back(name);
  return names;
}

int64_t max_seq_len(const DecoderConfig& config) {
  return std::visit([](const auto& c) { return c.max_seq_len(); }, config);
}

int64_t vocab_size(const DecoderConfig& config) {
  return std::visit([](const auto& c) { return c.vocab_size(); }, config);
}

void set_vocab_size(DecoderConfig& config, int64_t vocab_size) {
  std::visit([&](auto& c) { c.vocab_size(vocab_size); }, config);
}

const RecomputeOptions& recompute(const DecoderConfig& config) {
  return std::visit([](const auto& c) -> const RecomputeOptions& { return c.recompute(); }, config);
}

void validate(const DecoderConfig& config) {
  std::visit([](const auto& c) { c.validate(); }, config);
}

namespace {
std::variant<GptModel, LlamaModel> build(const DecoderConfig& config) {
  if (const auto* gpt = std::get_if<GptConfig>(&config)) return GptModel(*gpt);
  return LlamaModel(std::get<LlamaConfig>(config));
}
}  // namespace

Decoder::Decoder(const DecoderConfig& config) : model_(build(config)) {}

torch::nn::Module& Decoder::module() const {
  return std::visit([](const auto& m) -> torch::nn::Module& { return *m.ptr(); }, model_);
}

torch::Tensor Decoder::forward(const torch::Tensor& tokens) const {
  return std::visit([&](const auto& m) { return m.ptr()->forward(tokens); }, model_);
}

int64_t Decoder::parameter_count() const {
  return std::visit([](const auto& m) { return m->parameter_count(); }, model_);
}

double Decoder::flops_per_token(int64_t seq) const {
  return std::visit([&](const auto& m) { return m->flops_per_token(seq); }, model_);
}

}  // namespace amp8::recipes
