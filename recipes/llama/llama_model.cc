#include "recipes/llama/llama_model.h"

#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <cmath>
#include <numbers>

#include "ops/rotary.h"
#include "plugin/distributed/param_and_grad_buffer.h"

namespace amp8::recipes {

LlamaConfig LlamaConfig::named(const std::string& name) {
  // Llama 3.2 (1B, 3B): rotary scaling factor 32, tied head; Llama 3 8B: no scaling, own head.
  const auto llama32 = RopeScaling().factor(32.0);
  if (name == "llama_tiny") return LlamaConfig();
  if (name == "llama32_1b") {
    return LlamaConfig().hidden(2048).layers(16).heads(32).kv_heads(8).ffn_hidden(8192)
        .max_seq_len(8192).rope_scaling(llama32).tie_embeddings(true);
  }
  if (name == "llama32_3b") {
    return LlamaConfig().hidden(3072).layers(28).heads(24).kv_heads(8).ffn_hidden(8192)
        .max_seq_len(8192).rope_scaling(llama32).tie_embeddings(true);
  }
  if (name == "llama3_8b") {
    return LlamaConfig().hidden(4096).layers(32).heads(32).kv_heads(8).ffn_hidden(14336)
        .max_seq_len(8192);
  }
  // Llama 3 8B's layer shape at a depth that fits one GPU with room to spare (a benchmark proxy).
  if (name == "llama3_8b_4layer") return named("llama3_8b").layers(4);
  std::string accepted;
  for (const auto& n : names()) accepted += (accepted.empty() ? "\"" : ", \"") + n + "\"";
  TORCH_CHECK(false, "llama config must be one of ", accepted, ", got \"", name, "\"");
}

std::vector<std::string> LlamaConfig::names() { return {"llama_tiny", "llama32_1b", "llama32_3b", "llama3_8b", "llama3_8b_4layer"}; }

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab_size_ >= 1, "vocab_size must be >= 1, got ", vocab_size_);
  TORCH_CHECK(max_seq_len_ >= 1, "max_seq_len must be >= 1, got ", max_seq_len_);
  TORCH_CHECK(layers_ >= 1, "layers must be >= 1, got ", layers_);
  TORCH_CHECK(ffn_hidden_ >= 1, "ffn_hidden must be >= 1, got ", ffn_hidden_);
  TORCH_CHECK(heads_ >= 1 && hidden_ >= 1 && hidden_ % heads_ == 0, "hidden (", hidden_,
              ") must be a positive multiple of heads (", heads_, ")");
  TORCH_CHECK(head_dim() % 2 == 0, "the head size hidden / heads must be even for rotary "
              "embeddings, got ", head_dim());
  TORCH_CHECK(kv_heads_ >= 1 && heads_ % kv_heads_ == 0, "heads (", heads_,
              ") must be a multiple of kv_heads (", kv_heads_, ")");
  TORCH_CHECK(rope_theta_ > 1, "rope_theta must be > 1, got ", rope_theta_);
  TORCH_CHECK(norm_eps_ > 0, "norm_eps must be > 0, got ", norm_eps_);
  recompute_.validate(layers_);
  if (rope_scaling_) {
    const auto& s = *rope_scaling_;
    TORCH_CHECK(s.factor() >= 1, "rope_scaling.factor must be >= 1, got ", s.factor());
    TORCH_CHECK(s.low_freq_factor() > 0 && s.high_freq_factor() > s.low_freq_factor(),
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got ",
                s.low_freq_factor(), " and ", s.high_freq_factor());
    TORCH_CHECK(s.original_max_position_embeddings() >= 1,
                "rope_scaling.original_max_position_embeddings must be >= 1, got ",
                s.original_max_position_embeddings());
  }
}

torch::Tensor rope_inverse_frequencies(int64_t head_dim, double theta,
                                       const std::optional<RopeScaling>& scaling) {
  TORCH_CHECK(head_dim >= 2 && head_dim % 2 == 0, "head_dim must be even and >= 2, got ", head_dim);
  auto frequencies = torch::empty({head_dim / 2}, torch::kFloat64);
  auto* f = frequencies.data_ptr<double>();
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    double freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (scaling) {
      const double context = static_cast<double>(scaling->original_max_position_embeddings());
      const double low_freq_wavelength = context / scaling->low_freq_factor();
      const double high_freq_wavelength = context / scaling->high_freq_factor();
      const double wavelength = 2 * std::numbers::pi / freq;
      if (wavelength > low_freq_wavelength) {
        freq /= scaling->factor();
      } else if (wavelength >= high_freq_wavelength) {
        const double smooth = (context / wavelength - scaling->low_freq_factor()) /
                              (scaling->high_freq_factor() - scaling->low_freq_factor());
        freq = (1 - smooth) * freq / scaling->factor() + smooth * freq;
      }
    }
    f[i] = freq;
  }
  return frequencies.to(torch::kFloat32);
}

Rotary Rotary::at_positions(const torch::Tensor& inverse_frequencies, int64_t seq) {
  const auto positions = torch::arange(seq, inverse_frequencies.options());
  const auto angles = torch::outer(positions, inverse_frequencies);
  return {angles.cos(), angles.sin()};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x ↦ rotary_embedding(x): a rotation's gradient is the inverse rotation of the output's.
struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotary_embedding(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {{}, {}, {}};
    const auto saved = ctx->get_saved_variables();
    const auto grad = grads[0].stride(3) == 1 ? grads[0] : grads[0].contiguous();
    return {rotary_embedding(grad, saved[0], saved[1], /*inverse=*/true), {}, {}};
  }
};

}  // namespace

torch::Tensor apply_rotary(const torch::Tensor& x, const Rotary& rotary) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.size(1) == rotary.cos.size(0) &&
                  x.size(3) / 2 == rotary.cos.size(1),
              "apply_rotary: x must be [batch, seq, heads, head_dim] with seq ", rotary.cos.size(0),
              " and head_dim ", 2 * rotary.cos.size(1), ", got ", x.sizes());
  return RotaryFunction::apply(x, rotary.cos, rotary.sin);
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config) : config_(config) {
  const int64_t d = config.head_dim();
  qkv = register_module(
      "qkv", Fp8LayerNormLinear(Fp8LayerNormLinearOptions(
                                    config.hidden(), (config.heads() + 2 * config.kv_heads()) * d)
                                    .normalization(Normalization::kRMSNorm)
                                    .eps(config.norm_eps())
                                    .bias(false)));
  o_proj = register_module("o_proj", Fp8Linear(Fp8LinearOptions(config.hidden(), config.hidden()).bias(false)));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const Rotary& rotary,
                                         const torch::Tensor& residual) {
  const int64_t b = x.size(0), t = x.size(1), d = config_.head_dim();
  const int64_t heads = config_.heads(), kv_heads = config_.kv_heads();
  // Under FP8 the three gradients are quantized where they arrive, not concatenated first.
  // A residual that is x itself becomes the RMSNorm's residual branch (WithResidualBranch).
  const std::vector<int64_t> split_sizes{heads * d, kv_heads * d, kv_heads * d};
  const auto normalized = residual.is_same(x)
                              ? qkv->forward_split_with_residual_branch(x, split_sizes)
                              : WithResidualBranch{qkv->forward_split(x, split_sizes), residual};
  const auto& parts = normalized.outputs;
  const auto q = apply_rotary(parts[0].view({b, t, heads, d}), rotary);
  const auto k = apply_rotary(parts[1].view({b, t, kv_heads, d}), rotary);
  const auto v = parts[2].view({b, t, kv_heads, d});
  const auto attention = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), {}, 0.0, /*is_causal=*/true,
      std::nullopt, /*enable_gqa=*/kv_heads != heads);
  const auto heads_last = attention.transpose(1, 2).reshape({b, t, heads * d});
  return residual.defined() ? o_proj->forward_with_residual(heads_last, normalized.residual)
                            : o_proj->forward(heads_last);
}

LlamaBlockImpl::LlamaBlockImpl(const LlamaConfig& config) {
  attention = register_module("attention", LlamaAttention(config));
  mlp = register_module(
      "mlp", Fp8LayerNormMLP(Fp8LayerNormMLPOptions(config.hidden(), config.ffn_hidden())
                                 .normalization(Normalization::kRMSNorm)
                                 .activation(MlpActivation::kSwiGlu)
                                 .eps(config.norm_eps())
                                 .bias(false)));
}

torch::Tensor LlamaBlockImpl::forward(const torch::Tensor& x, const Rotary& rotary) {
  // The residual connections inside the output GEMMs (o_proj's, the MLP's down projection).
  const auto h = attention->forward(x, rotary, /*residual=*/x);
  return mlp->forward_with_residual(h, h);
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& config) : config_(config) {
  config.validate();
  token_embedding = register_module("token_embedding",
                                    torch::nn::Embedding(config.vocab_size(), config.hidden()));
  {
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(token_embedding->weight, 0.0, 0.02);
  }
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers(); ++i) {
    const Fp8ModelInit::Layer layer(i, config.layers());  // bf16 layers get bf16 weights
    blocks->push_back(LlamaBlock(config));
  }
  final_norm = register_module(
      "final_norm", Fp8LayerNorm(Fp8LayerNormOptions({config.hidden()})
                                     .normalization(Normalization::kRMSNorm)
                                     .eps(config.norm_eps())));
  if (!config.tie_embeddings()) {
    output = register_module("output", Fp8Linear(Fp8LinearOptions(config.hidden(), config.vocab_size()).bias(false)));
  }
  inverse_frequencies_ = rope_inverse_frequencies(config.head_dim(), config.rope_theta(), config.rope_scaling());
}

torch::Tensor LlamaModelImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
              "LlamaModel: tokens must be int64 [batch, seq], got ", tokens.scalar_type(), " ",
              tokens.sizes());
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t <= config_.max_seq_len(), "LlamaModel: sequence length ", t,
              " exceeds max_seq_len ", config_.max_seq_len());
  if (inverse_frequencies_.device() != tokens.device()) {
    inverse_frequencies_ = inverse_frequencies_.to(tokens.device());
  }
  const auto rotary = Rotary::at_positions(inverse_frequencies_, t);
  // Each module's parameters once their all-gather is in (overlap_param_gather; else a no-op).
  amp8::wait_for_params(*token_embedding);
  auto x = token_embedding->forward(tokens);
  x = forward_layers(
      config_.layers(), config_.recompute(),
      [blocks = blocks, rotary](int64_t i, const torch::Tensor& input) {
        const auto block = blocks->ptr(static_cast<size_t>(i));
        amp8::wait_for_params(*block);
        return block->as<LlamaBlockImpl>()->forward(input, rotary);
      },
      x);
  amp8::wait_for_params(*final_norm);
  x = final_norm->forward(x);
  if (output) {
    amp8::wait_for_params(*output);
    return output->forward(x);
  }
  // Tied head: the token embedding, in the activations' dtype.
  return torch::nn::functional::linear(x, token_embedding->weight.to(x.scalar_type()));
}

int64_t LlamaModelImpl::parameter_count() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.numel();
  return count;
}

double LlamaModelImpl::flops_per_token(int64_t seq) const {
  return 6.0 * static_cast<double>(parameter_count()) +
         12.0 * static_cast<double>(config_.layers() * config_.hidden() * seq);
}

}  // namespace amp8::recipes
