#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <ostream>
#include <vector>

#include "plugin/modules/fp8_linear.h"

namespace amp8 {

/// Options of Fp8LayerNorm, like torch::nn::LayerNormOptions:
///   Fp8LayerNormOptions({1024}).eps(1e-6)
struct Fp8LayerNormOptions {
  /* implicit */ Fp8LayerNormOptions(std::vector<int64_t> normalized_shape)
      : normalized_shape_(std::move(normalized_shape)) {}
  /// The trailing dimensions normalized over (their product is the hidden size).
  TORCH_ARG(std::vector<int64_t>, normalized_shape);
  /// Added to the variance for numerical stability. Default: 1e-5.
  TORCH_ARG(double, eps) = 1e-5;
  /// Learn a per-element scale (`weight`, ones) and shift (`bias`, zeros). Default: true.
  TORCH_ARG(bool, elementwise_affine) = true;
  /// Learn the shift `bias` (only with elementwise_affine). Default: true.
  TORCH_ARG(bool, bias) = true;
};

/// A drop-in replacement for torch::nn::LayerNorm (same parameters `weight`/`bias`, same
/// initialisation, same biased variance) computed by amp8's LayerNorm op: statistics in
/// float32 in the forward and the backward pass, fused CUDA kernels (ops/layer_norm.h), the
/// output in the input's dtype (as Transformer Engine's LayerNorm; torch::nn::LayerNorm under
/// at::autocast returns float32).
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
  /// How many times forward() has run (see Fp8LinearImpl::forward_calls).
  int64_t forward_calls() const { return forward_calls_; }

  Fp8LayerNormOptions options;
  torch::Tensor weight;  ///< [*normalized_shape], or undefined without elementwise_affine
  torch::Tensor bias;    ///< [*normalized_shape], or undefined

 private:
  int64_t hidden_size() const;
  int64_t forward_calls_ = 0;
};

TORCH_MODULE(Fp8LayerNorm);

/// Options of Fp8LayerNormLinear: a LayerNorm over in_features followed by a linear layer.
///   Fp8LayerNormLinearOptions(1024, 3072).eps(1e-5).bias(false)
struct Fp8LayerNormLinearOptions {
  Fp8LayerNormLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// The LayerNorm's eps. Default: 1e-5.
  TORCH_ARG(double, eps) = 1e-5;
  /// The linear layer's bias. Default: true.
  TORCH_ARG(bool, bias) = true;
  /// As Fp8LinearOptions::fp8_amax_history_len. Default: 1024.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 1024;
  /// As Fp8LinearOptions::fp8_min_gemm_size. Default: kDefaultFp8MinGemmSize (2^36).
  TORCH_ARG(int64_t, fp8_min_gemm_size) = kDefaultFp8MinGemmSize;
  /// As Fp8LinearOptions::cache_fp8_weight. Default: false.
  TORCH_ARG(bool, cache_fp8_weight) = false;
  /// As Fp8LinearOptions::fp8_params (set by constructing under Fp8ModelInit). Default: false.
  TORCH_ARG(bool, fp8_params) = false;
};

/// Fp8LayerNorm followed by Fp8Linear, fused the way Transformer Engine's LayerNormLinear is:
/// inside an FP8 region (when the linear layer runs in FP8) the LayerNorm kernel writes its
/// output straight into E4M3 with the linear layer's input scale and records its amax into the
/// linear layer's input history slot — one read of x, one FP8 write, no high-precision
/// activation and no second quantization. The backward pass transposes those FP8 bytes for the
/// weight gradient and runs the LayerNorm backward on the dgrad output. Outside a region (or
/// when the linear layer falls back to high precision) it computes layer_norm(x) then
/// linear(·) exactly like the two modules in sequence.
///
/// Submodules `layer_norm` (Fp8LayerNorm, parameters layer_norm.weight / layer_norm.bias) and
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

  Fp8LayerNormLinearOptions options;
  Fp8LayerNorm layer_norm{nullptr};
  Fp8Linear linear{nullptr};
};

TORCH_MODULE(Fp8LayerNormLinear);

}  // namespace amp8
