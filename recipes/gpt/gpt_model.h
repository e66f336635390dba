#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <ATen/SDPBackend.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plugin/modules/fp8_layer_norm.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/modules/recompute.h"

namespace amp8::recipes {

/// Shape of a decoder-only GPT. Named configs: GptConfig::named("tiny" | "small" | "125m" |
/// "350m" | "1b").
struct GptConfig {
  /// Tokens: bytes. Default: 256.
  TORCH_ARG(int64_t, vocab_size) = 256;
  /// Longest sequence (position embeddings). Default: 256.
  TORCH_ARG(int64_t, max_seq_len) = 256;
  /// Default: 64.
  TORCH_ARG(int64_t, hidden) = 64;
  /// Default: 2.
  TORCH_ARG(int64_t, layers) = 2;
  /// Default: 4.
  TORCH_ARG(int64_t, heads) = 4;
  /// MLP width = mlp_ratio × hidden. Default: 4.
  TORCH_ARG(int64_t, mlp_ratio) = 4;
  /// Default: 0.
  TORCH_ARG(double, dropout) = 0.0;
  /// LayerNorm eps. Default: 1e-5.
  TORCH_ARG(double, eps) = 1e-5;
  /// Each block's Fp8LayerNormMLP runs fused (Fp8LayerNormMLPOptions::fused: in an FP8 region
  /// GELU is computed inside FC2's input cast and its derivative inside FC1's gradient cast);
  /// false runs its modules one after the other (Fp8LayerNormLinear, GELU, Fp8Linear). The
  /// parameters and their names are the same either way. Default: true.
  TORCH_ARG(bool, fused_mlp) = true;
  /// Which blocks recompute their activations in the backward pass instead of keeping them
  /// (Megatron-Core's full recompute: recompute_method, recompute_num_layers). Default: none.
  TORCH_ARG(RecomputeOptions, recompute) = {};

 public:
  /// tiny (~0.1 M parameters, CPU), small (~3 M), 125m (GPT-2 small shape, seq 1024),
  /// 350m (GPT-2 medium shape), 1b (hidden 2048, 18 layers). Throws naming the accepted names.
  static GptConfig named(const std::string& name);
  static std::vector<std::string> names();
  void validate() const;
};

/// The order in which at::scaled_dot_product_attention tries its fused kernels (a process-wide
/// setting of LibTorch), for the life of the guard: "auto" changes nothing (PyTorch's own
/// order: on Hopper and Blackwell with cuDNN > 9.15, cuDNN first, then flash, memory-efficient,
/// math); "cudnn", "flash" or "efficient" puts that kernel first, and inputs it cannot take go to
/// the next one in PyTorch's order. The previous order comes back when the guard ends.
class AttentionBackendGuard {
 public:
  explicit AttentionBackendGuard(const std::string& backend);
  ~AttentionBackendGuard();
  AttentionBackendGuard(const AttentionBackendGuard&) = delete;
  AttentionBackendGuard& operator=(const AttentionBackendGuard&) = delete;
  /// Throws, naming the accepted values, unless `backend` is one of them (to check a setting
  /// before anything runs).
  static void check(const std::string& backend);

 private:
  std::optional<std::array<at::SDPBackend, at::num_sdp_backends>> previous_;  // what to restore
};

/// Pre-LayerNorm transformer block: x + proj(attn(ln1·qkv(x))), then x + fc2(gelu(ln2·fc1(x))).
/// LayerNorm+QKV is an Fp8LayerNormLinear (the LayerNorm output goes straight to FP8 in an FP8
/// region); the output projection is an Fp8Linear; the MLP is an Fp8LayerNormMLP (submodules
/// mlp.ln_fc1, mlp.fc2; see GptConfig::fused_mlp); causal attention is
/// at::scaled_dot_product_attention.
class GptBlockImpl : public torch::nn::Module {
 public:
  explicit GptBlockImpl(const GptConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

  Fp8LayerNormLinear ln_qkv{nullptr};
  Fp8Linear proj{nullptr};
  Fp8LayerNormMLP mlp{nullptr};

 private:
  GptConfig config_;
};
TORCH_MODULE(GptBlock);

/// Decoder-only GPT: token + position embeddings, `layers` blocks, a final Fp8LayerNorm, and an
/// output head tied to the token embedding. Built under Fp8ModelInit, its linear weights are
/// kept in FP8 (fp8_params). The FP8 knobs (fp8_min_gemm_size, the layers kept in bf16, the
/// amax history) are the precision's: MixedPrecisionPlugin (or convert_to_fp8) sets them on
/// every FP8 module of the model; the modules are built with their defaults.
class GptModelImpl : public torch::nn::Module {
 public:
  explicit GptModelImpl(const GptConfig& config);
  /// tokens [batch, seq] (int64) → logits [batch, seq, vocab_size].
  torch::Tensor forward(const torch::Tensor& tokens);
  int64_t parameter_count() const;
  /// Model FLOPs per token of training at sequence length `seq`: 6 N + 12 layers hidden seq
  /// (the usual count: matmuls forward and backward, causal attention counted in full).
  double flops_per_token(int64_t seq) const;
  const GptConfig& config() const { return config_; }

  torch::nn::Embedding token_embedding{nullptr};
  torch::nn::Embedding position_embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  Fp8LayerNorm final_norm{nullptr};

 private:
  GptConfig config_;
};
TORCH_MODULE(GptModel);

}  // namespace amp8::recipes
