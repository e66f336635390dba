#pragma once
// Small models and deterministic data for the precision-plugin and trainer suites. The layers a
// precision plugin may swap sit in torch::nn::Sequential / ModuleList containers, which call
// their children through the registry (see MixedPrecisionPlugin).

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdint>
#include <utility>

namespace amp8::testing {

// A batch drawn from (seed, step, micro_batch) alone, so a resumed run sees the same data.
inline at::Generator batch_generator(uint64_t seed, int64_t step, int64_t micro_batch) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + static_cast<uint64_t>(step) * 131ULL +
                                                  static_cast<uint64_t>(micro_batch));
}

// 3-layer MLP: 32 → 64 → 64 → 16 (every linear layer FP8-eligible).
inline torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 16));
}

// Regression data for the MLP: y = teacher(x) + 0.3·noise, the teacher a fixed random MLP. The
// noise keeps the loss well above the rounding floor of every precision, so precisions can be
// compared by their loss.
struct MlpData {
  explicit MlpData(uint64_t seed) : seed(seed) {
    torch::manual_seed(seed + 7);
    teacher = make_mlp();
  }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int64_t micro_batch,
                                                int64_t rows = 64) const {
    auto gen = batch_generator(seed, step, micro_batch);
    auto x = torch::randn({rows, 32}, gen);
    torch::NoGradGuard no_grad;
    auto y = teacher->forward(x) + 0.3 * torch::randn({rows, 16}, gen);
    return {x, y};
  }
  uint64_t seed;
  mutable torch::nn::Sequential teacher{nullptr};
};

// Pre-LayerNorm transformer block with causal attention; every projection and LayerNorm is
// held in a Sequential so a plugin can swap it.
struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl(int64_t dim, int64_t heads, double dropout) : heads(heads), dropout(dropout) {
    ln1 = register_module("ln1", torch::nn::Sequential(torch::nn::LayerNorm(
                                     torch::nn::LayerNormOptions({dim}))));
    qkv = register_module("qkv", torch::nn::Sequential(torch::nn::Linear(dim, 3 * dim)));
    proj = register_module("proj", torch::nn::Sequential(torch::nn::Linear(dim, dim)));
    ln2 = register_module("ln2", torch::nn::Sequential(torch::nn::LayerNorm(
                                     torch::nn::LayerNormOptions({dim}))));
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(dim, 4 * dim),
                                                       torch::nn::GELU(),
                                                       torch::nn::Linear(4 * dim, dim)));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto parts = qkv->forward(ln1->forward(x)).view({b, t, 3, heads, d / heads}).unbind(2);
    auto q = parts[0].transpose(1, 2), k = parts[1].transpose(1, 2), v = parts[2].transpose(1, 2);
    auto attn = at::scaled_dot_product_attention(q, k, v, {}, is_training() ? dropout : 0.0,
                                                 /*is_causal=*/true);
    x = x + proj->forward(attn.transpose(1, 2).reshape({b, t, d}));
    auto h = mlp->forward(ln2->forward(x));
    return x + torch::dropout(h, is_training() ? dropout : 0.0, is_training());
  }
  int64_t heads;
  double dropout;
  torch::nn::Sequential ln1{nullptr}, qkv{nullptr}, proj{nullptr}, ln2{nullptr}, mlp{nullptr};
};
TORCH_MODULE(TinyBlock);

// in 16 → dim 32 → `layers` blocks → LayerNorm → out 16.
struct TinyTransformerImpl : torch::nn::Module {
  explicit TinyTransformerImpl(int64_t layers = 2, double dropout = 0.0) {
    embed = register_module("embed", torch::nn::Sequential(torch::nn::Linear(16, 32)));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(TinyBlock(32, 2, dropout));
    head = register_module("head", torch::nn::Sequential(
                                       torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
                                       torch::nn::Linear(32, 16)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed->forward(x);
    for (const auto& block : *blocks) x = block->as<TinyBlockImpl>()->forward(x);
    return head->forward(x);
  }
  torch::nn::Sequential embed{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(TinyTransformer);

// Sequence regression for the transformer: y_t = teacher(x)_t + 0.3·noise (causal teacher).
struct SequenceData {
  explicit SequenceData(uint64_t seed) : seed(seed) {
    torch::manual_seed(seed + 11);
    teacher = TinyTransformer(2);
    teacher->eval();
  }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int64_t micro_batch) const {
    auto gen = batch_generator(seed, step, micro_batch);
    auto x = torch::randn({8, 16, 16}, gen);
    torch::NoGradGuard no_grad;
    auto y = teacher->forward(x) + 0.3 * torch::randn({8, 16, 16}, gen);
    return {x, y};
  }
  uint64_t seed;
  mutable TinyTransformer teacher{nullptr};
};

}  // namespace amp8::testing
