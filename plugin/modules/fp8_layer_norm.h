#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "ops/layer_norm.h"
#include "plugin/modules/fp8_linear.h"

namespace amp8 {

/// Options of Fp8LayerNorm, like torch::nn::LayerNormOptions:
///   Fp8LayerNormOptions({1024}).eps(1e-6)
///   Fp8LayerNormOptions({2048}).normalization(Normalization::kRMSNorm)   // Llama's RMSNorm
struct Fp8LayerNormOptions {
  /* implicit */ Fp8LayerNormOptions(std::vector<int64_t> normalized_shape)
      : normalized_shape_(std::move(normalized_shape)) {}
  /// The trailing dimensions normalized over (their product is the hidden size).
  TORCH_ARG(std::vector<int64_t>, normalized_shape);
  /// LayerNorm (subtract the mean, divide by the standard deviation) or RMSNorm (divide by the
  /// root mean square; no shift), as TE's `normalization`. Default: kLayerNorm.
  TORCH_ARG(Normalization, normalization) = Normalization::kLayerNorm;
  /// Added to the variance (RMSNorm: the mean square) for numerical stability. Default: 1e-5.
  TORCH_ARG(double, eps) = 1e-5;
  /// Learn a per-element scale (`weight`, ones) and, for LayerNorm, shift (`bias`, zeros).
  /// Default: true.
  TORCH_ARG(bool, elementwise_affine) = true;
  /// Learn the shift `bias` (only with elementwise_affine). Default: LayerNorm has one, RMSNorm
  /// none; true with RMSNorm is an error.
  TORCH_ARG(std::optional<bool>, bias) = std::nullopt;
};

/// A normalizing module's outputs together with its input as the residual branch of a pre-norm
/// block (`x + f(norm(x))`). `residual` has the input's values and shape (a view of the input,
/// or, where the module normalizes a non-contiguous input's contiguous copy, of that copy); its
/// gradient is added by the normalization's backward kernel into the input's, before that
/// gradient's one rounding, where autograd would otherwise sum the two in a pass of its own
/// over the activations. Use `residual` in place of the input for the residual connection, out
/// of place: as one output of several of an autograd function, it cannot be modified in place.
struct WithResidualBranch {
  std::vector<torch::Tensor> outputs;
  torch::Tensor residual;
};

/// A drop-in replacement for torch::nn::LayerNorm (same parameters `weight`/`bias`, same
/// initialisation, same biased variance) computed by amp8's LayerNorm op: statistics in
/// float32 in the forward and the backward pass, fused CUDA kernels (ops/layer_norm.h), the
/// output in the input's dtype (as Transformer Engine's LayerNorm; torch::nn::LayerNorm under
/// at::autocast returns float32). With normalization(kRMSNorm) it is an RMSNorm (at::rms_norm's
/// y = x / √(mean(x²) + eps) · weight; TE's RMSNorm), by the same kernels.
///
/// When the normalized output feeds an Fp8Linear, use Fp8LayerNormLinear: inside an FP8
/// region it writes the output directly in FP8 with its amax, so the activation is quantized
/// once and never stored in high precision.
class Fp8LayerNormImpl : public torch::nn::Cloneable<Fp8LayerNormImpl> {
 public:
  Fp8LayerNormImpl(std::vector<int64_t> normalized_shape)
      : Fp8LayerNormImpl(Fp8LayerNormOptions(std::move(normalized_shape))) {}
  explicit Fp8LayerNormImpl(const Fp8LayerNormOptions& options_);

  void reset() override;
  /// weight = 1, bias = 0.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// Input [..., *normalized_shape] → output of the same shape and dtype.
  torch::Tensor forward(const torch::Tensor& input);
  /// forward(input) as outputs[0], and the input as the block's residual branch.
  WithResidualBranch forward_with_residual_branch(const torch::Tensor& input);
  /// How many times forward() has run (see Fp8LinearImpl::forward_calls).
  int64_t forward_calls() const { return forward_calls_; }

  Fp8LayerNormOptions options;
  torch::Tensor weight;  ///< [*normalized_shape], or undefined without elementwise_affine
  torch::Tensor bias;    ///< [*normalized_shape], or undefined

 private:
  // forward's output, and the residual branch when asked for.
  WithResidualBranch normalize_input(const torch::Tensor& input, bool residual_branch);
  int64_t hidden_size() const;
  bool has_bias() const;
  int64_t forward_calls_ = 0;
};

TORCH_MODULE(Fp8LayerNorm);

/// Options of Fp8LayerNormLinear: a LayerNorm (or RMSNorm) over in_features followed by a
/// linear layer.
///   Fp8LayerNormLinearOptions(1024, 3072).eps(1e-5).bias(false)
///   Fp8LayerNormLinearOptions(2048, 3072).normalization(Normalization::kRMSNorm).bias(false)
struct Fp8LayerNormLinearOptions {
  Fp8LayerNormLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// As Fp8LayerNormOptions::normalization (RMSNorm: the norm has no bias). Default: kLayerNorm.
  TORCH_ARG(Normalization, normalization) = Normalization::kLayerNorm;
  /// The LayerNorm's eps. Default: 1e-5.
  TORCH_ARG(double, eps) = 1e-5;
  /// The linear layer's bias. Default: true.
  TORCH_ARG(bool, bias) = true;
  /// As Fp8LinearOptions::fp8_amax_history_len. Default: 1024.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 1024;
  /// As Fp8LinearOptions::fp8_min_gemm_size. Default: kDefaultFp8MinGemmSize (per shape).
  TORCH_ARG(int64_t, fp8_min_gemm_size) = kDefaultFp8MinGemmSize;
  /// As Fp8LinearOptions::cache_fp8_weight. Default: false.
  TORCH_ARG(bool, cache_fp8_weight) = false;
  /// As Fp8LinearOptions::fp8_params (set by constructing under Fp8ModelInit). Default: false.
  TORCH_ARG(bool, fp8_params) = false;
};

/// Fp8LayerNorm followed by Fp8Linear, fused the way Transformer Engine's LayerNormLinear is
/// (with normalization "LayerNorm" or "RMSNorm"):
/// inside an FP8 region (when the linear layer runs in FP8) the LayerNorm kernel writes its
/// output straight into E4M3 with the linear layer's input scale and records its amax into the
/// linear layer's input history slot — one read of x, one FP8 write, no high-precision
/// activation and no second quantization. The backward pass transposes those FP8 bytes for the
/// weight gradient and runs the LayerNorm backward on the dgrad output. Outside a region (or
/// when the linear layer falls back to high precision) it computes layer_norm(x) then
/// linear(·) exactly like the two modules in sequence.
///
/// Submodules `layer_norm` (Fp8LayerNorm, parameters layer_norm.weight / layer_norm.bias; no
/// bias for RMSNorm) and
/// `linear` (Fp8Linear, with its FP8 metadata buffers). Built under Fp8ModelInit, the linear
/// weight is kept in FP8 (fp8_params).
class Fp8LayerNormLinearImpl : public torch::nn::Cloneable<Fp8LayerNormLinearImpl> {
 public:
  Fp8LayerNormLinearImpl(int64_t in_features, int64_t out_features)
      : Fp8LayerNormLinearImpl(Fp8LayerNormLinearOptions(in_features, out_features)) {}
  explicit Fp8LayerNormLinearImpl(const Fp8LayerNormLinearOptions& options_);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// Input [..., in_features] → output [..., out_features].
  torch::Tensor forward(const torch::Tensor& input);

  /// forward(input).split_with_sizes(split_sizes, -1), whose pieces' gradients the FP8 backward
  /// quantizes where they are instead of concatenating them first (cast_transpose_columns;
  /// TE's _SplitAlongDim does the same with an attention that writes one dqkv buffer): a fused
  /// QKV projection's q, k and v, whose gradients attention returns as three tensors.
  /// split_sizes: positive, summing to out_features. In the blockwise recipe (LayerNorm, then
  /// Fp8Linear::forward_split) the pieces are quantized in their 1×128 tiles where they are
  /// (quantize_blockwise_columns). Outside FP8 autograd concatenates the gradients as
  /// split_with_sizes' backward does.
  std::vector<torch::Tensor> forward_split(const torch::Tensor& input,
                                           at::IntArrayRef split_sizes);

  /// forward_split's pieces (split_sizes empty: forward's output) as outputs, and the input as
  /// the block's residual branch, on every path (fused in FP8, the two modules in sequence).
  WithResidualBranch forward_split_with_residual_branch(const torch::Tensor& input,
                                                        at::IntArrayRef split_sizes);

  Fp8LayerNormLinearOptions options;
  Fp8LayerNorm layer_norm{nullptr};
  Fp8Linear linear{nullptr};

 private:
  // forward's pieces (split_sizes empty → the whole output as one), and the residual branch
  // when asked for.
  WithResidualBranch forward_pieces(const torch::Tensor& input, at::IntArrayRef split_sizes,
                                    bool residual_branch);
};

TORCH_MODULE(Fp8LayerNormLinear);

/// The activation between an Fp8LayerNormMLP's two GEMMs (TE's LayerNormMLP `activation`).
enum class MlpActivation {
  kGelu,    ///< "gelu": GELU, tanh approximation; FC1 is ffn_hidden_size wide
  kSwiGlu,  ///< "swiglu": silu(gate) · up over FC1's fused output, 2 × ffn_hidden_size wide,
            ///< gate first (Llama's w1 and w3 stacked)
};

/// Options of Fp8LayerNormMLP (TE's LayerNormMLP):
///   Fp8LayerNormMLPOptions(2048, 8192).eps(1e-5)
///   Fp8LayerNormMLPOptions(2048, 8192).normalization(Normalization::kRMSNorm)
///       .activation(MlpActivation::kSwiGlu).bias(false)                  // Llama's MLP
struct Fp8LayerNormMLPOptions {
  Fp8LayerNormMLPOptions(int64_t hidden_size, int64_t ffn_hidden_size)
      : hidden_size_(hidden_size), ffn_hidden_size_(ffn_hidden_size) {}
  /// Size of each input and output sample.
  TORCH_ARG(int64_t, hidden_size);
  /// Width of the hidden layer (FC2's input; FC1's output is twice as wide with SwiGLU).
  TORCH_ARG(int64_t, ffn_hidden_size);
  /// GELU or SwiGLU. Default: kGelu.
  TORCH_ARG(MlpActivation, activation) = MlpActivation::kGelu;
  /// As Fp8LayerNormOptions::normalization. Default: kLayerNorm.
  TORCH_ARG(Normalization, normalization) = Normalization::kLayerNorm;
  /// The LayerNorm's eps. Default: 1e-5.
  TORCH_ARG(double, eps) = 1e-5;
  /// Biases of both linear layers. Default: true.
  TORCH_ARG(bool, bias) = true;
  /// As Fp8LinearOptions::fp8_amax_history_len, for both layers. Default: 1024.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 1024;
  /// As Fp8LinearOptions::fp8_min_gemm_size, for each layer's GEMM. Default:
  /// kDefaultFp8MinGemmSize (per shape).
  TORCH_ARG(int64_t, fp8_min_gemm_size) = kDefaultFp8MinGemmSize;
  /// As Fp8LinearOptions::cache_fp8_weight. Default: false.
  TORCH_ARG(bool, cache_fp8_weight) = false;
  /// As Fp8LinearOptions::fp8_params (set by constructing under Fp8ModelInit). Default: false.
  TORCH_ARG(bool, fp8_params) = false;
  /// In an FP8 region, run as one fused call (below); false runs the two modules one after
  /// the other there too (same parameters, unfused casts). Default: true.
  TORCH_ARG(bool, fused) = true;
};

/// LayerNorm → FC1 → GELU (tanh) → FC2, fused the way Transformer Engine's LayerNormMLP is
/// (RMSNorm and SwiGLU by the options, as TE's `normalization` and `activation`).
/// Inside an FP8 region, when both GEMMs run in FP8:
///   forward   the LayerNorm writes FC1's FP8 input (as Fp8LayerNormLinear); GELU is computed
///             inside the FP8 cast (and transpose) of FC2's input (cast_transpose_gelu), so its
///             high-precision output is never written; SwiGLU is one kernel (ops/swiglu.h)
///             before that cast (measured faster on an H200 than cast_transpose_swiglu so far:
///             bench/results/llama_swiglu_cast/);
///   backward  GELU's derivative is applied inside the cast-transpose of FC1's output gradient
///             (cast_transpose_dgelu), which also gives FC1's bias gradient; SwiGLU's gradient
///             is one kernel (ops/swiglu.h) before that cast; FC2's bias gradient comes from its
///             own gradient's cast.
/// Under the blockwise recipe (1×128 tiles) the LayerNorm runs as its own module (FC1
/// quantizes its output as any input); with GELU, GELU is computed inside the 1×128
/// quantization of FC2's input and its derivative inside that of FC1's output gradient (with
/// FC1's bias gradient): quantize_blockwise_gelu / _dgelu, each value rounded to the compute
/// dtype first, as TE quantizes an activation for that recipe. With SwiGLU the modules run in
/// sequence.
/// Otherwise (outside a region, when either layer stays in high precision, or with
/// fused(false)) it computes ln_fc1(x), the activation (at::gelu(·, "tanh") or amp8::swiglu),
/// fc2(·) with the two modules in sequence.
///
/// Submodules `ln_fc1` (Fp8LayerNormLinear: ln_fc1.layer_norm, ln_fc1.linear) and `fc2`
/// (Fp8Linear), each with its own FP8 metadata; built under Fp8ModelInit, both weights are
/// kept in FP8 (fp8_params). On the CPU, values and gradients are those of the modules in
/// sequence within FP8 rounding (GELU computed in float32 from FC1's output in the compute
/// dtype, as the sequence does; GELU's output and its gradient are not rounded to the compute
/// dtype before their FP8 casts); on an H200, in float32, outputs and gradients are equal bit
/// for bit (FC1's bias gradient within 1e-7 relative: its column sum is added in another order).
class Fp8LayerNormMLPImpl : public torch::nn::Cloneable<Fp8LayerNormMLPImpl> {
 public:
  Fp8LayerNormMLPImpl(int64_t hidden_size, int64_t ffn_hidden_size)
      : Fp8LayerNormMLPImpl(Fp8LayerNormMLPOptions(hidden_size, ffn_hidden_size)) {}
  explicit Fp8LayerNormMLPImpl(const Fp8LayerNormMLPOptions& options_);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// Input [..., hidden_size] → output [..., hidden_size].
  torch::Tensor forward(const torch::Tensor& input);

  /// residual + forward(input), residual of the input's shape (a pre-norm block's `h +
  /// mlp(h)`), added by FC2's GEMM in an FP8 region where Fp8Linear::forward_with_residual's
  /// would add it (the residual in the GEMM's output dtype, no token padding), else after.
  /// When `residual` is `input` itself (the same tensor, as in `h + mlp(h)`), its gradient is
  /// added by the LayerNorm's backward kernel into the input's (see WithResidualBranch) on
  /// every path, the fused function's whose GEMM cannot add the residual too.
  torch::Tensor forward_with_residual(const torch::Tensor& input, const torch::Tensor& residual);

  Fp8LayerNormMLPOptions options;
  Fp8LayerNormLinear ln_fc1{nullptr};
  Fp8Linear fc2{nullptr};

 private:
  // forward, plus `residual` when defined.
  torch::Tensor forward_adding(const torch::Tensor& input, const torch::Tensor& residual);
};

TORCH_MODULE(Fp8LayerNormMLP);

}  // namespace amp8
