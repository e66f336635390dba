#include "plugin/modules/fp8_layer_norm.h"

#include <torch/autograd.h>

#include <array>
#include <numeric>

#include "ops/blockwise.h"
#include "ops/fp8_gemm.h"
#include "ops/layer_norm.h"
#include "ops/swiglu.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/modules/detail/fp8_linear_core.h"

namespace amp8 {
namespace {

// The blockwise recipe has no fused LayerNorm casts: under it Fp8LayerNormLinear runs its parts
// one after the other (the Fp8Linear blockwise), and Fp8LayerNormMLP its LayerNorm as a module
// before BlockwiseGeluMLPFunction (GELU) or its parts (SwiGLU).
bool in_blockwise_region() {
  return Fp8Autocast::is_enabled() && Fp8Autocast::current_recipe().blockwise();
}

// Stand-in for an undefined tensor argument of a custom autograd function.
at::Tensor or_empty(const at::Tensor& t, const at::TensorOptions& options) {
  return t.defined() ? t : at::empty({0}, options);
}

at::Tensor defined_or_null(const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); }

// The op of a module's normalization (ops/layer_norm.h); `beta` is undefined for RMSNorm.
LayerNormResult normalize(Normalization norm, const at::Tensor& x, const at::Tensor& gamma,
                          const at::Tensor& beta, double eps) {
  return norm == Normalization::kRMSNorm ? rms_norm(x, gamma, eps)
                                         : layer_norm(x, gamma, beta, eps);
}

LayerNormGrads normalize_backward(Normalization norm, const at::Tensor& grad_out,
                                  const at::Tensor& x, const LayerNormStats& stats,
                                  const at::Tensor& gamma, const at::Tensor& beta,
                                  const at::Tensor& grad_residual) {
  return norm == Normalization::kRMSNorm
             ? rms_norm_backward(grad_out, x, stats, gamma, grad_residual)
             : layer_norm_backward(grad_out, x, stats, gamma, beta, grad_residual);
}

// The gradient of a function's residual-branch output (WithResidualBranch) as the LayerNorm
// backward's grad_residual [rows, hidden]; undefined when the function has no such output.
at::Tensor residual_branch_grad(const torch::autograd::tensor_list& grad_outputs,
                                bool residual_branch, int64_t hidden) {
  if (!residual_branch || !grad_outputs.back().defined()) return {};
  return grad_outputs.back().reshape({-1, hidden});
}

// The normalization travels to the backward pass in the context's saved data.
void save_normalization(torch::autograd::AutogradContext* ctx, Normalization norm) {
  ctx->saved_data["normalization"] = static_cast<int64_t>(norm);
}

Normalization saved_normalization(torch::autograd::AutogradContext* ctx) {
  return static_cast<Normalization>(ctx->saved_data.at("normalization").toInt());
}

// gate_up ↦ swiglu(gate_up), one kernel each way; only gate_up is kept for the backward pass.
struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate_up) {
    ctx->save_for_backward({gate_up});
    return swiglu(gate_up);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    if (!grads[0].defined()) return {torch::Tensor()};
    return {swiglu_backward(grads[0].contiguous(), ctx->get_saved_variables()[0])};
  }
};

// The MLP's activation on FC1's output, as the unfused path computes it (with autograd).
torch::Tensor mlp_activation(MlpActivation activation, const torch::Tensor& fc1_out) {
  if (activation == MlpActivation::kSwiGlu) return SwiGluFunction::apply(fc1_out.contiguous());
  return at::gelu(fc1_out, "tanh");
}

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  // weight/bias: [hidden] or empty (no affine; no bias). Returns [rows, hidden], and with
  // residual_branch x2d itself (autograd makes it a view whose gradient comes back here).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const torch::Tensor& x2d,
                                                const torch::Tensor& weight,
                                                const torch::Tensor& bias, double eps,
                                                Normalization norm, bool residual_branch) {
    const auto gamma = defined_or_null(weight), beta = defined_or_null(bias);
    auto result = normalize(norm, x2d, gamma, beta, eps);
    ctx->save_for_backward({x2d, result.stats.mean, result.stats.rstd, weight, bias});
    save_normalization(ctx, norm);
    ctx->saved_data["residual_branch"] = residual_branch;
    if (residual_branch) return {result.out, x2d};
    return {result.out};
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto gamma = defined_or_null(saved[3]), beta = defined_or_null(saved[4]);
    const auto grad_residual = residual_branch_grad(
        grad_outputs, ctx->saved_data.at("residual_branch").toBool(), saved[0].size(1));
    auto grads = normalize_backward(saved_normalization(ctx), grad_outputs[0], saved[0],
                                    {saved[1], saved[2]}, gamma, beta, grad_residual);
    if (!ctx->needs_input_grad(1)) grads.grad_gamma = at::Tensor();
    if (!ctx->needs_input_grad(2)) grads.grad_beta = at::Tensor();
    return {grads.grad_input, grads.grad_gamma, grads.grad_beta, torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// The LayerNorm of x2d [rows, hidden] as the FP8 GEMM input of `meta`'s layer, padded with zero
// rows to the GEMM's multiple of 16: under delayed scaling written straight into FP8 by the
// LayerNorm kernel (with the layer's input scale, its amax max-merged into the layer's slot);
// under current scaling normalized first, then measured and quantized, which also gives the
// transpose (x_t) the weight gradient needs.
struct LayerNormFp8 {
  Fp8Tensor x_q;
  at::Tensor x_t;  ///< current scaling only
  LayerNormStats stats;
};

LayerNormFp8 layer_norm_fp8_for(Fp8Meta& meta, const Fp8Recipe& recipe, const at::Tensor& x2d,
                                const at::Tensor& ln_weight, const at::Tensor& ln_bias,
                                double eps, Normalization norm) {
  const int64_t rows = x2d.size(0), hidden = x2d.size(1);
  const int64_t rows_padded = detail::padded_rows(rows);
  const auto format = recipe.forward_format;
  if (recipe.delayed()) {
    const auto fp8_options = x2d.options().dtype(fp8_dtype(format));
    auto buffer = rows_padded == rows ? at::empty({rows, hidden}, fp8_options)
                                      : at::zeros({rows_padded, hidden}, fp8_options);
    const auto& scale = meta.scale(Fp8Slot::kInput);
    const auto& amax = meta.amax(Fp8Slot::kInput);
    auto out = buffer.narrow(0, 0, rows);
    auto ln = norm == Normalization::kRMSNorm
                  ? rms_norm_fp8(x2d, ln_weight, eps, scale, format, amax,
                                 /*accumulate_amax=*/true, out)
                  : layer_norm_fp8(x2d, ln_weight, ln_bias, eps, scale, format, amax,
                                   /*accumulate_amax=*/true, out);
    return {Fp8Tensor(buffer, ln.out.scale_inv, format), at::Tensor(), ln.stats};
  }
  auto ln = normalize(norm, x2d, ln_weight, ln_bias, eps);
  auto q = detail::quantize_for(detail::pad_rows(ln.out, rows_padded), recipe, meta,
                                Fp8Slot::kInput);
  return {q.data, q.transposed.data, ln.stats};
}

// What the LayerNorm's backward needs, and the FP8 LayerNorm output the first GEMM read (its
// transpose is the weight gradient's operand).
struct LayerNormSaved {
  at::Tensor x2d, mean, rstd, weight, bias;
  at::Tensor out_fp8, out_scale_inv;
  at::Tensor out_fp8_t;  ///< current scaling only (else undefined)

  LayerNormSaved() = default;
  LayerNormSaved(const at::Tensor& x2d, const LayerNormFp8& ln, const at::Tensor& weight,
                 const at::Tensor& bias)
      : x2d(x2d),
        mean(ln.stats.mean),
        rstd(ln.stats.rstd),
        weight(weight),
        bias(bias),
        out_fp8(ln.x_q.data),
        out_scale_inv(ln.x_q.scale_inv),
        out_fp8_t(ln.x_t) {}

  // The FP8 transpose of the output for the weight gradient: the one current scaling made,
  // else a byte transpose of the FP8 output the forward GEMM read.
  Fp8Tensor output_transpose(Fp8Format format) const {
    return out_fp8_t.defined() ? Fp8Tensor(out_fp8_t, out_scale_inv, format)
                               : fp8_transpose(Fp8Tensor(out_fp8, out_scale_inv, format));
  }

  // The LayerNorm's gradients from its output's (the first GEMM's dgrad) and a residual
  // branch's (or undefined), as the function's first three inputs ask for them.
  std::array<torch::Tensor, 3> grads(torch::autograd::AutogradContext* ctx,
                                     const detail::Fp8LinearSaved& saved,
                                     const at::Tensor& grad_out2d,
                                     const at::Tensor& grad_residual2d) const {
    auto ln = normalize_backward(saved_normalization(ctx), grad_out2d, x2d, {mean, rstd},
                                 defined_or_null(weight), defined_or_null(bias), grad_residual2d);
    return {ctx->needs_input_grad(0) ? saved.unflatten(ln.grad_input) : torch::Tensor(),
            ctx->needs_input_grad(1) ? ln.grad_gamma : torch::Tensor(),
            ctx->needs_input_grad(2) ? ln.grad_beta : torch::Tensor()};
  }
};

bool needs_layer_norm_grads(torch::autograd::AutogradContext* ctx) {
  return ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
}

// LayerNorm → FP8 → GEMM in one function (see Fp8LayerNormLinearImpl).
struct LayerNormLinearFunction : public torch::autograd::Function<LayerNormLinearFunction> {
  struct SavedTensors : LayerNormSaved {
    at::Tensor weight_fp8, weight_scale_inv;  ///< the dgrad operand (Fp8DgradWeight)
    static constexpr auto fields() {
      using S = SavedTensors;
      return std::array<at::Tensor S::*, 10>{&S::x2d,     &S::mean,          &S::rstd,
                                             &S::weight,  &S::bias,          &S::out_fp8,
                                             &S::out_scale_inv, &S::out_fp8_t, &S::weight_fp8,
                                             &S::weight_scale_inv};
    }
  };

  // The output, or with split_sizes its column pieces (views of it), whose gradients the
  // backward quantizes without concatenating them; then, with residual_branch, the input
  // itself (WithResidualBranch).
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
      const torch::Tensor& ln_weight, const torch::Tensor& ln_bias, const torch::Tensor& weight,
      const torch::Tensor& bias, const torch::Tensor& grad_anchor, bool has_bias,
      const Fp8LinearImpl::Fp8Call& call, double eps, Normalization norm,
      const std::vector<int64_t>& split_sizes, bool residual_branch) {
    const int64_t hidden = ln_weight.size(0);
    const auto x2d = input.reshape({-1, hidden}).contiguous();
    const int64_t rows = x2d.size(0);
    auto ln = layer_norm_fp8_for(*call.meta, call.recipe, x2d, ln_weight, defined_or_null(ln_bias),
                                 eps, norm);
    save_normalization(ctx, norm);
    Fp8GemmOptions gemm;
    gemm.use_fast_accum = true;
    if (has_bias) gemm.bias = bias;
    auto y = fp8_gemm(ln.x_q, call.weight_q.data, call.out_dtype, gemm);
    if (y.size(0) != rows) y = y.narrow(0, 0, rows);

    SavedTensors tensors;
    static_cast<LayerNormSaved&>(tensors) = LayerNormSaved(x2d, ln, ln_weight, ln_bias);
    const auto w = detail::dgrad_weight_of(call.weight_q);
    tensors.weight_fp8 = w.weight.data;
    tensors.weight_scale_inv = w.weight.scale_inv;
    detail::save_tensors(ctx, tensors);
    const auto saved = detail::Fp8LinearSaved::of(call, rows, has_bias, x2d, weight, bias,
                                                  input.sizes().vec());
    saved.save(ctx);
    ctx->saved_data["residual_branch"] = residual_branch;
    y = saved.unflatten(y);
    auto outputs = split_sizes.empty() ? torch::autograd::variable_list{y}
                                       : y.split_with_sizes(split_sizes, -1);
    if (residual_branch) outputs.push_back(input);
    return outputs;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = detail::Fp8LinearSaved::load(ctx);
    const auto tensors = detail::load_tensors<SavedTensors>(ctx);
    const bool need_ln = needs_layer_norm_grads(ctx);
    const bool need_weight = ctx->needs_input_grad(3) || saved.meta->fp8_params();
    Fp8Tensor x_t;
    if (need_weight) x_t = tensors.output_transpose(saved.recipe.forward_format);
    // One gradient per output: [..., out_features], or one per piece (autograd materializes
    // the gradient of a piece nobody used as zeros); the residual branch's last.
    const bool residual_branch = ctx->saved_data.at("residual_branch").toBool();
    const auto grad_residual =
        residual_branch_grad(grad_outputs, residual_branch, tensors.x2d.size(1));
    std::vector<at::Tensor> columns;
    columns.reserve(grad_outputs.size());
    for (size_t i = 0; i + (residual_branch ? 1 : 0) < grad_outputs.size(); ++i) {
      columns.push_back(grad_outputs[i].reshape({-1, grad_outputs[i].size(-1)}));
    }
    auto grads = detail::fp8_linear_backward(
        saved, columns, std::move(x_t),
        saved.dgrad_weight(tensors.weight_fp8, tensors.weight_scale_inv), need_ln,
        ctx->needs_input_grad(3), ctx->needs_input_grad(4));
    std::array<torch::Tensor, 3> ln;
    if (need_ln) ln = tensors.grads(ctx, saved, grads.input, grad_residual);
    return {ln[0],           ln[1],           ln[2],           grads.weight,
            grads.bias,      torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// LayerNorm → FP8 → FC1 → GELU or SwiGLU fused into FC2's input cast → FC2, in one function
// (see Fp8LayerNormMLPImpl). Backward: FC2's GEMMs, then GELU's or SwiGLU's backward fused into
// the cast of FC1's output gradient (GELU's with FC1's bias gradient), FC1's GEMMs, the
// LayerNorm's backward. With residual_is_input (`residual` a view of `input`: h + mlp(h)) the
// output gradient, the residual's, is added by the LayerNorm's backward into the input's.
// Where FC2's GEMM cannot add `input` as the residual, residual_branch returns `input` itself as
// a second output (WithResidualBranch) for the caller's add, whose gradient the LayerNorm's
// backward adds the same way.
struct LayerNormMLPFunction : public torch::autograd::Function<LayerNormMLPFunction> {
  struct SavedTensors : LayerNormSaved {
    at::Tensor fc1_out;  ///< FC1's output (the activation's input), padded rows zeroed
    at::Tensor fc1_weight_fp8, fc1_weight_scale_inv, fc2_weight_fp8, fc2_weight_scale_inv;
    static constexpr auto fields() {
      using S = SavedTensors;
      return std::array<at::Tensor S::*, 13>{
          &S::x2d,        &S::mean,           &S::rstd,
          &S::weight,     &S::bias,           &S::out_fp8,
          &S::out_scale_inv, &S::out_fp8_t,   &S::fc1_out,
          &S::fc1_weight_fp8, &S::fc1_weight_scale_inv, &S::fc2_weight_fp8,
          &S::fc2_weight_scale_inv};
    }
  };

  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
      const torch::Tensor& ln_weight, const torch::Tensor& ln_bias,
      const torch::Tensor& fc1_weight, const torch::Tensor& fc1_bias,
      const torch::Tensor& fc2_weight, const torch::Tensor& fc2_bias,
      const torch::Tensor& fc1_anchor, const torch::Tensor& fc2_anchor,
      const torch::Tensor& residual, bool fc1_has_bias, bool fc2_has_bias, bool has_residual,
      bool residual_is_input, bool residual_branch, const Fp8LinearImpl::Fp8Call& fc1_call,
                               const Fp8LinearImpl::Fp8Call& fc2_call, double eps,
                               Normalization norm, MlpActivation activation) {
    const int64_t hidden = ln_weight.size(0);
    const auto x2d = input.reshape({-1, hidden}).contiguous();
    const int64_t rows = x2d.size(0), rows_padded = detail::padded_rows(rows);
    const auto& recipe = fc1_call.recipe;
    auto ln = layer_norm_fp8_for(*fc1_call.meta, recipe, x2d, ln_weight, defined_or_null(ln_bias),
                                 eps, norm);
    save_normalization(ctx, norm);
    ctx->saved_data["activation"] = static_cast<int64_t>(activation);
    ctx->saved_data["residual_is_input"] = has_residual && residual_is_input;
    TORCH_INTERNAL_ASSERT(!(residual_branch && has_residual),
                          "LayerNormMLPFunction: the residual added by the GEMM or returned, not both");
    ctx->saved_data["residual_branch"] = residual_branch;
    const bool swiglu = activation == MlpActivation::kSwiGlu;

    Fp8GemmOptions gemm1;
    gemm1.use_fast_accum = true;
    if (fc1_has_bias) gemm1.bias = fc1_bias;
    auto fc1_out = fp8_gemm(ln.x_q, fc1_call.weight_q.data, fc1_call.out_dtype, gemm1);
    // The padding rows read FC1's bias; zeroed, they stay zero through the activation
    // (gelu(0) = swiglu(0, 0) = 0) and add nothing to FC2's input amax.
    if (rows_padded != rows) fc1_out.narrow(0, rows, rows_padded - rows).zero_();
    // GELU inside the cast. SwiGLU by its own kernel, then the plain cast: on an H200 that pair
    // measured faster than cast_transpose_swiglu with 128-column tiles (llama3_8b_4layer FP8
    // 124.1k against 122.2k tokens/s, bench/results/llama_swiglu_cast/); the 64-column variant
    // is 1.03x the pair at 8192-16384 rows and 0.99x at 4096 (llama_dswiglu_cast/): too little
    // to show in a step.
    auto h_q = swiglu
                   ? detail::quantize_for(amp8::swiglu(fc1_out), fc2_call.recipe,
                                          *fc2_call.meta, Fp8Slot::kInput)
                   : detail::quantize_for(fc1_out, fc2_call.recipe, *fc2_call.meta,
                                          Fp8Slot::kInput, {}, {detail::QuantizeActivation::kGelu});
    Fp8GemmOptions gemm2;
    gemm2.use_fast_accum = true;
    if (fc2_has_bias) gemm2.bias = fc2_bias;
    if (has_residual) gemm2.residual = residual;  // detail::gemm_residual's
    auto y = fp8_gemm(h_q.data, fc2_call.weight_q.data, fc2_call.out_dtype, gemm2);
    if (rows_padded != rows) y = y.narrow(0, 0, rows);

    SavedTensors tensors;
    static_cast<LayerNormSaved&>(tensors) = LayerNormSaved(x2d, ln, ln_weight, ln_bias);
    tensors.fc1_out = fc1_out;
    const auto w1 = detail::dgrad_weight_of(fc1_call.weight_q);
    const auto w2 = detail::dgrad_weight_of(fc2_call.weight_q);
    tensors.fc1_weight_fp8 = w1.weight.data;
    tensors.fc1_weight_scale_inv = w1.weight.scale_inv;
    tensors.fc2_weight_fp8 = w2.weight.data;
    tensors.fc2_weight_scale_inv = w2.weight.scale_inv;
    detail::save_tensors(ctx, tensors);
    detail::save_input_transpose(ctx, h_q.transposed, "fc2.x_t");
    const auto fc1_saved = detail::Fp8LinearSaved::of(fc1_call, rows, fc1_has_bias, x2d,
                                                      fc1_weight, fc1_bias, input.sizes().vec());
    const auto fc2_saved = detail::Fp8LinearSaved::of(fc2_call, rows, fc2_has_bias, fc1_out,
                                                      fc2_weight, fc2_bias,
                                                      {rows, fc2_weight.size(1)});
    fc1_saved.save(ctx, "fc1");
    fc2_saved.save(ctx, "fc2");
    if (residual_branch) return {fc1_saved.unflatten(y), input};
    return {fc1_saved.unflatten(y)};
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto fc1_saved = detail::Fp8LinearSaved::load(ctx, "fc1");
    const auto fc2_saved = detail::Fp8LinearSaved::load(ctx, "fc2");
    const auto tensors = detail::load_tensors<SavedTensors>(ctx);
    const auto format = fc1_saved.recipe.forward_format;
    // FC2: its gradients, and dgrad into the activation's output gradient.
    const auto& grad_output = grad_outputs[0];
    auto fc2_grads = detail::fp8_linear_backward(
        fc2_saved, grad_output.reshape({-1, grad_output.size(-1)}),
        detail::take_input_transpose(ctx, format, "fc2.x_t"),
        fc2_saved.dgrad_weight(tensors.fc2_weight_fp8, tensors.fc2_weight_scale_inv),
        /*need_input=*/true, ctx->needs_input_grad(5), ctx->needs_input_grad(6));
    // FC1, whose output gradient is GELU's or SwiGLU's backward, computed inside its cast.
    const bool need_ln = needs_layer_norm_grads(ctx);
    const bool need_fc1_weight = ctx->needs_input_grad(3) || fc1_saved.meta->fp8_params();
    Fp8Tensor x_t;
    if (need_fc1_weight) x_t = tensors.output_transpose(format);
    const bool swiglu =
        static_cast<MlpActivation>(ctx->saved_data.at("activation").toInt()) == MlpActivation::kSwiGlu;
    const detail::QuantizeActivation activation_backward = {
        swiglu ? detail::QuantizeActivation::kDSwiGlu : detail::QuantizeActivation::kDGelu,
        tensors.fc1_out};
    auto fc1_grads = detail::fp8_linear_backward(
        fc1_saved, fc2_grads.input, std::move(x_t),
        fc1_saved.dgrad_weight(tensors.fc1_weight_fp8, tensors.fc1_weight_scale_inv), need_ln,
        ctx->needs_input_grad(3), ctx->needs_input_grad(4), activation_backward);
    fc2_grads.input = at::Tensor();
    // A residual's gradient is the output's, as [rows, hidden]: the input's too when the
    // residual is the input; the residual branch's (the caller's add) when it was returned.
    const auto output_grad2d = grad_output.reshape({-1, grad_output.size(-1)});
    const bool residual_is_input = ctx->saved_data.at("residual_is_input").toBool();
    const auto grad_residual =
        residual_is_input ? output_grad2d
                          : residual_branch_grad(grad_outputs,
                                                 ctx->saved_data.at("residual_branch").toBool(),
                                                 tensors.x2d.size(1));
    std::array<torch::Tensor, 3> ln;
    if (need_ln) ln = tensors.grads(ctx, fc1_saved, fc1_grads.input, grad_residual);
    const auto residual_grad =
        ctx->needs_input_grad(9) && !residual_is_input ? output_grad2d : torch::Tensor();
    return {ln[0],           ln[1],           ln[2],           fc1_grads.weight,
            fc1_grads.bias,  fc2_grads.weight, fc2_grads.bias,  torch::Tensor(),
            torch::Tensor(), residual_grad,
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// Under the blockwise recipe, FC1 → GELU → FC2 of a GELU MLP whose LayerNorm ran as a module of
// its own: GELU inside the 1×128 quantization of FC2's input (quantize_blockwise_gelu) and its
// backward inside that of FC1's output gradient (quantize_blockwise_dgelu, with FC1's bias
// gradient), so neither the activation nor its gradient is written in high precision. Each is
// rounded to the GEMM output's dtype before it is quantized, as the modules in sequence round
// LibTorch's GELU: the two differ only where the two tanh computations round apart.
struct BlockwiseGeluMLPFunction : public torch::autograd::Function<BlockwiseGeluMLPFunction> {
  struct SavedTensors {
    at::Tensor fc1_out;  ///< GELU's input [rows, ffn]
    /// Each layer's dgrad operand in 128×128 blocks (Wᵀ, or W under fp8_params).
    at::Tensor fc1_weight_blocks, fc1_weight_scale_inv, fc2_weight_blocks, fc2_weight_scale_inv;
    static constexpr auto fields() {
      using S = SavedTensors;
      return std::array{&S::fc1_out, &S::fc1_weight_blocks, &S::fc1_weight_scale_inv,
                        &S::fc2_weight_blocks, &S::fc2_weight_scale_inv};
    }
  };

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& fc1_weight, const torch::Tensor& fc1_bias,
                               const torch::Tensor& fc2_weight, const torch::Tensor& fc2_bias,
                               const torch::Tensor& fc1_anchor, const torch::Tensor& fc2_anchor,
                               const torch::Tensor& residual, bool fc1_has_bias,
                               bool fc2_has_bias, bool has_residual,
                               const Fp8LinearImpl::Fp8Call& fc1_call,
                               const Fp8LinearImpl::Fp8Call& fc2_call) {
    const auto x2d = input.reshape({-1, fc1_weight.size(1)});
    const int64_t rows = x2d.size(0), rows_padded = detail::padded_rows(rows);
    const auto fc1_saved = detail::Fp8LinearSaved::of(fc1_call, rows, fc1_has_bias, input,
                                                      fc1_weight, fc1_bias, input.sizes().vec());
    auto fc1_out = detail::fp8_linear_forward_blockwise(
        ctx, fc1_saved, detail::pad_rows(x2d, rows_padded), fc1_call.weight_blocks,
        fc1_has_bias ? fc1_bias : at::Tensor(), fc1_call.out_dtype, "fc1.x_t");
    const auto fc2_saved =
        detail::Fp8LinearSaved::of(fc2_call, rows, fc2_has_bias, fc1_out, fc2_weight, fc2_bias,
                                   {rows, fc2_weight.size(1)});
    // Padding rows of zeros (where rows is not a multiple of 16) stay zero: gelu(0) = 0.
    auto y = detail::fp8_linear_forward_blockwise(
        ctx, fc2_saved, detail::pad_rows(fc1_out, rows_padded), fc2_call.weight_blocks,
        fc2_has_bias ? fc2_bias : at::Tensor(), fc2_call.out_dtype, "fc2.x_t",
        detail::QuantizeActivation::kGelu, has_residual ? residual : at::Tensor());
    const auto& w1 = detail::dgrad_weight_blocks_of(fc1_call.weight_blocks, fc1_saved);
    const auto& w2 = detail::dgrad_weight_blocks_of(fc2_call.weight_blocks, fc2_saved);
    detail::save_tensors(ctx, SavedTensors{fc1_out, w1.data, w1.scale_inv, w2.data, w2.scale_inv});
    fc1_saved.save(ctx, "fc1");
    fc2_saved.save(ctx, "fc2");
    return fc1_saved.unflatten(y);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto fc1_saved = detail::Fp8LinearSaved::load(ctx, "fc1");
    const auto fc2_saved = detail::Fp8LinearSaved::load(ctx, "fc2");
    const auto tensors = detail::load_tensors<SavedTensors>(ctx);
    const auto format = fc1_saved.recipe.forward_format;
    const auto blocks = [&](const at::Tensor& data, const at::Tensor& scale_inv) {
      return Fp8BlockwiseTensor{data, scale_inv, format, Fp8BlockShape::k128x128};
    };
    const auto& grad_output = grad_outputs[0];
    // FC2: its gradients, and dgrad into GELU's output gradient.
    auto fc2_grads = detail::fp8_linear_backward_blockwise(
        fc2_saved, grad_output.reshape({-1, grad_output.size(-1)}),
        detail::take_input_transpose_blockwise(ctx, format, "fc2.x_t"),
        blocks(tensors.fc2_weight_blocks, tensors.fc2_weight_scale_inv),
        fc2_saved.dgrad_weight_transposed, /*need_input=*/true, ctx->needs_input_grad(3),
        ctx->needs_input_grad(4));
    // FC1, whose output gradient is GELU's backward, computed inside its quantization.
    auto fc1_grads = detail::fp8_linear_backward_blockwise(
        fc1_saved, fc2_grads.input, detail::take_input_transpose_blockwise(ctx, format, "fc1.x_t"),
        blocks(tensors.fc1_weight_blocks, tensors.fc1_weight_scale_inv),
        fc1_saved.dgrad_weight_transposed, ctx->needs_input_grad(0), ctx->needs_input_grad(1),
        ctx->needs_input_grad(2), {detail::QuantizeActivation::kDGelu, tensors.fc1_out});
    fc2_grads.input = at::Tensor();
    if (fc1_grads.input.defined()) fc1_grads.input = fc1_saved.unflatten(fc1_grads.input);
    // A residual's gradient is the output's, as [rows, hidden].
    return {fc1_grads.input, fc1_grads.weight, fc1_grads.bias,  fc2_grads.weight,
            fc2_grads.bias,  torch::Tensor(),  torch::Tensor(),
            ctx->needs_input_grad(7) ? grad_output.reshape({-1, grad_output.size(-1)})
                                     : torch::Tensor(),
            torch::Tensor(), torch::Tensor(),  torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
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

bool Fp8LayerNormImpl::has_bias() const {
  return options.elementwise_affine() &&
         options.bias().value_or(options.normalization() == Normalization::kLayerNorm);
}

void Fp8LayerNormImpl::reset() {
  TORCH_CHECK(!options.normalized_shape().empty(),
              "Fp8LayerNorm: normalized_shape must name at least one dimension");
  for (auto d : options.normalized_shape()) {
    TORCH_CHECK(d > 0, "Fp8LayerNorm: normalized_shape must be positive, got ",
                options.normalized_shape());
  }
  TORCH_CHECK(options.eps() > 0, "Fp8LayerNorm: eps must be positive, got ", options.eps());
  TORCH_CHECK(options.normalization() == Normalization::kLayerNorm || !options.bias().value_or(false),
              "Fp8LayerNorm: bias must be false (or unset) with normalization RMSNorm, which "
              "has no shift");
  if (options.elementwise_affine()) {
    weight = register_parameter("weight", torch::empty(options.normalized_shape()));
    bias = has_bias() ? register_parameter("bias", torch::empty(options.normalized_shape()))
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
         << (options.normalization() == Normalization::kRMSNorm ? ", normalization=RMSNorm" : "")
         << ", eps=" << options.eps() << ", elementwise_affine=" << options.elementwise_affine()
         << ", bias=" << has_bias() << ")";
}

torch::Tensor Fp8LayerNormImpl::forward(const torch::Tensor& input) {
  return normalize_input(input, /*residual_branch=*/false).outputs.front();
}

WithResidualBranch Fp8LayerNormImpl::forward_with_residual_branch(const torch::Tensor& input) {
  return normalize_input(input, /*residual_branch=*/true);
}

WithResidualBranch Fp8LayerNormImpl::normalize_input(const torch::Tensor& input,
                                                     bool residual_branch) {
  ++forward_calls_;
  const auto& shape = options.normalized_shape();
  const auto n = static_cast<int64_t>(shape.size());
  TORCH_CHECK(input.dim() >= n && input.sizes().slice(input.dim() - n).equals(shape),
              "Fp8LayerNorm: input must end with normalized_shape ", at::IntArrayRef(shape),
              ", got shape ", input.sizes());
  if (input.numel() == 0) {
    return {{at::empty_like(input)}, residual_branch ? input : at::Tensor()};
  }
  const int64_t hidden = hidden_size();
  const auto placeholder = input.options().dtype(at::kFloat);
  auto y = LayerNormFunction::apply(
      input.reshape({-1, hidden}).contiguous(),
      or_empty(weight.defined() ? weight.reshape({hidden}) : weight, placeholder),
      or_empty(bias.defined() ? bias.reshape({hidden}) : bias, placeholder), options.eps(),
      options.normalization(), residual_branch);
  return {{y[0].reshape(input.sizes())},
          residual_branch ? y[1].reshape(input.sizes()) : at::Tensor()};
}

// ---- Fp8LayerNormLinear ----

Fp8LayerNormLinearImpl::Fp8LayerNormLinearImpl(const Fp8LayerNormLinearOptions& options_)
    : options(options_) {
  if (Fp8ModelInit::is_enabled()) options.fp8_params(true);
  reset();
}

void Fp8LayerNormLinearImpl::reset() {
  layer_norm = register_module(
      "layer_norm", Fp8LayerNorm(Fp8LayerNormOptions({options.in_features()})
                                     .normalization(options.normalization())
                                     .eps(options.eps())));
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
         << ", out_features=" << options.out_features()
         << (options.normalization() == Normalization::kRMSNorm ? ", normalization=RMSNorm" : "")
         << ", eps=" << options.eps()
         << ", bias=" << options.bias() << (options.fp8_params() ? ", fp8_params=true" : "") << ")";
}

torch::Tensor Fp8LayerNormLinearImpl::forward(const torch::Tensor& input) {
  return forward_pieces(input, {}, /*residual_branch=*/false).outputs.front();
}

std::vector<torch::Tensor> Fp8LayerNormLinearImpl::forward_split(const torch::Tensor& input,
                                                                 at::IntArrayRef split_sizes) {
  detail::check_split_sizes(split_sizes, options.out_features(),
                            "Fp8LayerNormLinear::forward_split");
  return forward_pieces(input, split_sizes, /*residual_branch=*/false).outputs;
}

WithResidualBranch Fp8LayerNormLinearImpl::forward_split_with_residual_branch(
    const torch::Tensor& input, at::IntArrayRef split_sizes) {
  if (!split_sizes.empty()) {
    detail::check_split_sizes(split_sizes, options.out_features(),
                              "Fp8LayerNormLinear::forward_split_with_residual_branch");
  }
  return forward_pieces(input, split_sizes, /*residual_branch=*/true);
}

WithResidualBranch Fp8LayerNormLinearImpl::forward_pieces(const torch::Tensor& input,
                                                          at::IntArrayRef split_sizes,
                                                          bool residual_branch) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features(),
              "Fp8LayerNormLinear: input must have in_features=", options.in_features(),
              " as its last dimension, got shape ", input.sizes());
  auto& lin = *linear;
  // Unfused: the two modules in sequence, the Linear's output pieces (gradients quantized
  // without a concatenation) as its forward_split makes them.
  auto unfused = [&] {
    auto normalized = residual_branch ? layer_norm->forward_with_residual_branch(input)
                                      : WithResidualBranch{{layer_norm->forward(input)}, {}};
    const auto& x = normalized.outputs.front();
    return WithResidualBranch{split_sizes.empty() ? std::vector<torch::Tensor>{lin.forward(x)}
                                                  : lin.forward_split(x, split_sizes),
                              normalized.residual};
  };
  if (in_blockwise_region()) return unfused();
  auto call = lin.prepare_fp8_call(input, input.numel() / options.in_features());
  if (!call) return unfused();
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 ||
                  input.scalar_type() == at::kHalf,
              "Fp8LayerNormLinear: input must be float32, bfloat16 or float16, got ",
              input.scalar_type());
  const auto& anchor = lin.grad_anchor();
  const auto& ln_bias = layer_norm->bias;
  auto outputs = LayerNormLinearFunction::apply(
      input, layer_norm->weight, ln_bias.defined() ? ln_bias : anchor.detach().new_empty({0}),
      lin.weight, lin.bias.defined() ? lin.bias : anchor.detach(), anchor, lin.options.bias(),
      *call, options.eps(), options.normalization(), split_sizes.vec(), residual_branch);
  if (!residual_branch) return {std::move(outputs), {}};
  auto residual = outputs.back();
  outputs.pop_back();
  return {std::move(outputs), std::move(residual)};
}

}  // namespace amp8

// ---- Fp8LayerNormMLP ----

namespace amp8 {

Fp8LayerNormMLPImpl::Fp8LayerNormMLPImpl(const Fp8LayerNormMLPOptions& options_)
    : options(options_) {
  if (Fp8ModelInit::is_enabled()) options.fp8_params(true);
  reset();
}

void Fp8LayerNormMLPImpl::reset() {
  TORCH_CHECK(options.hidden_size() > 0 && options.ffn_hidden_size() > 0,
              "Fp8LayerNormMLP: hidden_size and ffn_hidden_size must be positive, got ",
              options.hidden_size(), " and ", options.ffn_hidden_size());
  const int64_t fc1_width = options.activation() == MlpActivation::kSwiGlu
                                ? 2 * options.ffn_hidden_size()
                                : options.ffn_hidden_size();
  ln_fc1 = register_module(
      "ln_fc1", Fp8LayerNormLinear(
                    Fp8LayerNormLinearOptions(options.hidden_size(), fc1_width)
                        .normalization(options.normalization())
                        .eps(options.eps())
                        .bias(options.bias())
                        .fp8_amax_history_len(options.fp8_amax_history_len())
                        .fp8_min_gemm_size(options.fp8_min_gemm_size())
                        .cache_fp8_weight(options.cache_fp8_weight())
                        .fp8_params(options.fp8_params())));
  fc2 = register_module(
      "fc2", Fp8Linear(Fp8LinearOptions(options.ffn_hidden_size(), options.hidden_size())
                           .bias(options.bias())
                           .fp8_amax_history_len(options.fp8_amax_history_len())
                           .fp8_min_gemm_size(options.fp8_min_gemm_size())
                           .cache_fp8_weight(options.cache_fp8_weight())
                           .fp8_params(options.fp8_params())));
}

void Fp8LayerNormMLPImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "amp8::Fp8LayerNormMLP(hidden_size=" << options.hidden_size()
         << ", ffn_hidden_size=" << options.ffn_hidden_size()
         << (options.normalization() == Normalization::kRMSNorm ? ", normalization=RMSNorm" : "")
         << (options.activation() == MlpActivation::kSwiGlu ? ", activation=swiglu" : "")
         << ", eps=" << options.eps()
         << ", bias=" << options.bias() << (options.fp8_params() ? ", fp8_params=true" : "")
         << (options.fused() ? "" : ", fused=false") << ")";
}

torch::Tensor Fp8LayerNormMLPImpl::forward(const torch::Tensor& input) {
  return forward_adding(input, {});
}

torch::Tensor Fp8LayerNormMLPImpl::forward_with_residual(const torch::Tensor& input,
                                                         const torch::Tensor& residual) {
  TORCH_CHECK(residual.defined() && residual.sizes() == input.sizes(),
              "Fp8LayerNormMLP::forward_with_residual: residual must have the output's shape, "
              "the input's ", input.sizes(), ", got ", residual.defined() ? residual.sizes() : at::IntArrayRef{});
  return forward_adding(input, residual);
}

torch::Tensor Fp8LayerNormMLPImpl::forward_adding(const torch::Tensor& input,
                                                  const torch::Tensor& residual) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.hidden_size(),
              "Fp8LayerNormMLP: input must have hidden_size=", options.hidden_size(),
              " as its last dimension, got shape ", input.sizes());
  auto& fc1 = *ln_fc1->linear;
  auto& out = *fc2;
  const int64_t rows = input.numel() / options.hidden_size();
  const bool swiglu = options.activation() == MlpActivation::kSwiGlu;
  // h + mlp(h): the residual's gradient added by the LayerNorm's backward (WithResidualBranch).
  const bool residual_is_input = residual.defined() && residual.is_same(input);
  if (!options.fused() || (in_blockwise_region() && swiglu) || !fc1.runs_in_fp8(rows) ||
      !out.runs_in_fp8(rows)) {
    // Not fused, or one of the two GEMMs stays in high precision: the modules one after the
    // other, each deciding for itself.
    const auto fc1_out = residual_is_input
                             ? ln_fc1->forward_split_with_residual_branch(input, {})
                             : WithResidualBranch{{ln_fc1->forward(input)}, residual};
    const auto hidden = mlp_activation(options.activation(), fc1_out.outputs.front());
    return residual.defined() ? out.forward_with_residual(hidden, fc1_out.residual)
                              : out.forward(hidden);
  }
  if (in_blockwise_region()) {
    const auto normalized =
        residual_is_input ? ln_fc1->layer_norm->forward_with_residual_branch(input)
                          : WithResidualBranch{{ln_fc1->layer_norm->forward(input)}, residual};
    const auto& fc1_in = normalized.outputs.front();
    auto fc1_call = fc1.prepare_fp8_call(fc1_in, rows);
    auto fc2_call = out.prepare_fp8_call(fc1_in, rows);
    TORCH_INTERNAL_ASSERT(fc1_call && fc2_call,
                          "Fp8LayerNormMLP: runs_in_fp8 and prepare_fp8_call disagree");
    const auto& fc1_anchor = fc1.grad_anchor();
    const auto& fc2_anchor = out.grad_anchor();
    const auto& residual_in = normalized.residual;  // the branch of the input, or `residual`
    const auto gemm_residual = detail::gemm_residual(residual_in, rows, fc2_call->out_dtype);
    auto y = BlockwiseGeluMLPFunction::apply(
        fc1_in, fc1.weight, fc1.bias.defined() ? fc1.bias : fc1_anchor.detach(), out.weight,
        out.bias.defined() ? out.bias : fc2_anchor.detach(), fc1_anchor, fc2_anchor,
        gemm_residual.defined() ? gemm_residual : fc2_anchor.detach(), fc1.options.bias(),
        out.options.bias(), gemm_residual.defined(), *fc1_call, *fc2_call);
    return residual_in.defined() && !gemm_residual.defined() ? residual_in + y : y;
  }
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 ||
                  input.scalar_type() == at::kHalf,
              "Fp8LayerNormMLP: input must be float32, bfloat16 or float16, got ",
              input.scalar_type());
  auto fc1_call = fc1.prepare_fp8_call(input, rows);
  auto fc2_call = out.prepare_fp8_call(input, rows);
  TORCH_INTERNAL_ASSERT(fc1_call && fc2_call,
                        "Fp8LayerNormMLP: runs_in_fp8 and prepare_fp8_call disagree");
  const auto& fc1_anchor = fc1.grad_anchor();
  const auto& fc2_anchor = out.grad_anchor();
  const auto& ln_bias = ln_fc1->layer_norm->bias;
  const auto gemm_residual = detail::gemm_residual(residual, rows, fc2_call->out_dtype);
  // h + mlp(h) that the GEMM cannot add: added after, through the function's residual branch.
  const bool residual_branch = residual_is_input && !gemm_residual.defined();
  auto outputs = LayerNormMLPFunction::apply(
      input, ln_fc1->layer_norm->weight,
      ln_bias.defined() ? ln_bias : fc1_anchor.detach().new_empty({0}), fc1.weight,
      fc1.bias.defined() ? fc1.bias : fc1_anchor.detach(), out.weight,
      out.bias.defined() ? out.bias : fc2_anchor.detach(), fc1_anchor, fc2_anchor,
      gemm_residual.defined() ? gemm_residual : fc2_anchor.detach(), fc1.options.bias(),
      out.options.bias(), gemm_residual.defined(), residual_is_input, residual_branch,
      *fc1_call, *fc2_call, options.eps(), options.normalization(), options.activation());
  const auto& y = outputs.front();
  if (residual_branch) return outputs.back() + y;
  return residual.defined() && !gemm_residual.defined() ? residual + y : y;
}

}  // namespace amp8
