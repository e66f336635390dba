// A next-token model with a torch::nn::Sequential body (Embedding, Sequential of Linear / GELU /
// Linear / LayerNorm, a Linear head), trained with amp8 through its own loop (the lines marked
// "amp8"). It learns the rule next = (3 * token + 1) mod 64 for 80 steps in the precision named
// by its argument and exits non-zero unless the loss falls below a tenth of ln(64) and the
// exported FP32 model loads into the plain one.
//   sequential_lm [32|bf16-mixed|16-mixed|bf16-mixed+fp8] [cpu|cuda]
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "precision_and_export.h"  // beside this file

constexpr int64_t kVocab = 64, kHidden = 64;

struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl()
      : embed(register_module("embed", torch::nn::Embedding(kVocab, kHidden))),
        body(register_module("body", torch::nn::Sequential(torch::nn::Linear(kHidden, 4 * kHidden), torch::nn::GELU(),
                                                             torch::nn::Linear(4 * kHidden, kHidden),
                                                             torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden}))))),
        head(register_module("head", torch::nn::Linear(kHidden, kVocab))) {}
  torch::Tensor forward(const torch::Tensor& tokens) { return head(body->forward(embed(tokens))); }
  torch::nn::Embedding embed;
  torch::nn::Sequential body;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyLm);

int main(int argc, char** argv) {
  const std::string precision = argc > 1 ? argv[1] : "bf16-mixed";
  const torch::Device device(argc > 2 ? argv[2] : "cpu");
  torch::manual_seed(0);
  TinyLm model;
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto tokens = torch::randint(kVocab, {32, 16}, torch::TensorOptions(device).dtype(torch::kLong));
  const auto targets = (tokens * 3 + 1).remainder(kVocab);

  amp8::MixedPrecisionPlugin plugin = example::preset(precision);  // amp8
  plugin.connect(*model, optimizer);                                // amp8
  double first = 0, last = 0;
  for (int step = 1; step <= 80; ++step) {
    torch::Tensor loss;
    {
      auto context = plugin.forward_context();  // amp8
      const auto logits = plugin.convert_output(model->forward(tokens));
      loss = torch::nn::functional::cross_entropy(logits.view({-1, kVocab}), targets.view({-1}));
      context.close();                          // amp8
    }
    plugin.backward(loss);             // amp8: was loss.backward()
    plugin.optimizer_step(optimizer);  // amp8: was optimizer.step(); optimizer.zero_grad()
    (step == 1 ? first : last) = loss.item<double>();
  }
  std::printf("sequential_lm %s: loss %.6f -> %.6f (%s)\n", precision.c_str(), first, last, plugin.name().c_str());
  const bool exported =
      example::exported_weights_load_into_the_plain_model(model, plugin, "sequential_lm_" + precision + ".pt");
  return std::isfinite(last) && last < std::log(static_cast<double>(kVocab)) / 10 && exported ? 0 : 1;
}
