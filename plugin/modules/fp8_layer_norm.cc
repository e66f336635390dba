#include "plugin/modules/fp8_layer_norm.h"

#include <torch/autograd.h>

#include <numeric>

#include "ops/fp8_gemm.h"
#include "ops/layer_norm.h"
#include "plugin/modules/detail/fp8_linear_core.h"

namespace amp8 {
namespace {

// Stand-in for an undefined tensor argument of a custom autograd function.
at::Tensor or_empty(const at::Tensor& t, const at::TensorOptions& options) {
  return t.defined() ? t : at::empty({0}, options);
}

at::Tensor defined_or_null(const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); }

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  // weight/bias: [hidden] or empty (no affine). Returns [rows, hidden].
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x2d,
                               const torch::Tensor& weight, const torch::Tensor& bias, double eps) {
    const auto gamma = defined_or_null(weight), beta = defined_or_null(bias);
    auto result = layer_norm(x2d, gamma, beta, eps);
    ctx->save_for_backward({x2d, result.stats.mean, result.stats.rstd, weight, bias});
    return result.out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto gamma = defined_or_null(saved[3]), beta = defined_or_null(saved[4]);
    auto grads = layer_norm_backward(grad_outputs[0], saved[0], {saved[1], saved[2]}, gamma, beta);
    if (!ctx->needs_input_grad(1)) grads.grad_gamma = at::Tensor();
    if (!ctx->needs_input_grad(2)) grads.grad_beta = at::Tensor();
    return {grads.grad_input, grads.grad_gamma, grads.grad_beta, torch::Tensor()};
  }
};

// LayerNorm → FP8 → GEMM in one function (see Fp8LayerNormLinearImpl).
struct LayerNormLinearFunction : public torch::autograd::Function<LayerNormLinearFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& ln_weight, const torch::Tensor& ln_bias,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               const torch::Tensor& grad_anchor, Fp8LinearImpl* linear,
                               const detail::Fp8LinearCall& call, double eps) {
    const int64_t hidden = ln_weight.size(0);
    const auto& recipe = call.recipe;
    const auto format = recipe.forward_format;
    const auto x2d = input.reshape({-1, hidden}).contiguous();
    const int64_t rows = x2d.size(0), rows_padded = detail::padded_rows(rows);
    const auto& slots = detail::Fp8LinearInternals::slots(*linear);
    const auto& scale = slots.input_scale;
    const auto& amax_slot = slots.input_amax;

    Fp8Tensor x_q;
    at::Tensor x_t;  // tensorwise only: made by cast_transpose with the quantization
    LayerNormStats stats;
    if (recipe.delayed()) {
      const auto fp8_options = x2d.options().dtype(fp8_dtype(format));
      auto buffer = rows_padded == rows ? at::empty({rows, hidden}, fp8_options)
                                        : at::zeros({rows_padded, hidden}, fp8_options);
      auto ln = layer_norm_fp8(x2d, ln_weight, ln_bias, eps, scale, format, amax_slot,
                               /*accumulate_amax=*/true, buffer.narrow(0, 0, rows));
      x_q = Fp8Tensor(buffer, ln.out.scale_inv, format);
      stats = ln.stats;
    } else {
      // Current scaling needs the output's amax before its scale: two passes.
      auto ln = layer_norm(x2d, ln_weight, ln_bias, eps);
      auto q = detail::quantize_for(detail::pad_rows(ln.out, rows_padded), recipe, format, scale,
                                    amax_slot);
      x_q = q.data;
      x_t = q.transposed.data;
      stats = ln.stats;
    }
    Fp8GemmOptions gemm;
    gemm.use_fast_accum = true;
    const bool has_bias = linear->options.bias();
    if (has_bias) gemm.bias = bias;
    auto y = fp8_gemm(x_q, call.weight_q.data, call.out_dtype, gemm);
    if (rows_padded != rows) y = y.narrow(0, 0, rows);

    detail::save_dgrad_weight(ctx, call.weight_q,
                              {x2d, stats.mean, stats.rstd, ln_weight, ln_bias, x_q.data,
                               x_q.scale_inv, x_t});
    const detail::Fp8LinearSaved saved{linear,
                                       recipe,
                                       rows,
                                       has_bias,
                                       x2d.scalar_type(),
                                       weight.scalar_type(),
                                       input.sizes().vec()};
    saved.save(ctx);
    return saved.unflatten(y);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = detail::Fp8LinearSaved::load(ctx);
    const auto& recipe = saved.recipe;
    const auto tensors = ctx->get_saved_variables();
    const auto& x2d = tensors[0];
    const LayerNormStats stats{tensors[1], tensors[2]};
    const auto& ln_weight = tensors[3];
    const auto& ln_bias = tensors[4];
    const auto format = recipe.forward_format;
    const auto w = detail::load_dgrad_weight(ctx, tensors[8], tensors[9], format);

    const bool need_ln =
        ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
    const bool need_weight = ctx->needs_input_grad(3) || saved.linear->options.fp8_params();
    Fp8Tensor x_t;
    if (need_weight) {
      x_t = tensors[7].defined() ? Fp8Tensor(tensors[7], tensors[6], format)
                                 : fp8_transpose(Fp8Tensor(tensors[5], tensors[6], format));
    }
    auto grads = detail::fp8_linear_backward(
        saved, grad_outputs[0].reshape({-1, saved.linear->options.out_features()}),
        std::move(x_t), w, need_ln, ctx->needs_input_grad(3), ctx->needs_input_grad(4));
    torch::Tensor grad_input, grad_ln_weight, grad_ln_bias;
    if (need_ln) {
      auto ln = layer_norm_backward(grads.input, x2d, stats, ln_weight, ln_bias);
      if (ctx->needs_input_grad(0)) {
        grad_input = saved.unflatten(ln.grad_input);
      }
      if (ctx->needs_input_grad(1)) grad_ln_weight = ln.grad_gamma;
      if (ctx->needs_input_grad(2)) grad_ln_bias = ln.grad_beta;
    }
    return {grad_input,      grad_ln_weight,  grad_ln_bias,    grads.weight,   grads.bias,
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

// ---- Fp8LayerNorm ----

Fp8LayerNormImpl::Fp8LayerNormImpl(const Fp8LayerNormOptions& options_) : options(options_) {
  reset();
}

int64_t Fp8LayerNormImpl::hidden_size() const {
  return std::accumulate(options.normalized_shape().begin(), options.normalized_shape().end(),
                         int64_t{1}, std::multiplies<>());
}

void Fp8LayerNormImpl::reset() {
  TORCH_CHECK(!options.normalized_shape().empty(),
              "Fp8LayerNorm: normalized_shape must name at least one dimension");
  for (auto d : options.normalized_shape()) {
    TORCH_CHECK(d > 0, "Fp8LayerNorm: normalized_shape must be positive, got ",
                options.normalized_shape());
  }
  TORCH_CHECK(options.eps() > 0, "Fp8LayerNorm: eps must be positive, got ", options.eps());
  if (options.elementwise_affine()) {
    weight = register_parameter("weight", torch::empty(options.normalized_shape()));
    bias = options.bias() ? register_parameter("bias", torch::empty(options.normalized_shape()))
                          : register_parameter("bias", {}, /*requires_grad=*/false);
  } else {
    weight = register_parameter("weight", {}, /*requires_grad=*/false);
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  reset_parameters();
}

void Fp8LayerNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (weight.defined()) weight.fill_(1.0);
  if (bias.defined()) bias.zero_();
}

void Fp8LayerNormImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "amp8::Fp8LayerNorm(" << at::IntArrayRef(options.normalized_shape())
         << ", eps=" << options.eps() << ", elementwise_affine=" << options.elementwise_affine()
         << ", bias=" << (options.elementwise_affine() && options.bias()) << ")";
}

torch::Tensor Fp8LayerNormImpl::forward(const torch::Tensor& input) {
  ++forward_calls_;
  const auto& shape = options.normalized_shape();
  const auto n = static_cast<int64_t>(shape.size());
  TORCH_CHECK(input.dim() >= n && input.sizes().slice(input.dim() - n).equals(shape),
              "Fp8LayerNorm: input must end with normalized_shape ", at::IntArrayRef(shape),
              ", got shape ", input.sizes());
  if (input.numel() == 0) return at::empty_like(input);
  const int64_t hidden = hidden_size();
  const auto placeholder = input.options().dtype(at::kFloat);
  auto y = LayerNormFunction::apply(
      input.reshape({-1, hidden}).contiguous(),
      or_empty(weight.defined() ? weight.reshape({hidden}) : weight, placeholder),
      or_empty(bias.defined() ? bias.reshape({hidden}) : bias, placeholder), options.eps());
  return y.reshape(input.sizes());
}

// ---- Fp8LayerNormLinear ----

Fp8LayerNormLinearImpl::Fp8LayerNormLinearImpl(const Fp8LayerNormLinearOptions& options_)
    : options(options_) {
  if (Fp8ModelInit::is_enabled()) options.fp8_params(true);
  reset();
}

void Fp8LayerNormLinearImpl::reset() {
  layer_norm = register_module(
      "layer_norm", Fp8LayerNorm(Fp8LayerNormOptions({options.in_features()}).eps(options.eps())));
  linear = register_module("linear",
                           Fp8Linear(Fp8LinearOptions(options.in_features(), options.out_features())
                                         .bias(options.bias())
                                         .fp8_amax_history_len(options.fp8_amax_history_len())
                                         .fp8_min_gemm_size(options.fp8_min_gemm_size())
                                         .cache_fp8_weight(options.cache_fp8_weight())
                                         .fp8_params(options.fp8_params())));
}

void Fp8LayerNormLinearImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "amp8::Fp8LayerNormLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", eps=" << options.eps()
         << ", bias=" << options.bias() << (options.fp8_params() ? ", fp8_params=true" : "") << ")";
}

torch::Tensor Fp8LayerNormLinearImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features(),
              "Fp8LayerNormLinear: input must have in_features=", options.in_features(),
              " as its last dimension, got shape ", input.sizes());
  auto& lin = *linear;
  auto call = detail::Fp8LinearInternals::prepare(lin, input);
  if (!call) return lin.forward(layer_norm->forward(input));
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 ||
                  input.scalar_type() == at::kHalf,
              "Fp8LayerNormLinear: input must be float32, bfloat16 or float16, got ",
              input.scalar_type());
  const auto& anchor = detail::Fp8LinearInternals::grad_anchor(lin);
  detail::Fp8LinearInternals::expect_main_grad(lin);
  return LayerNormLinearFunction::apply(input, layer_norm->weight, layer_norm->bias, lin.weight,
                                        lin.bias.defined() ? lin.bias : anchor.detach(), anchor,
                                        &lin, *call, options.eps());
}

}  // namespace amp8
