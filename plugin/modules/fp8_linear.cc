#include "plugin/modules/fp8_linear.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "ops/fp8_gemm.h"
#include "ops/scaling.h"
#include "plugin/modules/detail/fp8_linear_core.h"
#include "plugin/fp8/detail/fp8_state.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/fp8/fp8_gemm_choice.h"

namespace amp8 {

namespace {

struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  // The dgrad operand; the input's transpose travels in saved_data (take_input_transpose).
  struct SavedTensors {
    at::Tensor weight, weight_scale_inv;
    static constexpr auto fields() {
      return std::array{&SavedTensors::weight, &SavedTensors::weight_scale_inv};
    }
  };

  // `grad_anchor` is an empty tensor that requires grad under fp8_params, so that backward
  // runs (and feeds main_grad) even when neither input nor bias needs a gradient.
  // The output, or with split_sizes its column pieces (views of it), whose gradients the
  // backward quantizes without concatenating them. With has_residual, the GEMM adds `residual`
  // (detail::gemm_residual's [rows, out_features]) to the output; its gradient is the output's.
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
      const torch::Tensor& weight, const torch::Tensor& bias, const torch::Tensor& grad_anchor,
      const torch::Tensor& residual, bool has_bias, bool has_residual,
      const Fp8LinearImpl::Fp8Call& call, const std::vector<int64_t>& split_sizes) {
    auto pieces = [&](const torch::Tensor& y) {
      return split_sizes.empty() ? torch::autograd::variable_list{y}
                                 : y.split_with_sizes(split_sizes, -1);
    };
    const auto& recipe = call.recipe;
    auto x2d = input.reshape({-1, weight.size(1)});
    const int64_t rows = x2d.size(0);
    auto x = detail::pad_rows(x2d, detail::padded_rows(rows));
    const auto saved = detail::Fp8LinearSaved::of(call, rows, has_bias, input, weight, bias,
                                                  input.sizes().vec());
    saved.save(ctx);
    const auto& gemm_residual = has_residual ? residual : at::Tensor();
    if (recipe.blockwise()) {
      auto y = detail::fp8_linear_forward_blockwise(
          ctx, saved, x, call.weight_blocks, has_bias ? bias : at::Tensor(), call.out_dtype,
          "x_t", detail::QuantizeActivation::kNone, gemm_residual);
      const auto& w = detail::dgrad_weight_blocks_of(call.weight_blocks, saved);
      detail::save_tensors(ctx, SavedTensors{w.data, w.scale_inv});
      return pieces(saved.unflatten(y));
    }

    auto x_q = detail::quantize_for(x, recipe, *call.meta, Fp8Slot::kInput);
    Fp8GemmOptions gemm;
    gemm.use_fast_accum = true;
    if (has_bias) gemm.bias = bias;
    gemm.residual = gemm_residual;
    auto y = fp8_gemm(x_q.data, call.weight_q.data, call.out_dtype, gemm);
    if (y.size(0) != rows) y = y.narrow(0, 0, rows);

    const auto w = detail::dgrad_weight_of(call.weight_q);
    detail::save_tensors(ctx, SavedTensors{w.weight.data, w.weight.scale_inv});
    detail::save_input_transpose(ctx, x_q.transposed);
    return pieces(saved.unflatten(y));
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = detail::Fp8LinearSaved::load(ctx);
    const auto tensors = detail::load_tensors<SavedTensors>(ctx);
    // One gradient per output: [..., out_features], or one per piece (autograd materializes
    // the gradient of a piece nobody used as zeros).
    std::vector<at::Tensor> columns;
    columns.reserve(grad_outputs.size());
    for (const auto& grad : grad_outputs) columns.push_back(grad.reshape({-1, grad.size(-1)}));
    // A residual's gradient is the output's (one output: residuals are not split), as
    // [rows, out_features].
    const auto residual_grad = ctx->needs_input_grad(4) ? columns.front() : torch::Tensor();
    if (saved.recipe.blockwise()) {
      auto grads = detail::fp8_linear_backward_blockwise(
          saved, columns,
          detail::take_input_transpose_blockwise(ctx, saved.recipe.forward_format),
          {tensors.weight, tensors.weight_scale_inv, saved.recipe.forward_format,
           Fp8BlockShape::k128x128},
          saved.dgrad_weight_transposed,
          ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2));
      if (grads.input.defined()) grads.input = saved.unflatten(grads.input);
      return {grads.input,     grads.weight,    grads.bias,      torch::Tensor(),
              residual_grad,   torch::Tensor(), torch::Tensor(), torch::Tensor(),
              torch::Tensor()};
    }
    auto grads = detail::fp8_linear_backward(
        saved, columns,
        detail::take_input_transpose(ctx, saved.recipe.forward_format),
        saved.dgrad_weight(tensors.weight, tensors.weight_scale_inv), ctx->needs_input_grad(0),
        ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    if (grads.input.defined()) grads.input = saved.unflatten(grads.input);
    return {grads.input,   grads.weight,    grads.bias,      torch::Tensor(), residual_grad,
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
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
  check_fp8_min_gemm_size(options.fp8_min_gemm_size(), "Fp8Linear: fp8_min_gemm_size");
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
  // A meta of its own, over the buffers just registered: a clone() copy (Cloneable
  // copy-constructs, then resets) must not share its original's.
  meta_ = c10::make_intrusive<Fp8Meta>(
      DelayedScalingGroup{fp8_fwd_amax_history, fp8_fwd_scale, fp8_fwd_scale_inv},
      DelayedScalingGroup{fp8_bwd_amax_history, fp8_bwd_scale, fp8_bwd_scale_inv},
      weight_scale_inv, weight.sizes().vec());
  grad_anchor_ = torch::Tensor();
  weight_cache_.reset();
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

Fp8CastTranspose Fp8LinearImpl::quantized_weight(const Fp8Recipe& recipe) {
  if (options.fp8_params()) {
    // Already FP8. The transpose dgrad needs is a byte transpose, made by the backward itself
    // (fp8_linear_backward): made here, every layer's would stay alive from its forward to
    // its backward, one byte per parameter across the whole model.
    return {fp8_weight(), Fp8Tensor()};
  }
  if (weight_cache_fits(recipe)) return weight_cache_->tensorwise;
  weight_cache_.reset();  // before the new copy is made: never two at once
  torch::NoGradGuard no_grad;
  auto q = detail::quantize_for(weight, recipe, *meta_, Fp8Slot::kWeight);
  if (options.cache_fp8_weight()) {
    weight_cache_ = WeightCache{weight._version(), weight.const_data_ptr(), recipe.scaling, recipe.forward_format, q, {}};
  }
  return q;
}

Fp8BlockwiseCastTranspose Fp8LinearImpl::quantized_weight_blocks(const Fp8Recipe& recipe) {
  if (weight_cache_fits(recipe)) return weight_cache_->blocks;
  weight_cache_.reset();
  torch::NoGradGuard no_grad;
  auto blocks = quantize_blockwise(weight, weight_block_options(recipe.forward_format), /*transposed=*/true);
  if (options.cache_fp8_weight()) {
    weight_cache_ = WeightCache{weight._version(), weight.const_data_ptr(), recipe.scaling, recipe.forward_format, {}, blocks};
  }
  return blocks;
}

bool Fp8LinearImpl::weight_cache_fits(const Fp8Recipe& recipe) const {
  return options.cache_fp8_weight() && weight_cache_ && weight_cache_->version == weight._version() &&
         weight_cache_->data == weight.const_data_ptr() && weight_cache_->scaling == recipe.scaling &&
         weight_cache_->format == recipe.forward_format;
}

torch::Tensor Fp8LinearImpl::forward(const torch::Tensor& input) {
  return forward_pieces(input, {}, {}).front();
}

torch::Tensor Fp8LinearImpl::forward_with_residual(const torch::Tensor& input,
                                                  const torch::Tensor& residual) {
  check_input(input);
  auto output_sizes = input.sizes().vec();
  output_sizes.back() = options.out_features();
  TORCH_CHECK(residual.defined() && residual.sizes() == at::IntArrayRef(output_sizes),
              "Fp8Linear::forward_with_residual: residual must have the output's shape ",
              at::IntArrayRef(output_sizes), ", got ",
              residual.defined() ? residual.sizes() : at::IntArrayRef{});
  return forward_pieces(input, {}, residual).front();
}

std::vector<torch::Tensor> Fp8LinearImpl::forward_split(const torch::Tensor& input,
                                                        at::IntArrayRef split_sizes) {
  detail::check_split_sizes(split_sizes, options.out_features(), "Fp8Linear::forward_split");
  return forward_pieces(input, split_sizes, {});
}

void Fp8LinearImpl::check_input(const torch::Tensor& input) const {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features(),
              "Fp8Linear: input must have in_features=", options.in_features(),
              " as its last dimension, got shape ", input.sizes());
}

std::vector<torch::Tensor> Fp8LinearImpl::forward_pieces(const torch::Tensor& input,
                                                         at::IntArrayRef split_sizes,
                                                         const torch::Tensor& residual) {
  check_input(input);
  ++forward_calls_;
  auto call = prepare_fp8_call(input, input.numel() / options.in_features());
  if (!call) {
    auto y = high_precision_forward(input);
    if (residual.defined()) y = residual + y;
    return split_sizes.empty() ? std::vector<torch::Tensor>{y} : y.split_with_sizes(split_sizes, -1);
  }
  const auto& anchor = grad_anchor();
  const auto gemm_residual = detail::gemm_residual(residual, input.numel() / options.in_features(),
                                                   call->out_dtype);
  // Custom autograd functions take no undefined tensors: an empty tensor stands in for a
  // missing bias or residual, and for the anchor outside fp8_params.
  auto outputs = Fp8LinearFunction::apply(
      input, weight, bias.defined() ? bias : anchor.detach(), anchor,
      gemm_residual.defined() ? gemm_residual : anchor.detach(), options.bias(),
      gemm_residual.defined(), *call, split_sizes.vec());
  if (residual.defined() && !gemm_residual.defined()) outputs.front() = residual + outputs.front();
  return outputs;
}

bool Fp8LinearImpl::runs_in_fp8(int64_t rows) const {
  return Fp8Autocast::is_enabled() && !options.keep_in_high_precision() && rows > 0 &&
         fp8_eligible() &&
         fp8_gemm_chosen(rows, options.in_features(), options.out_features(),
                         options.fp8_min_gemm_size(), options.fp8_params());
}

std::optional<Fp8LinearImpl::Fp8Call> Fp8LinearImpl::prepare_fp8_call(const torch::Tensor& input,
                                                                      int64_t rows) {
  if (!runs_in_fp8(rows)) {
    // Said once per process, where the reason is the layer's (not the region's or the input's).
    if (Fp8Autocast::is_enabled() && !options.keep_in_high_precision() && rows > 0) {
      if (!fp8_eligible()) {
        TORCH_WARN_ONCE("Fp8Linear(", options.in_features(), ", ", options.out_features(),
                        "): FP8 GEMMs need both dimensions divisible by 16; this layer runs in "
                        "high precision.");
      } else {
        TORCH_WARN_ONCE("Fp8Linear(", options.in_features(), ", ", options.out_features(),
                        "): a GEMM of ", rows, " x ", options.in_features(), " x ",
                        options.out_features(), " runs in high precision under fp8_min_gemm_size ",
                        options.fp8_min_gemm_size(),
                        options.fp8_min_gemm_size() == kFp8GemmSizeByShape
                            ? " (per shape: FP8 was measured slower there)"
                            : " (a smaller GEMM)",
                        ", as every such GEMM will (reported once); fp8_min_gemm_size(0) puts "
                        "every GEMM in FP8.");
      }
    }
    return std::nullopt;
  }
  const auto compute = detail::compute_dtype(input);
  TORCH_CHECK(compute == at::kFloat || compute == at::kBFloat16 || compute == at::kHalf,
              "Fp8Linear: in an FP8 region the input must be float32, bfloat16 or float16, got ",
              compute);
  const auto& recipe = Fp8Autocast::current_recipe();
  if (recipe.blockwise()) {
    // Scales come from each tile's own values: no history, no registration. The weight's
    // blocks and their transpose (dgrad's operand) share the scales.
    if (options.fp8_params()) {
      // Stored in blocks already; the backward transposes them for dgrad (as the tensorwise
      // path's byte transpose: made here, every layer's would live until its backward).
      auto blocks = fp8_weight_blocks();
      if (torch::GradMode::is_enabled()) meta_->main_grad().expect();
      return Fp8Call{{}, {std::move(blocks), {}}, recipe, compute, meta_};
    }
    return Fp8Call{{}, quantized_weight_blocks(recipe), recipe, compute, meta_};
  }
  meta_->ensure_history_len(recipe.amax_history_len);
  meta_->set_amax_reduction_group(Fp8Autocast::current_group());
  if (recipe.delayed()) detail::register_forward_group(meta_.get(), meta_->forward_group());
  if (options.fp8_params() && torch::GradMode::is_enabled()) meta_->main_grad().expect();
  return Fp8Call{quantized_weight(recipe), {}, recipe, compute, meta_};
}

const torch::Tensor& Fp8LinearImpl::grad_anchor() {
  if (!grad_anchor_.defined() || grad_anchor_.device() != weight.device()) {
    grad_anchor_ =
        torch::empty({0}, fp8_fwd_scale.options()).requires_grad_(options.fp8_params());
  }
  return grad_anchor_;
}

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
  auto w = dequantized_weight(dtype).requires_grad_(true);
  // The hook holds the meta, not the module: the graph may outlive either.
  w.register_hook([meta = meta_](const torch::Tensor& grad) { meta->main_grad().add(grad); });
  if (torch::GradMode::is_enabled()) meta_->main_grad().expect();
  return at::linear(input, w, bias);
}

}  // namespace amp8
