#include "recipes/gpt/gpt_model.h"

#include <ATen/Context.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <torch/cuda.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include "plugin/distributed/param_and_grad_buffer.h"

namespace amp8::recipes {

namespace {

// The kernel a backend name puts first; SDPBackend::error for "auto". Throws on any other name.
at::SDPBackend first_backend(const std::string& backend) {
  if (backend == "cudnn") return at::SDPBackend::cudnn_attention;
  if (backend == "flash") return at::SDPBackend::flash_attention;
  if (backend == "efficient") return at::SDPBackend::efficient_attention;
  TORCH_CHECK(backend == "auto",
              "attention-backend must be \"auto\", \"cudnn\", \"flash\" or \"efficient\", got \"",
              backend, "\"");
  return at::SDPBackend::error;
}

}  // namespace

void AttentionBackendGuard::check(const std::string& backend) { first_backend(backend); }

AttentionBackendGuard::AttentionBackendGuard(const std::string& backend) {
  const at::SDPBackend first = first_backend(backend);
  if (first == at::SDPBackend::error) return;  // "auto": nothing changes, nothing to restore
  if (torch::cuda::is_available()) {
    // PyTorch sets its CUDA default order on the first CUDA attention call (cuDNN first on
    // Hopper and Blackwell with a recent cuDNN). Let it, so that the order read here, and
    // restored later, is that default and not the pre-initialisation one.
    const auto probe = at::zeros({1, 1, 16, 64}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
    at::_fused_sdp_choice(probe, probe, probe);
  }
  previous_ = at::globalContext().sDPPriorityOrder();
  std::vector<int64_t> order{static_cast<int64_t>(first)};
  for (auto b : *previous_) {
    if (b != first) order.push_back(static_cast<int64_t>(b));
  }
  at::globalContext().setSDPPriorityOrder(order);
}

AttentionBackendGuard::~AttentionBackendGuard() {
  if (!previous_) return;
  std::vector<int64_t> order;
  for (auto b : *previous_) order.push_back(static_cast<int64_t>(b));
  at::globalContext().setSDPPriorityOrder(order);
}

GptConfig GptConfig::named(const std::string& name) {
  if (name == "tiny") return GptConfig().hidden(64).layers(2).heads(4).max_seq_len(256);
  if (name == "small") return GptConfig().hidden(256).layers(4).heads(8).max_seq_len(512);
  if (name == "125m") return GptConfig().hidden(768).layers(12).heads(12).max_seq_len(1024);
  // GPT-2 small's width with 18 layers: 128 M parameters with the byte vocabulary ("125m" has
  // 86 M: GPT-2's 125 M count includes a 38 M-parameter embedding of a 50 k vocabulary).
  if (name == "128m") return GptConfig().hidden(768).layers(18).heads(12).max_seq_len(1024);
  if (name == "350m") return GptConfig().hidden(1024).layers(24).heads(16).max_seq_len(1024);
  if (name == "1b") return GptConfig().hidden(2048).layers(18).heads(16).max_seq_len(2048);
  std::string accepted;
  for (const auto& n : names()) accepted += (accepted.empty() ? "\"" : ", \"") + n + "\"";
  TORCH_CHECK(false, "config must be one of ", accepted, ", got \"", name, "\"");
}

std::vector<std::string> GptConfig::names() { return {"tiny", "small", "125m", "128m", "350m", "1b"}; }

void GptConfig::validate() const {
  TORCH_CHECK(vocab_size_ >= 1, "vocab_size must be >= 1, got ", vocab_size_);
  TORCH_CHECK(max_seq_len_ >= 1, "max_seq_len must be >= 1, got ", max_seq_len_);
  TORCH_CHECK(layers_ >= 1, "layers must be >= 1, got ", layers_);
  TORCH_CHECK(heads_ >= 1 && hidden_ % heads_ == 0, "hidden (", hidden_,
              ") must be a positive multiple of heads (", heads_, ")");
  TORCH_CHECK(mlp_ratio_ >= 1, "mlp_ratio must be >= 1, got ", mlp_ratio_);
  TORCH_CHECK(dropout_ >= 0 && dropout_ < 1, "dropout must be in [0, 1), got ", dropout_);
  recompute_.validate(layers_);
}

GptBlockImpl::GptBlockImpl(const GptConfig& config) : config_(config) {
  const int64_t h = config.hidden();
  ln_qkv = register_module(
      "ln_qkv", Fp8LayerNormLinear(Fp8LayerNormLinearOptions(h, 3 * h).eps(config.eps())));
  proj = register_module("proj", Fp8Linear(Fp8LinearOptions(h, h)));
  mlp = register_module("mlp", Fp8LayerNormMLP(Fp8LayerNormMLPOptions(h, config.mlp_ratio() * h)
                                                    .eps(config.eps())
                                                    .fused(config.fused_mlp())));
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), h = config_.hidden(), heads = config_.heads();
  const double dropout = is_training() ? config_.dropout() : 0.0;
  // q, k and v as views of the projection's output; under FP8 their three gradients are
  // quantized where attention leaves them, not concatenated first. The residual branch is x,
  // whose gradient the LayerNorm's backward adds into its own (WithResidualBranch).
  const auto ln_qkv_out = ln_qkv->forward_split_with_residual_branch(x, {h, h, h});
  const auto& qkv = ln_qkv_out.outputs;
  const auto& residual = ln_qkv_out.residual;
  auto heads_first = [&](const torch::Tensor& part) {
    return part.view({b, t, heads, h / heads}).transpose(1, 2);
  };
  auto attn = at::scaled_dot_product_attention(heads_first(qkv[0]), heads_first(qkv[1]),
                                               heads_first(qkv[2]), {}, dropout,
                                               /*is_causal=*/true);
  namespace F = torch::nn::functional;
  const auto attn2d = attn.transpose(1, 2).reshape({b, t, h});
  if (dropout == 0.0) {
    // The residual connections inside the output GEMMs (Fp8Linear's and Fp8LayerNormMLP's
    // forward_with_residual): no pass of their own over the activations in FP8; the MLP's
    // residual is its input, whose gradient its LayerNorm's backward adds.
    const auto out = proj->forward_with_residual(attn2d, residual);
    return mlp->forward_with_residual(out, out);
  }
  auto out = residual + F::dropout(proj->forward(attn2d),
                            F::DropoutFuncOptions().p(dropout).training(is_training()));
  return out + F::dropout(mlp->forward(out),
                          F::DropoutFuncOptions().p(dropout).training(is_training()));
}

GptModelImpl::GptModelImpl(const GptConfig& config) : config_(config) {
  config.validate();
  token_embedding = register_module("token_embedding",
                                    torch::nn::Embedding(config.vocab_size(), config.hidden()));
  position_embedding = register_module(
      "position_embedding", torch::nn::Embedding(config.max_seq_len(), config.hidden()));
  {
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(token_embedding->weight, 0.0, 0.02);
    torch::nn::init::normal_(position_embedding->weight, 0.0, 0.02);
  }
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers(); ++i) {
    const Fp8ModelInit::Layer layer(i, config.layers());  // bf16 layers get bf16 weights
    blocks->push_back(GptBlock(config));
  }
  final_norm = register_module(
      "final_norm", Fp8LayerNorm(Fp8LayerNormOptions({config.hidden()}).eps(config.eps())));
}

torch::Tensor GptModelImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
              "GptModel: tokens must be int64 [batch, seq], got ", tokens.scalar_type(), " ",
              tokens.sizes());
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t <= config_.max_seq_len(), "GptModel: sequence length ", t,
              " exceeds max_seq_len ", config_.max_seq_len());
  auto positions = torch::arange(t, tokens.options());
  // Each module's parameters once their all-gather is in (overlap_param_gather; else a no-op).
  amp8::wait_for_params(*token_embedding);
  amp8::wait_for_params(*position_embedding);
  auto x = token_embedding->forward(tokens) + position_embedding->forward(positions);
  namespace F = torch::nn::functional;
  x = F::dropout(x, F::DropoutFuncOptions().p(is_training() ? config_.dropout() : 0.0)
                        .training(is_training()));
  x = forward_layers(
      config_.layers(), config_.recompute(),
      [blocks = blocks](int64_t i, const torch::Tensor& input) {
        const auto block = blocks->ptr(static_cast<size_t>(i));
        amp8::wait_for_params(*block);
        return block->as<GptBlockImpl>()->forward(input);
      },
      x);
  amp8::wait_for_params(*final_norm);
  // The output head is the token embedding, tied (GPT-2); computed in the activations' dtype.
  return F::linear(final_norm->forward(x), token_embedding->weight.to(x.scalar_type()));
}

int64_t GptModelImpl::parameter_count() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.numel();
  return count;
}

double GptModelImpl::flops_per_token(int64_t seq) const {
  return 6.0 * static_cast<double>(parameter_count()) +
         12.0 * static_cast<double>(config_.layers() * config_.hidden() * seq);
}

}  // namespace amp8::recipes
