#pragma once
// The pieces of Fp8Linear's FP8 path that the fused modules (Fp8LayerNormLinear) reuse.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <string>
#include <vector>

#include "ops/quantize.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/fp8/fp8_recipe.h"

namespace amp8::detail {

/// What one FP8 forward call of a linear layer uses.
struct Fp8LinearCall {
  /// The FP8 weight and its transpose (cached or fresh); under fp8_params no transpose (the
  /// backward makes it).
  Fp8CastTranspose weight_q;
  Fp8Recipe recipe;
  at::ScalarType out_dtype;  ///< the autocast dtype, else the input's
};

struct Fp8LinearInternals {
  /// Whether `linear` runs in FP8 for `input` [..., in_features] (inside a region, eligible
  /// shape, large enough); when it does, registers its metadata with the region and returns
  /// the call's state.
  static std::optional<Fp8LinearCall> prepare(Fp8LinearImpl& linear, const at::Tensor& input);
  /// The same for a GEMM of `rows` rows whose input would have `input`'s dtype and device (a
  /// layer whose input is made inside a fused function, after this decision).
  static std::optional<Fp8LinearCall> prepare(Fp8LinearImpl& linear, const at::Tensor& input,
                                              int64_t rows);
  /// Whether prepare() would return a call, without its side effects (no warning, no
  /// registration, no weight quantized).
  static bool runs_in_fp8(const Fp8LinearImpl& linear, int64_t rows);
  /// An empty tensor that requires grad under fp8_params (so backward reaches main_grad).
  static const at::Tensor& grad_anchor(Fp8LinearImpl& linear);
  /// Under fp8_params with grad mode on: one more backward pass will add into main_grad (a
  /// layer may run several times per forward pass; its main_grad hook fires after the last).
  static void expect_main_grad(Fp8LinearImpl& linear);
  static at::Tensor high_precision_forward(Fp8LinearImpl& linear, const at::Tensor& input);
  static void accumulate_main_grad(Fp8LinearImpl& linear, const at::Tensor& grad);
  /// main_grad += grad_tᵀ-GEMM (dW = dyᵀ·x in FP8), accumulated by the GEMM itself.
  static void accumulate_main_grad_gemm(Fp8LinearImpl& linear, const Fp8Tensor& grad_t,
                                        const Fp8Tensor& x_t);
  static const c10::intrusive_ptr<c10d::ProcessGroup>& group(const Fp8LinearImpl& linear);
  /// Scale and amax slots: input_*, weight_* (forward), grad_* (backward).
  static const Fp8LinearImpl::SlotViews& slots(Fp8LinearImpl& linear) {
    return linear.slot_views();
  }
};

/// Rows padded to the FP8 GEMMs' multiple of 16, and x2d padded with zero rows to `rows`.
int64_t padded_rows(int64_t rows);
at::Tensor pad_rows(const at::Tensor& x2d, int64_t rows);

/// The dtype GEMM outputs take: the autocast dtype where autocast is on, else the input's.
at::ScalarType compute_dtype(const at::Tensor& input);

/// What quantize_for quantizes: x, gelu(x) (an MLP's hidden activation, tanh GELU), or
/// x · gelu'(gelu_input) (the gradient of the GEMM output that GELU read).
struct QuantizeActivation {
  enum Kind { kNone, kGelu, kDGelu };
  Kind kind = kNone;
  at::Tensor gelu_input;  ///< kDGelu only: GELU's input, x's shape and dtype
};

/// Quantizes x (or its activation) for the recipe: delayed scaling uses `scale` and max-merges
/// the values' amax into `amax_slot`, fused into one kernel with the activation
/// (cast_transpose_gelu / cast_transpose_dgelu); tensorwise scaling derives the scale from the
/// values themselves. `dbias_out` ([cols]; float32, bfloat16 or float16: the bias's dtype), when
/// defined, receives their column sums from the same read (not with kGelu).
Fp8CastTranspose quantize_for(const at::Tensor& x, const Fp8Recipe& recipe, Fp8Format format,
                              const at::Tensor& scale, const at::Tensor& amax_slot,
                              const at::Tensor& dbias_out = {},
                              const QuantizeActivation& activation = {});

struct Fp8LinearGrads {
  at::Tensor input;  ///< [rows, in_features]
  at::Tensor weight;
  at::Tensor bias;
};

/// The non-tensor state an FP8 linear autograd function keeps from forward to backward,
/// stored in the context as integers under `key` (a function of several layers uses one key
/// per layer).
struct Fp8LinearSaved {
  Fp8LinearImpl* linear = nullptr;
  Fp8Recipe recipe;
  int64_t rows = 0;  ///< rows of the flattened input, before padding
  bool has_bias = false;
  at::ScalarType input_dtype = at::kFloat;
  at::ScalarType weight_dtype = at::kFloat;  ///< FP8 under fp8_params
  at::ScalarType bias_dtype = at::kFloat;    ///< the bias gradient's (the bias's own dtype)
  std::vector<int64_t> input_sizes;

  void save(torch::autograd::AutogradContext* ctx, const std::string& key = "fp8_linear") const;
  static Fp8LinearSaved load(torch::autograd::AutogradContext* ctx,
                             const std::string& key = "fp8_linear");
  /// A [rows, features] tensor with the input's leading dimensions: [..., features].
  at::Tensor unflatten(const at::Tensor& t2d) const;
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

/// Saves `tensors` and then the FP8 weight operand dgrad needs (two more tensors: data and
/// scale_inv): the call's transpose Wᵀ [in, out], or under fp8_params, whose call carries no
/// transpose, the stored FP8 weight W [out, in] itself. load_dgrad_weight takes the two saved
/// tensors back with which of the two they are.
struct Fp8DgradWeight {
  Fp8Tensor weight;
  bool transposed = true;  ///< Wᵀ [in, out]; false: W [out, in], transposed just before dgrad
};
/// The operand itself (what save_dgrad_weight saves), for a function that saves the operands
/// of several layers in its one save_for_backward call.
Fp8DgradWeight dgrad_weight_of(const Fp8CastTranspose& weight_q);
void save_dgrad_weight(torch::autograd::AutogradContext* ctx, const Fp8CastTranspose& weight_q,
                       std::vector<at::Tensor> tensors);
Fp8DgradWeight load_dgrad_weight(torch::autograd::AutogradContext* ctx, const at::Tensor& data,
                                 const at::Tensor& scale_inv, Fp8Format format);

/// The backward GEMMs of an FP8 linear layer: grad_output2d [rows, out_features] is quantized
/// once (cast_transpose) into the gradient format; wgrad from x_t (which may be undefined when
/// no weight gradient is needed), then dgrad from `w`, what save_dgrad_weight saved (W is
/// byte-transposed here, just before dgrad); under fp8_params the weight gradient goes to
/// main_grad. The bias gradient comes from the gradient's cast_transpose (its dbias), not from a
/// separate reduction. x_t is dropped before dgrad: pass it by std::move, holding no
/// other reference, to free it there. need_bias is ignored for a layer without bias.
/// With `gelu_input` (the layer's output as GELU read it, padded like the rows here) the
/// gradient quantized is grad_output2d · gelu'(gelu_input): grad_output2d is then GELU's output
/// gradient, and GELU's backward happens inside the gradient's cast (an MLP's first layer).
Fp8LinearGrads fp8_linear_backward(const Fp8LinearSaved& saved, const at::Tensor& grad_output2d,
                                   Fp8Tensor x_t, const Fp8DgradWeight& w, bool need_input,
                                   bool need_weight, bool need_bias,
                                   const at::Tensor& gelu_input = {});

}  // namespace amp8::detail
