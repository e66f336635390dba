#include "plugin/modules/fp8_linear.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>

#include "ops/fp8_gemm.h"
#include "ops/scaling.h"
#include "plugin/modules/detail/fp8_linear_core.h"
#include "plugin/fp8/detail/fp8_state.h"
#include "plugin/fp8/fp8_autocast.h"

namespace amp8 {

namespace {

using detail::Fp8LinearInternals;

struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  // `grad_anchor` is an empty tensor that requires grad under fp8_params, so that backward
  // runs (and feeds main_grad) even when neither input nor bias needs a gradient.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               const torch::Tensor& grad_anchor, Fp8LinearImpl* module,
                               const detail::Fp8LinearCall& call) {
    const auto& recipe = call.recipe;
    auto x2d = input.reshape({-1, weight.size(1)});
    const int64_t rows = x2d.size(0);
    auto x = detail::pad_rows(x2d, detail::padded_rows(rows));

    const auto& slots = Fp8LinearInternals::slots(*module);
    auto x_q = detail::quantize_for(x, recipe, recipe.forward_format, slots.input_scale,
                                    slots.input_amax);
    Fp8GemmOptions gemm;
    gemm.use_fast_accum = true;
    const bool has_bias = module->options.bias();
    if (has_bias) gemm.bias = bias;
    auto y = fp8_gemm(x_q.data, call.weight_q.data, call.out_dtype, gemm);
    if (y.size(0) != rows) y = y.narrow(0, 0, rows);

    detail::save_dgrad_weight(ctx, call.weight_q, {});
    detail::save_input_transpose(ctx, x_q.transposed);
    const detail::Fp8LinearSaved saved{module,
                                       recipe,
                                       rows,
                                       has_bias,
                                       input.scalar_type(),
                                       weight.scalar_type(),
                                       bias.scalar_type(),
                                       input.sizes().vec()};
    saved.save(ctx);
    return saved.unflatten(y);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = detail::Fp8LinearSaved::load(ctx);
    const auto tensors = ctx->get_saved_variables();
    const auto format = saved.recipe.forward_format;
    const auto w = detail::load_dgrad_weight(ctx, tensors[0], tensors[1], format);
    auto grads = detail::fp8_linear_backward(
        saved, grad_outputs[0].reshape({-1, saved.linear->options.out_features()}),
        detail::take_input_transpose(ctx, format), w,
                                             ctx->needs_input_grad(0),
                                             ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    if (grads.input.defined()) grads.input = saved.unflatten(grads.input);
    return {grads.input,     grads.weight,    grads.bias,
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

Fp8LinearImpl::Fp8LinearImpl(const Fp8LinearOptions& options_) : options(options_) {
  if (Fp8ModelInit::is_enabled()) options.fp8_params(true);
  reset();
}

void Fp8LinearImpl::reset() {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "Fp8Linear: in_features and out_features must be positive, got ",
              options.in_features(), " and ", options.out_features());
  TORCH_CHECK(options.fp8_amax_history_len() >= 1,
              "Fp8Linear: fp8_amax_history_len must be >= 1, got ", options.fp8_amax_history_len());
  if (options.fp8_params() && !fp8_eligible()) {
    // The one rule for shapes FP8 GEMMs cannot take: the layer stays in high precision, its
    // weight included (an output head of 10 classes inside Fp8ModelInit is fine).
    TORCH_WARN("Fp8Linear(", options.in_features(), ", ", options.out_features(),
               "): FP8 needs in_features and out_features divisible by 16; this layer keeps its "
               "weight in high precision (fp8_params off for it) and computes in high precision");
    options.fp8_params(false);
  }
  weight =
      register_parameter("weight", torch::empty({options.out_features(), options.in_features()}),
                         /*requires_grad=*/!options.fp8_params());
  if (options.bias()) {
    bias = register_parameter("bias", torch::empty(options.out_features()));
  } else {
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  const int64_t h = options.fp8_amax_history_len();
  fp8_fwd_amax_history = register_buffer("fp8_fwd_amax_history", torch::zeros({h, 2}));
  fp8_fwd_scale = register_buffer("fp8_fwd_scale", torch::ones({2}));
  fp8_fwd_scale_inv = register_buffer("fp8_fwd_scale_inv", torch::ones({2}));
  fp8_bwd_amax_history = register_buffer("fp8_bwd_amax_history", torch::zeros({h, 1}));
  fp8_bwd_scale = register_buffer("fp8_bwd_scale", torch::ones({1}));
  fp8_bwd_scale_inv = register_buffer("fp8_bwd_scale_inv", torch::ones({1}));
  if (options.fp8_params())
    weight_scale_inv = register_buffer("weight_scale_inv", torch::ones({1}));
  weight_cache_.reset();
  main_grad_ = torch::Tensor();
  main_grad_bound_ = false;
  main_grad_hook_ = nullptr;
  pending_main_grads_ = 0;
  reset_parameters();
}

void Fp8LinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  // Under fp8_params the initial values are drawn in float32 (the same draws as
  // torch::nn::Linear) and then quantized.
  auto initial =
      options.fp8_params()
          ? torch::empty({options.out_features(), options.in_features()}, fp8_fwd_scale.options())
          : weight;
  torch::nn::init::kaiming_uniform_(initial, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
  if (options.fp8_params()) {
    high_precision_init_val_ =
        Fp8ModelInit::preserve_high_precision_init_val() ? initial : torch::Tensor();
    update_fp8_weight(initial);
  }
}

void Fp8LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "amp8::Fp8Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ", fp8_eligible=" << fp8_eligible()
         << (options.fp8_params() ? ", fp8_params=true" : "")
         << (options.keep_in_high_precision() ? ", keep_in_high_precision=true" : "") << ")";
}

bool Fp8LinearImpl::fp8_eligible() const {
  return options.in_features() % 16 == 0 && options.out_features() % 16 == 0;
}

void Fp8LinearImpl::ensure_history_len(int64_t history_len) {
  if (fp8_fwd_amax_history.size(0) == history_len) return;
  // In place (set_), so the registered buffers follow. Row 0 and the newest rows are kept.
  torch::NoGradGuard no_grad;
  auto resize = [&](torch::Tensor& buffer) {
    auto resized = torch::zeros({history_len, buffer.size(1)}, buffer.options());
    const int64_t keep = std::min(history_len, buffer.size(0));
    resized.narrow(0, 0, 1).copy_(buffer.narrow(0, 0, 1));
    if (keep > 1) {
      resized.narrow(0, history_len - keep + 1, keep - 1)
          .copy_(buffer.narrow(0, buffer.size(0) - keep + 1, keep - 1));
    }
    buffer.set_(resized);
  };
  resize(fp8_fwd_amax_history);
  resize(fp8_bwd_amax_history);
}

const Fp8LinearImpl::SlotViews& Fp8LinearImpl::slot_views() {
  const void* keys[4] = {fp8_fwd_scale.const_data_ptr(), fp8_fwd_amax_history.const_data_ptr(),
                         fp8_bwd_scale.const_data_ptr(), fp8_bwd_amax_history.const_data_ptr()};
  if (!std::equal(keys, keys + 4, slot_views_.keys)) {
    slot_views_.input_scale = fp8_fwd_scale.narrow(0, 0, 1);
    slot_views_.weight_scale = fp8_fwd_scale.narrow(0, 1, 1);
    slot_views_.input_amax = fp8_fwd_amax_history[0][0];
    slot_views_.weight_amax = fp8_fwd_amax_history[0][1];
    slot_views_.grad_scale = fp8_bwd_scale.narrow(0, 0, 1);
    slot_views_.grad_amax = fp8_bwd_amax_history[0][0];
    std::copy(keys, keys + 4, slot_views_.keys);
  }
  return slot_views_;
}

Fp8CastTranspose Fp8LinearImpl::quantized_weight(const Fp8Recipe& recipe) {
  if (options.fp8_params()) {
    // Already FP8. The transpose dgrad needs is a byte transpose, made by the backward itself
    // (fp8_linear_backward): made here, every layer's would stay alive from its forward to
    // its backward, one byte per parameter across the whole model.
    return {fp8_weight(), Fp8Tensor()};
  }
  const int64_t version = weight._version();
  if (options.cache_fp8_weight() && weight_cache_ && weight_cache_version_ == version &&
      weight_cache_data_ == weight.const_data_ptr()) {
    return *weight_cache_;
  }
  torch::NoGradGuard no_grad;
  const auto& slots = slot_views();
  auto q = detail::quantize_for(weight, recipe, recipe.forward_format, slots.weight_scale,
                                slots.weight_amax);
  if (options.cache_fp8_weight()) {
    weight_cache_ = q;
    weight_cache_version_ = version;
    weight_cache_data_ = weight.const_data_ptr();
  } else {
    weight_cache_.reset();
  }
  return q;
}

torch::Tensor Fp8LinearImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features(),
              "Fp8Linear: input must have in_features=", options.in_features(),
              " as its last dimension, got shape ", input.sizes());
  ++forward_calls_;
  auto call = Fp8LinearInternals::prepare(*this, input);
  if (!call) return high_precision_forward(input);
  const auto& anchor = Fp8LinearInternals::grad_anchor(*this);
  Fp8LinearInternals::expect_main_grad(*this);
  // Custom autograd functions take no undefined tensors: an empty tensor stands in for a
  // missing bias, and for the anchor outside fp8_params.
  return Fp8LinearFunction::apply(input, weight, bias.defined() ? bias : anchor.detach(), anchor,
                                  this, *call);
}

namespace detail {

bool Fp8LinearInternals::runs_in_fp8(const Fp8LinearImpl& linear, int64_t rows) {
  const auto& options = linear.options;
  return Fp8Autocast::is_enabled() && !options.keep_in_high_precision() && rows > 0 &&
         linear.fp8_eligible() &&
         rows * options.in_features() * options.out_features() >= options.fp8_min_gemm_size();
}

std::optional<Fp8LinearCall> Fp8LinearInternals::prepare(Fp8LinearImpl& linear,
                                                         const at::Tensor& input) {
  return prepare(linear, input, input.numel() / linear.options.in_features());
}

std::optional<Fp8LinearCall> Fp8LinearInternals::prepare(Fp8LinearImpl& linear,
                                                         const at::Tensor& input, int64_t rows) {
  const auto& options = linear.options;
  if (!runs_in_fp8(linear, rows)) {
    // Said once per process, where the reason is the layer's (not the region's or the input's).
    if (Fp8Autocast::is_enabled() && !options.keep_in_high_precision() && rows > 0) {
      if (!linear.fp8_eligible()) {
        TORCH_WARN_ONCE("Fp8Linear(", options.in_features(), ", ", options.out_features(),
                        "): FP8 GEMMs need both dimensions divisible by 16; this layer runs in "
                        "high precision.");
      } else {
        TORCH_WARN_ONCE("Fp8Linear(", options.in_features(), ", ", options.out_features(),
                        "): a GEMM of ", rows, " x ", options.in_features(), " x ",
                        options.out_features(), " is smaller than fp8_min_gemm_size (",
                        options.fp8_min_gemm_size(),
                        ") and runs in high precision, as every such GEMM will (reported once); "
                        "fp8_min_gemm_size(0) puts every GEMM in FP8.");
      }
    }
    return std::nullopt;
  }
  const auto compute = compute_dtype(input);
  TORCH_CHECK(compute == at::kFloat || compute == at::kBFloat16 || compute == at::kHalf,
              "Fp8Linear: in an FP8 region the input must be float32, bfloat16 or float16, got ",
              compute);
  const auto& recipe = Fp8Autocast::current_recipe();
  linear.ensure_history_len(recipe.amax_history_len);
  linear.amax_reduction_group_ = Fp8Autocast::current_group();
  if (recipe.delayed()) {
    register_forward_group(
        &linear, {linear.fp8_fwd_amax_history, linear.fp8_fwd_scale, linear.fp8_fwd_scale_inv});
  }
  return Fp8LinearCall{linear.quantized_weight(recipe), recipe, compute};
}

const at::Tensor& Fp8LinearInternals::grad_anchor(Fp8LinearImpl& linear) {
  if (!linear.grad_anchor_.defined() || linear.grad_anchor_.device() != linear.weight.device()) {
    linear.grad_anchor_ = torch::empty({0}, linear.fp8_fwd_scale.options())
                              .requires_grad_(linear.options.fp8_params());
  }
  return linear.grad_anchor_;
}

at::Tensor Fp8LinearInternals::high_precision_forward(Fp8LinearImpl& linear,
                                                      const at::Tensor& input) {
  return linear.high_precision_forward(input);
}

void Fp8LinearInternals::accumulate_main_grad(Fp8LinearImpl& linear, const at::Tensor& grad) {
  linear.accumulate_main_grad(grad);
}

void Fp8LinearInternals::accumulate_main_grad_gemm(Fp8LinearImpl& linear, const Fp8Tensor& grad_t,
                                                   const Fp8Tensor& x_t) {
  auto& main_grad = linear.main_grad_;
  if (!main_grad.defined()) {
    main_grad = fp8_gemm(grad_t, x_t, at::kFloat);
  } else {
    Fp8GemmOptions accumulate;
    accumulate.out = main_grad;
    accumulate.accumulate = true;
    fp8_gemm(grad_t, x_t, main_grad.scalar_type(), accumulate);  // float32 unless bound
  }
  linear.main_grad_accumulated();
}

void Fp8LinearInternals::expect_main_grad(Fp8LinearImpl& linear) {
  if (linear.options.fp8_params() && torch::GradMode::is_enabled()) ++linear.pending_main_grads_;
}

const c10::intrusive_ptr<c10d::ProcessGroup>& Fp8LinearInternals::group(
    const Fp8LinearImpl& linear) {
  return linear.amax_reduction_group_;
}

}  // namespace detail

// at::linear, not torch::nn::functional::linear: for inputs of more than two dimensions the
// C++ frontend's version computes matmul and then `output += bias`, a separate broadcast add
// over the whole output (ATen's non-vectorized elementwise kernel: 16 ms of a 200 ms bf16 step
// of the 1b GPT, profiled), where at::linear flattens a contiguous input into one addmm with
// the bias in the GEMM's epilogue, as Python's nn.Linear does.
torch::Tensor Fp8LinearImpl::high_precision_forward(const torch::Tensor& input) {
  if (!options.fp8_params()) return at::linear(input, weight, bias);
  // The FP8 weight, dequantized; its gradient goes to main_grad like the FP8 path's.
  // In the input's dtype (bf16/fp16 under a mixed precision's params), as nn::Linear's would be.
  const auto dtype = input.is_floating_point() ? input.scalar_type() : at::kFloat;
  auto w = fp8_weight().dequantize(dtype).requires_grad_(true);
  w.register_hook([this](const torch::Tensor& grad) { accumulate_main_grad(grad); });
  Fp8LinearInternals::expect_main_grad(*this);
  return at::linear(input, w, bias);
}

}  // namespace amp8
