// A trainer as most LibTorch users write one: a model with typed torch::nn::Linear members and
// its own loop, with amp8 added (the lines marked "amp8"). It learns a fixed random teacher for
// 60 steps in the precision named by its argument and exits non-zero unless the loss falls to a
// quarter and the exported FP32 model loads into the plain one.
//   typed_mlp [32|bf16-mixed|16-mixed|bf16-mixed+fp8] [cpu|cuda]
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "precision_and_export.h"  // beside this file

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(48, 96))),
        fc2(register_module("fc2", torch::nn::Linear(96, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

int main(int argc, char** argv) {
  const std::string precision = argc > 1 ? argv[1] : "bf16-mixed";
  const torch::Device device(argc > 2 ? argv[2] : "cpu");
  torch::manual_seed(0);
  Mlp model;
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  const auto x = torch::randn({256, 48}, device);
  const auto y = torch::matmul(x, torch::randn({48, 16}, device) / std::sqrt(48.0));

  amp8::MixedPrecisionPlugin plugin = example::preset(precision);  // amp8
  plugin.connect(*model, optimizer);                                // amp8
  double first = 0, last = 0;
  for (int step = 1; step <= 60; ++step) {
    torch::Tensor loss;
    {
      auto context = plugin.forward_context();                                          // amp8
      loss = torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y);
      context.close();                                                                  // amp8
    }
    plugin.backward(loss);              // amp8: was loss.backward()
    plugin.optimizer_step(optimizer);   // amp8: was optimizer.step(); optimizer.zero_grad()
    (step == 1 ? first : last) = loss.item<double>();
  }
  std::printf("typed_mlp %s: loss %.6f -> %.6f (%s)\n", precision.c_str(), first, last, plugin.name().c_str());
  const bool exported = example::exported_weights_load_into_the_plain_model(model, plugin, "typed_mlp_" + precision + ".pt");
  return std::isfinite(last) && last < first / 4 && exported ? 0 : 1;
}
