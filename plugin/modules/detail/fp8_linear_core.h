#pragma once
// The pieces of Fp8Linear's FP8 path that the fused modules (Fp8LayerNormLinear,
// Fp8LayerNormMLP) reuse: padding, quantizing a slot, what forward saves, the backward GEMMs.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <string>
#include <vector>

#include "ops/quantize.h"
#include "plugin/fp8/fp8_recipe.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/modules/fp8_meta.h"

namespace amp8::detail {

/// Rows padded to the FP8 GEMMs' multiple of 16, and x2d padded with zero rows to `rows`.
int64_t padded_rows(int64_t rows);
at::Tensor pad_rows(const at::Tensor& x2d, int64_t rows);

/// The dtype GEMM outputs take: the autocast dtype where autocast is on, else the input's.
at::ScalarType compute_dtype(const at::Tensor& input);

/// A layer's residual (undefined: none) as its output GEMM's C (Fp8GemmOptions::residual):
/// [rows, features], contiguous, where it is in the GEMM's `out_dtype`, 16-byte aligned, and the
/// GEMM's rows are not padded past `rows`; undefined where the GEMM cannot add it (the caller adds it to the
/// layer's output then, outside its autograd function, so that the gradients are those of
/// `residual + layer(input)`).
at::Tensor gemm_residual(const at::Tensor& residual, int64_t rows, at::ScalarType out_dtype);

/// What quantize_for quantizes: x, gelu(x) (an MLP's hidden activation, tanh GELU),
/// x · gelu'(input) (the gradient of the GEMM output that GELU read), or swiglu_backward(x, input)
/// (the gradient [rows, 2·cols] of the GEMM output that SwiGLU read, from x [rows, cols]).
struct QuantizeActivation {
  enum Kind { kNone, kGelu, kDGelu, kDSwiGlu };
  Kind kind = kNone;
  /// kDGelu: GELU's input (x's shape and dtype); kDSwiGlu: SwiGLU's gate/up input [rows, 2·cols]
  at::Tensor input;
};

/// Quantizes x (or its activation) as `meta`'s `slot`, in the recipe's format for the slot
/// (the backward format for kGradOutput, else the forward one): delayed scaling uses the slot's
/// scale and max-merges the values' amax into the slot's amax, fused into one kernel with the
/// activation (cast_transpose_gelu / _dgelu / _dswiglu); tensorwise scaling derives the scale
/// from the values themselves (and records their amax in the slot). `dbias_out` ([cols];
/// float32, bfloat16 or float16: the bias's dtype), when defined, receives their column sums
/// from the same read (not with kGelu).
Fp8CastTranspose quantize_for(const at::Tensor& x, const Fp8Recipe& recipe, Fp8Meta& meta,
                              Fp8Slot slot, const at::Tensor& dbias_out = {},
                              const QuantizeActivation& activation = {});

/// quantize_for of the column-wise concatenation [x_0 | x_1 | …] of `columns` (2-D, one row
/// count; no activation) through cast_transpose_columns: each piece quantized where it is, with
/// the same bytes and amax as quantize_for(at::cat(columns, 1), …), and its dbias under
/// cast_transpose_columns' conditions. Current scaling takes the amax over all pieces before the
/// scale.
Fp8CastTranspose quantize_columns_for(const std::vector<at::Tensor>& columns,
                                      const Fp8Recipe& recipe, Fp8Meta& meta, Fp8Slot slot,
                                      const at::Tensor& dbias_out = {});

/// The FP8 weight operand dgrad needs: the call's transpose Wᵀ [in, out], or under fp8_params,
/// whose call carries no transpose, the stored FP8 weight W [out, in] itself (detached).
struct Fp8DgradWeight {
  Fp8Tensor weight;
  bool transposed = true;  ///< Wᵀ [in, out]; false: W [out, in], transposed just before dgrad
};
Fp8DgradWeight dgrad_weight_of(const Fp8CastTranspose& weight_q);

struct Fp8LinearGrads {
  at::Tensor input;  ///< [rows, in_features]
  at::Tensor weight;
  at::Tensor bias;
};

/// The non-tensor state an FP8 linear autograd function keeps from forward to backward,
/// stored in the context under `key` (a function of several layers uses one key per layer):
/// the layer's Fp8Meta (shared, so the backward never touches the module) and integers.
struct Fp8LinearSaved {
  c10::intrusive_ptr<Fp8Meta> meta;
  Fp8Recipe recipe;
  int64_t rows = 0;  ///< rows of the flattened input, before padding
  bool has_bias = false;
  at::ScalarType input_dtype = at::kFloat;
  at::ScalarType weight_dtype = at::kFloat;  ///< FP8 under fp8_params
  at::ScalarType bias_dtype = at::kFloat;    ///< the bias gradient's (the bias's own dtype)
  std::vector<int64_t> input_sizes;
  /// How the dgrad weight operand was saved (Fp8DgradWeight::transposed).
  bool dgrad_weight_transposed = true;

  /// What a forward call saves: `gemm_input` is what the GEMM read before quantizing (its
  /// dtype is dgrad's output dtype), `rows` its rows before padding, `input_sizes` the layer
  /// input's sizes (unflatten's shape).
  static Fp8LinearSaved of(const Fp8LinearImpl::Fp8Call& call, int64_t rows, bool has_bias,
                           const at::Tensor& gemm_input, const at::Tensor& weight,
                           const at::Tensor& bias, std::vector<int64_t> input_sizes);

  void save(torch::autograd::AutogradContext* ctx, const std::string& key = "fp8_linear") const;
  static Fp8LinearSaved load(torch::autograd::AutogradContext* ctx,
                             const std::string& key = "fp8_linear");
  /// A [rows, features] tensor with the input's leading dimensions: [..., features].
  at::Tensor unflatten(const at::Tensor& t2d) const;
  /// The dgrad operand from its saved data and scale_inv.
  Fp8DgradWeight dgrad_weight(const at::Tensor& data, const at::Tensor& scale_inv) const {
    return {Fp8Tensor(data, scale_inv, recipe.forward_format), dgrad_weight_transposed};
  }
};

/// The FP8 input transpose (wgrad's operand) kept in the context's saved_data instead of
/// save_for_backward: take_input_transpose hands it to the backward and, unless the graph is
/// retained, drops the context's reference, so fp8_linear_backward can free it before dgrad.
/// It is an internal tensor nobody else sees or modifies, so save_for_backward's version
/// check has nothing to guard.
void save_input_transpose(torch::autograd::AutogradContext* ctx, const Fp8Tensor& x_t,
                          const std::string& key = "x_t");
Fp8Tensor take_input_transpose(torch::autograd::AutogradContext* ctx, Fp8Format format,
                               const std::string& key = "x_t");

/// A struct of tensors saved for backward lists its fields once, in `static constexpr auto
/// fields()`: a std::array of pointers to its at::Tensor members. These two lay them out for
/// save_for_backward (which checks their versions) and read them back into the same fields.
template <typename Saved>
void save_tensors(torch::autograd::AutogradContext* ctx, const Saved& saved) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(Saved::fields().size());
  for (auto field : Saved::fields()) tensors.push_back(saved.*field);
  ctx->save_for_backward(std::move(tensors));
}
template <typename Saved>
Saved load_tensors(torch::autograd::AutogradContext* ctx) {
  constexpr auto fields = Saved::fields();
  auto tensors = ctx->get_saved_variables();
  TORCH_INTERNAL_ASSERT(tensors.size() == fields.size(), "saved ", tensors.size(),
                        " tensors, expected ", fields.size());
  Saved saved;
  for (size_t i = 0; i < tensors.size(); ++i) saved.*fields[i] = std::move(tensors[i]);
  return saved;
}

/// Checks a forward_split's split_sizes: positive, summing to out_features (`op` names the call).
void check_split_sizes(at::IntArrayRef split_sizes, int64_t out_features, const char* op);

/// The backward GEMMs of an FP8 linear layer: grad_output2d [rows, out_features] is quantized
/// once (cast_transpose) into the gradient format; wgrad from x_t (which may be undefined when
/// no weight gradient is needed), then dgrad from `w` (dgrad_weight_of's operand; W is
/// byte-transposed here, just before dgrad); under fp8_params the weight gradient goes to
/// main_grad. The bias gradient comes from the gradient's cast_transpose (its dbias), not from a
/// separate reduction. x_t is dropped before dgrad: pass it by std::move, holding no
/// other reference, to free it there. need_bias is ignored for a layer without bias.
/// With an `activation_backward` (kDGelu or kDSwiGlu, its input the layer's output as the
/// activation read it, padded like the rows here) grad_output2d is the activation's output
/// gradient, and the activation's backward happens inside the gradient's cast (an MLP's first
/// layer): the gradient quantized is grad_output2d · gelu'(input) or
/// swiglu_backward(grad_output2d, input).
Fp8LinearGrads fp8_linear_backward(const Fp8LinearSaved& saved, const at::Tensor& grad_output2d,
                                   Fp8Tensor x_t, const Fp8DgradWeight& w, bool need_input,
                                   bool need_weight, bool need_bias,
                                   const QuantizeActivation& activation_backward = {});
/// The same for an output gradient given as column pieces [rows, cols_i] (their concatenation
/// is grad_output2d; no activation_backward with more than one): quantized without
/// concatenating them (quantize_columns_for), as the layer's split outputs' gradients arrive;
/// pieces that are adjacent column blocks of one buffer (an attention backward that fills one
/// dq|dk|dv buffer) are cast as that buffer. A piece with rows that are not contiguous in
/// memory, or a row count to pad, is copied first.
Fp8LinearGrads fp8_linear_backward(const Fp8LinearSaved& saved,
                                   const std::vector<at::Tensor>& grad_output_columns,
                                   Fp8Tensor x_t, const Fp8DgradWeight& w, bool need_input,
                                   bool need_weight, bool need_bias,
                                   const QuantizeActivation& activation_backward = {});

// ---- the blockwise recipe (TE's Float8BlockScaling): activations and gradients in 1×128
// tiles, weights in 128×128 blocks, each GEMM block-scaled (ops/blockwise.h) ----

/// y = x·Wᵀ (+ bias) for x [rows padded to 16, in] in the recipe's forward format, quantized
/// here in 1×128 tiles; its transpose xᵀ (the weight gradient's operand, in its own tiles) is
/// kept in the context's saved_data under `key`, as save_input_transpose keeps the tensorwise
/// one. The result has saved.rows rows, in `out_dtype` (float16 through a float32 GEMM output:
/// the block-scaled GEMMs write float32 or bfloat16). With `activation` kGelu, x is GELU's input
/// and the GEMM reads gelu(x), computed inside the quantization (quantize_blockwise_gelu: an
/// MLP's second layer); kNone or kGelu only. `residual`, when defined, is added by the GEMM
/// (gemm_residual's: [saved.rows, features] in out_dtype).
at::Tensor fp8_linear_forward_blockwise(torch::autograd::AutogradContext* ctx,
                                        const Fp8LinearSaved& saved, const at::Tensor& x,
                                        const Fp8BlockwiseCastTranspose& weight_blocks,
                                        const at::Tensor& bias, at::ScalarType out_dtype,
                                        const std::string& key = "x_t",
                                        QuantizeActivation::Kind activation = QuantizeActivation::kNone,
                                        const at::Tensor& residual = {});
/// The saved xᵀ of fp8_linear_forward_blockwise, freed from the context unless the graph is
/// retained (see take_input_transpose).
Fp8BlockwiseTensor take_input_transpose_blockwise(torch::autograd::AutogradContext* ctx,
                                                  Fp8Format format, const std::string& key = "x_t");
/// The blockwise dgrad operand to save in the forward: Wᵀ's 128×128 blocks, or under fp8_params
/// (saved.dgrad_weight_transposed false) W's, transposed in the backward.
const Fp8BlockwiseTensor& dgrad_weight_blocks_of(const Fp8BlockwiseCastTranspose& weight_blocks,
                                                 const Fp8LinearSaved& saved);
/// The backward GEMMs of the blockwise recipe: the output gradient quantized in 1×128 tiles
/// (and its transpose, for wgrad, in its own tiles) in the recipe's backward format; wgrad
/// dW = dyᵀ·x from the two transposes (1×128 × 1×128; under fp8_params into main_grad), dgrad
/// dx = dy·W from Wᵀ's blocks (1×128 × 128×128): `w` is Wᵀ, or W itself (w_transposed false:
/// a weight stored in blocks, transposed here only when dx is needed); the bias gradient the
/// column sums of the unquantized gradient, from the read that quantizes it. With `activation_backward` kDGelu (its input
/// GELU's input, the layer's output as GELU read it, grad_output2d's shape) grad_output2d is
/// GELU's output gradient and the gradient quantized is its product with gelu'(input), computed
/// inside the quantization (quantize_blockwise_dgelu: an MLP's first layer).
Fp8LinearGrads fp8_linear_backward_blockwise(const Fp8LinearSaved& saved,
                                             const at::Tensor& grad_output2d,
                                             Fp8BlockwiseTensor x_t, const Fp8BlockwiseTensor& w,
                                             bool w_transposed, bool need_input, bool need_weight,
                                             bool need_bias,
                                             const QuantizeActivation& activation_backward = {});
/// The same for an output gradient given as column pieces [rows, cols_i] (no
/// activation_backward with more than one), quantized without concatenating them
/// (quantize_blockwise_columns) as fp8_linear_backward's pieces are; adjacent column blocks of
/// one buffer are quantized as that buffer.
Fp8LinearGrads fp8_linear_backward_blockwise(const Fp8LinearSaved& saved,
                                             const std::vector<at::Tensor>& grad_output_columns,
                                             Fp8BlockwiseTensor x_t, const Fp8BlockwiseTensor& w,
                                             bool w_transposed, bool need_input, bool need_weight,
                                             bool need_bias,
                                             const QuantizeActivation& activation_backward = {});

}  // namespace amp8::detail
