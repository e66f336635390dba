#pragma once
// A Llama 3 decoder (Meta's llama-models reference, NeMo's llama3 recipes): pre-RMSNorm blocks,
// rotary position embeddings with Llama 3's theta and frequency scaling, grouped-query attention
// through at::scaled_dot_product_attention, a SwiGLU MLP and a tied or untied output head.
// Every linear layer is an amp8::Fp8Linear, so the model runs in any precision amp8 has.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plugin/modules/fp8_layer_norm.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/modules/recompute.h"

namespace amp8::recipes {

/// Llama 3.1 / 3.2's rotary-frequency scaling (llama-models' apply_scaling): wavelengths
/// shorter than original_max_position_embeddings / high_freq_factor keep their frequency,
/// those longer than original_max_position_embeddings / low_freq_factor are divided by
/// `factor`, and the band between is interpolated smoothly.
struct RopeScaling {
  /// Default: 8 (Llama 3.1; Llama 3.2 uses 32).
  TORCH_ARG(double, factor) = 8.0;
  /// Default: 1.
  TORCH_ARG(double, low_freq_factor) = 1.0;
  /// Default: 4.
  TORCH_ARG(double, high_freq_factor) = 4.0;
  /// Default: 8192.
  TORCH_ARG(int64_t, original_max_position_embeddings) = 8192;
};

/// Shape of a Llama 3 decoder. Named configs: LlamaConfig::named("llama_tiny" | "llama32_1b" |
/// "llama32_3b" | "llama3_8b"), the published shapes (the vocabulary is the caller's: 256 bytes
/// unless set).
struct LlamaConfig {
  /// Default: 256 (bytes).
  TORCH_ARG(int64_t, vocab_size) = 256;
  /// Longest sequence the rotary tables are built for. Default: 256.
  TORCH_ARG(int64_t, max_seq_len) = 256;
  /// Default: 64.
  TORCH_ARG(int64_t, hidden) = 64;
  /// Default: 2.
  TORCH_ARG(int64_t, layers) = 2;
  /// Query heads. Default: 4.
  TORCH_ARG(int64_t, heads) = 4;
  /// Key / value heads (grouped-query attention; heads must be a multiple of it). Default: 2.
  TORCH_ARG(int64_t, kv_heads) = 2;
  /// Width of the SwiGLU MLP. Default: 192.
  TORCH_ARG(int64_t, ffn_hidden) = 192;
  /// Rotary base. Default: 500000 (Llama 3).
  TORCH_ARG(double, rope_theta) = 500000.0;
  /// Default: none (Llama 3 8B); Llama 3.1 / 3.2 scale.
  TORCH_ARG(std::optional<RopeScaling>, rope_scaling) = std::nullopt;
  /// RMSNorm eps. Default: 1e-5.
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// The output head is the token embedding (Llama 3.2 1B / 3B) instead of a linear layer of its
  /// own. Default: false.
  TORCH_ARG(bool, tie_embeddings) = false;
  /// Which blocks recompute their activations in the backward pass instead of keeping them
  /// (Megatron-Core's full recompute: recompute_method, recompute_num_layers). Default: none.
  TORCH_ARG(RecomputeOptions, recompute) = {};

 public:
  /// llama_tiny (CPU tests), llama32_1b (hidden 2048, 16 layers, 32 / 8 heads, FFN 8192),
  /// llama32_3b (3072, 28 layers, 24 / 8, FFN 8192), llama3_8b (4096, 32 layers, 32 / 8,
  /// FFN 14336), llama3_8b_4layer (llama3_8b's layers, 4 of them: a one-GPU benchmark proxy).
  /// Throws naming the accepted names.
  static LlamaConfig named(const std::string& name);
  static std::vector<std::string> names();
  /// Throws naming the field and what was expected.
  void validate() const;
  int64_t head_dim() const { return hidden_ / heads_; }
};

/// The rotary embedding's inverse frequencies θ^(-2i/head_dim), i < head_dim / 2, with
/// `scaling` applied; float32 [head_dim / 2], computed in float64.
torch::Tensor rope_inverse_frequencies(int64_t head_dim, double theta,
                                       const std::optional<RopeScaling>& scaling);

/// The rotations of positions 0..seq-1: cos and sin of pos · inverse_frequencies[i], float32
/// [seq, head_dim / 2] on the frequencies' device.
struct Rotary {
  torch::Tensor cos, sin;
  static Rotary at_positions(const torch::Tensor& inverse_frequencies, int64_t seq);
};

/// Rotates x [batch, seq, heads, head_dim]: each pair (x[2i], x[2i+1]) at position p, as the
/// complex number x[2i] + j·x[2i+1], times e^(j·p·inv_freq[i]) (Meta's reference layout).
/// Computed in float32, returned contiguous in x's dtype, in one kernel each way
/// (ops/rotary.h); x may be a view of the fused QKV output.
torch::Tensor apply_rotary(const torch::Tensor& x, const Rotary& rotary);

/// The pre-attention RMSNorm and grouped-query self-attention: `qkv`, one Fp8LayerNormLinear
/// with normalization RMSNorm (qkv.layer_norm, then qkv.linear: heads + 2 kv_heads outputs of
/// head_dim, no bias; in FP8 the RMSNorm writes the GEMM's FP8 input directly), rotary
/// embeddings on q and k, causal at::scaled_dot_product_attention with enable_gqa (no repeated
/// K/V heads), and the output projection `o_proj`.
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  /// x [batch, seq, hidden] (the residual stream, not yet normalized); rotary for positions
  /// 0..seq-1. With `residual` (x's shape): residual + the attention's output, added by
  /// o_proj's GEMM (Fp8Linear::forward_with_residual); a residual that is x itself gets its
  /// gradient from the RMSNorm's backward (WithResidualBranch).
  torch::Tensor forward(const torch::Tensor& x, const Rotary& rotary,
                        const torch::Tensor& residual = {});
  Fp8LayerNormLinear qkv{nullptr};
  Fp8Linear o_proj{nullptr};

 private:
  LlamaConfig config_;
};
TORCH_MODULE(LlamaAttention);

/// x + attention(rms_norm(x)), then x + mlp(rms_norm(x)); each RMSNorm is inside the module
/// whose first GEMM reads it (attention.qkv.layer_norm, mlp.ln_fc1.layer_norm), as in
/// Megatron-Core's TE layer specs. `mlp` is an Fp8LayerNormMLP with normalization RMSNorm and
/// activation SwiGLU, no biases: down(silu(gate) · up) with gate and up from one GEMM
/// (mlp.ln_fc1.linear, 2 × ffn_hidden outputs, gate first) and down = mlp.fc2; in FP8, SwiGLU
/// is computed inside the cast of fc2's input (TE's LayerNormMLP with activation "swiglu").
class LlamaBlockImpl : public torch::nn::Module {
 public:
  explicit LlamaBlockImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& x, const Rotary& rotary);
  LlamaAttention attention{nullptr};
  Fp8LayerNormMLP mlp{nullptr};
};
TORCH_MODULE(LlamaBlock);

/// Token embedding, `layers` LlamaBlocks (the ModuleList `blocks`: the layers
/// num_layers_at_start/end_in_bf16 count), a final RMSNorm (`final_norm`, an Fp8LayerNorm with
/// normalization RMSNorm) and the output head (`output`, an Fp8Linear, or the token embedding
/// when tie_embeddings).
class LlamaModelImpl : public torch::nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaConfig& config);
  /// tokens [batch, seq] (int64) → logits [batch, seq, vocab_size].
  torch::Tensor forward(const torch::Tensor& tokens);
  int64_t parameter_count() const;
  /// Model FLOPs per token of training at sequence length `seq`: 6 N + 12 layers hidden seq
  /// (as GptModel's; causal attention counted in full).
  double flops_per_token(int64_t seq) const;
  const LlamaConfig& config() const { return config_; }

  torch::nn::Embedding token_embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  Fp8LayerNorm final_norm{nullptr};
  Fp8Linear output{nullptr};  ///< null when tie_embeddings

 private:
  LlamaConfig config_;
  torch::Tensor inverse_frequencies_;  // float32, moved to the tokens' device when they move
};
TORCH_MODULE(LlamaModel);

}  // namespace amp8::recipes
