// The FP8 linear core shared by Fp8Linear and Fp8LayerNormLinear: token padding, the quantize
// step of each operand, what the forward pass saves for the backward pass, and the backward
// pass itself (wgrad, then dgrad).
#include "plugin/modules/detail/fp8_linear_core.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <algorithm>
#include <utility>

#include "ops/blockwise.h"
#include "ops/fp8_gemm.h"
#include "ops/layer_norm.h"
#include "ops/quantize.h"
#include "plugin/fp8/detail/fp8_state.h"
#include "plugin/compat/torch_internals.h"

namespace amp8::detail {

constexpr int64_t kTokenAlign = 16;

int64_t padded_rows(int64_t rows) { return (rows + kTokenAlign - 1) / kTokenAlign * kTokenAlign; }

at::Tensor pad_rows(const at::Tensor& x2d, int64_t rows) {
  if (x2d.size(0) == rows) return x2d.contiguous();
  return at::constant_pad_nd(x2d, {0, 0, 0, rows - x2d.size(0)}).contiguous();
}

at::ScalarType compute_dtype(const at::Tensor& input) {
  const auto device_type = input.device().type();
  if (at::autocast::is_autocast_enabled(device_type)) {
    return at::autocast::get_autocast_dtype(device_type);
  }
  return input.scalar_type();
}

at::Tensor gemm_residual(const at::Tensor& residual, int64_t rows, at::ScalarType out_dtype) {
  if (!residual.defined() || padded_rows(rows) != rows || residual.scalar_type() != out_dtype) {
    return {};
  }
  auto c = residual.reshape({rows, -1}).contiguous();
  // The GEMMs take 16-byte aligned operands (a view at an odd offset is added after instead).
  return reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 == 0 ? c : at::Tensor();
}

namespace {

Fp8Format format_of(const Fp8Recipe& recipe, Fp8Slot slot) {
  return slot == Fp8Slot::kGradOutput ? recipe.backward_format : recipe.forward_format;
}

}  // namespace

Fp8CastTranspose quantize_columns_for(const std::vector<at::Tensor>& columns,
                                      const Fp8Recipe& recipe, Fp8Meta& meta, Fp8Slot slot,
                                      const at::Tensor& dbias_out) {
  const auto format = format_of(recipe, slot);
  const auto& amax_slot = meta.amax(slot);
  if (recipe.delayed()) {
    return cast_transpose_columns(columns, meta.scale(slot), format, amax_slot,
                                  /*accumulate_amax=*/true, dbias_out);
  }
  // Current scaling needs the values' amax before their scale: all pieces measured first.
  auto amax = compute_amax(columns.front());
  for (size_t i = 1; i < columns.size(); ++i) amax = at::maximum(amax, compute_amax(columns[i]));
  amax_slot.copy_(at::maximum(amax_slot, amax.reshape(amax_slot.sizes())));
  return cast_transpose_columns(columns, compute_current_scale(amax, format, recipe.margin),
                                format, {}, /*accumulate_amax=*/false, dbias_out);
}

Fp8CastTranspose quantize_for(const at::Tensor& x, const Fp8Recipe& recipe, Fp8Meta& meta,
                              Fp8Slot slot, const at::Tensor& dbias_out,
                              const QuantizeActivation& activation) {
  if (activation.kind == QuantizeActivation::kNone) {
    return quantize_columns_for({x}, recipe, meta, slot, dbias_out);
  }
  TORCH_INTERNAL_ASSERT(activation.kind != QuantizeActivation::kGelu || !dbias_out.defined(),
                        "quantize_for: GELU's cast has no dbias");
  const auto format = format_of(recipe, slot);
  const auto& amax_slot = meta.amax(slot);
  // Delayed scaling: the slot's scale, and the values' amax max-merged into the slot by the
  // fused cast itself. Current scaling: the values' amax measured first from the activation's
  // inputs (compute_amax_gelu / ...: one read, nothing written), then the same fused cast with
  // the scale it gives, so the activation is never written in high precision.
  at::Tensor scale, cast_amax;
  if (recipe.delayed()) {
    scale = meta.scale(slot);
    cast_amax = amax_slot;
  } else {
    at::Tensor amax;
    switch (activation.kind) {
      case QuantizeActivation::kGelu:
        amax = compute_amax_gelu(x);
        break;
      case QuantizeActivation::kDGelu:
        amax = compute_amax_dgelu(x, activation.input);
        break;
      case QuantizeActivation::kDSwiGlu:
        amax = compute_amax_dswiglu(x, activation.input);
        break;
      case QuantizeActivation::kNone:
        break;
    }
    amax_slot.copy_(at::maximum(amax_slot, amax.reshape(amax_slot.sizes())));
    scale = compute_current_scale(amax, format, recipe.margin);
  }
  const bool accumulate = cast_amax.defined();
  switch (activation.kind) {
    case QuantizeActivation::kGelu:
      return cast_transpose_gelu(x, scale, format, cast_amax, accumulate);
    case QuantizeActivation::kDGelu:
      return cast_transpose_dgelu(x, activation.input, scale, format, cast_amax, accumulate,
                                  dbias_out);
    case QuantizeActivation::kDSwiGlu:
      return cast_transpose_dswiglu(x, activation.input, scale, format, cast_amax, accumulate,
                                    dbias_out);
    case QuantizeActivation::kNone:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "quantize_for: unknown activation");
}

Fp8LinearSaved Fp8LinearSaved::of(const Fp8LinearImpl::Fp8Call& call, int64_t rows,
                                  bool has_bias, const at::Tensor& gemm_input,
                                  const at::Tensor& weight, const at::Tensor& bias,
                                  std::vector<int64_t> input_sizes) {
  return {call.meta,
          call.recipe,
          rows,
          has_bias,
          gemm_input.scalar_type(),
          weight.scalar_type(),
          bias.scalar_type(),
          std::move(input_sizes),
          /*dgrad_weight_transposed=*/call.recipe.blockwise()
              ? call.weight_blocks.transposed.defined()
              : call.weight_q.transposed.defined()};
}

void Fp8LinearSaved::save(torch::autograd::AutogradContext* ctx, const std::string& key) const {
  std::vector<int64_t> packed = {rows,
                                 has_bias,
                                 static_cast<int64_t>(input_dtype),
                                 static_cast<int64_t>(weight_dtype),
                                 static_cast<int64_t>(recipe.forward_format),
                                 static_cast<int64_t>(recipe.backward_format),
                                 recipe.margin,
                                 static_cast<int64_t>(recipe.amax_compute_algo),
                                 static_cast<int64_t>(recipe.scaling),
                                 recipe.amax_history_len,
                                 static_cast<int64_t>(bias_dtype),
                                 dgrad_weight_transposed};
  ctx->saved_data[key] = std::move(packed);
  ctx->saved_data[key + ".meta"] = meta;
  ctx->saved_data[key + ".input_sizes"] = input_sizes;
}

Fp8LinearSaved Fp8LinearSaved::load(torch::autograd::AutogradContext* ctx,
                                    const std::string& key) {
  const auto packed = ctx->saved_data[key].toIntVector();
  Fp8LinearSaved saved;
  saved.meta = ctx->saved_data[key + ".meta"].toCustomClass<Fp8Meta>();
  saved.rows = packed[0];
  saved.has_bias = packed[1] != 0;
  saved.input_dtype = static_cast<at::ScalarType>(packed[2]);
  saved.weight_dtype = static_cast<at::ScalarType>(packed[3]);
  saved.recipe.forward_format = static_cast<Fp8Format>(packed[4]);
  saved.recipe.backward_format = static_cast<Fp8Format>(packed[5]);
  saved.recipe.margin = static_cast<int>(packed[6]);
  saved.recipe.amax_compute_algo = static_cast<AmaxComputeAlgo>(packed[7]);
  saved.recipe.scaling = static_cast<Fp8Scaling>(packed[8]);
  saved.recipe.amax_history_len = packed[9];
  saved.bias_dtype = static_cast<at::ScalarType>(packed[10]);
  saved.dgrad_weight_transposed = packed[11] != 0;
  saved.input_sizes = ctx->saved_data[key + ".input_sizes"].toIntVector();
  return saved;
}

at::Tensor Fp8LinearSaved::unflatten(const at::Tensor& t2d) const {
  auto sizes = input_sizes;
  sizes.back() = t2d.size(1);
  return t2d.reshape(sizes);
}

namespace {

void save_transpose_pair(torch::autograd::AutogradContext* ctx, const at::Tensor& data,
                         const at::Tensor& scale_inv, const std::string& key) {
  ctx->saved_data[key] = data;
  ctx->saved_data[key + ".scale_inv"] = scale_inv;
}

// The data and scale_inv save_transpose_pair kept, the context's references dropped unless the
// graph is retained.
std::pair<at::Tensor, at::Tensor> take_transpose_pair(torch::autograd::AutogradContext* ctx,
                                                      const std::string& key) {
  const auto data = ctx->saved_data.find(key);
  const auto scale_inv = ctx->saved_data.find(key + ".scale_inv");
  TORCH_CHECK(data != ctx->saved_data.end() && scale_inv != ctx->saved_data.end(),
              "Fp8Linear: the saved input was already freed by an earlier backward pass; trying to "
              "backward through the graph a second time needs retain_graph=true the first time");
  std::pair<at::Tensor, at::Tensor> pair{data->second.toTensor(), scale_inv->second.toTensor()};
  // Without retain_graph this backward is the tensor's last use: drop the context's
  // reference so that the backward frees it after wgrad, as autograd would free a
  // save_for_backward tensor only after the whole backward function.
  if (!current_backward_keeps_graph()) {
    ctx->saved_data.erase(key);
    ctx->saved_data.erase(key + ".scale_inv");
  }
  return pair;
}

}  // namespace

void save_input_transpose(torch::autograd::AutogradContext* ctx, const Fp8Tensor& x_t,
                          const std::string& key) {
  save_transpose_pair(ctx, x_t.data, x_t.scale_inv, key);
}

Fp8Tensor take_input_transpose(torch::autograd::AutogradContext* ctx, Fp8Format format,
                               const std::string& key) {
  auto [data, scale_inv] = take_transpose_pair(ctx, key);
  return Fp8Tensor(std::move(data), std::move(scale_inv), format);
}

Fp8DgradWeight dgrad_weight_of(const Fp8CastTranspose& weight_q) {
  // Under fp8_params the call carries no transpose: the FP8 weight itself is saved (detached,
  // so an optimizer's set_data cannot swap it out from under the backward; every writer of
  // the FP8 weight also writes weight_scale_inv, saved with it, whose version check fails
  // the backward) and fp8_linear_backward transposes it for dgrad.
  if (weight_q.transposed.defined()) return {weight_q.transposed, true};
  const auto& w = weight_q.data;
  return {Fp8Tensor(w.data.detach(), w.scale_inv, w.format), false};
}

const Fp8BlockwiseTensor& dgrad_weight_blocks_of(const Fp8BlockwiseCastTranspose& weight_blocks,
                                                 const Fp8LinearSaved& saved) {
  return saved.dgrad_weight_transposed ? weight_blocks.transposed : weight_blocks.data;
}

namespace {

// The bias gradient's buffer, [features] on `like`'s device: in the bias's dtype, not the
// weight's (under fp8_params the weight is FP8, and the bias gradient went through an E4M3 cast
// — 3 mantissa bits, nothing below 2^-9 — before the autograd engine cast it back to the bias's
// dtype); float32 for a bias of another dtype, cast by the caller.
at::Tensor empty_bias_grad(const Fp8LinearSaved& saved, int64_t features, const at::Tensor& like) {
  const auto b = saved.bias_dtype;
  const bool direct = b == at::kFloat || b == at::kBFloat16 || b == at::kHalf;
  return at::empty({features}, like.options().dtype(direct ? b : at::kFloat));
}

// The row-major buffer whose adjacent column blocks `pieces` are (2-D, one dtype, unit column
// stride, rows one buffer width apart, each starting where the one before ends), as one
// [rows, Σ cols_i] view of it; undefined when they are not.
at::Tensor adjacent_columns_as_one(const std::vector<at::Tensor>& pieces) {
  const auto& first = pieces.front();
  if (pieces.size() < 2 || first.dim() != 2) return {};
  int64_t width = 0;
  for (const auto& piece : pieces) width += piece.dim() == 2 ? piece.size(1) : 0;
  int64_t offset = first.storage_offset();
  for (const auto& piece : pieces) {
    const bool adjacent = piece.dim() == 2 && piece.is_alias_of(first) &&
                          piece.scalar_type() == first.scalar_type() &&
                          piece.size(0) == first.size(0) && piece.stride(1) == 1 &&
                          (piece.size(0) == 1 || piece.stride(0) == width) &&
                          piece.storage_offset() == offset;
    if (!adjacent) return {};
    offset += piece.size(1);
  }
  return first.as_strided({first.size(0), width}, {width, 1}, first.storage_offset());
}

}  // namespace

void check_split_sizes(at::IntArrayRef split_sizes, int64_t out_features, const char* op) {
  int64_t total = 0;
  for (const auto size : split_sizes) {
    TORCH_CHECK(size > 0, op, ": split_sizes must be positive, got ", split_sizes);
    total += size;
  }
  TORCH_CHECK(!split_sizes.empty() && total == out_features, op,
              ": split_sizes must sum to out_features=", out_features, ", got ", split_sizes);
}

Fp8LinearGrads fp8_linear_backward(const Fp8LinearSaved& saved, const at::Tensor& grad_output2d,
                                   Fp8Tensor x_t, const Fp8DgradWeight& w, bool need_input,
                                   bool need_weight, bool need_bias,
                                   const QuantizeActivation& activation_backward) {
  return fp8_linear_backward(saved, std::vector<at::Tensor>{grad_output2d}, std::move(x_t), w,
                             need_input, need_weight, need_bias, activation_backward);
}

Fp8LinearGrads fp8_linear_backward(const Fp8LinearSaved& saved,
                                   const std::vector<at::Tensor>& grad_output_columns,
                                   Fp8Tensor x_t, const Fp8DgradWeight& w, bool need_input,
                                   bool need_weight, bool need_bias,
                                   const QuantizeActivation& activation_backward) {
  auto& meta = *saved.meta;
  const auto& recipe = saved.recipe;
  const int64_t rows = saved.rows;
  TORCH_INTERNAL_ASSERT(!grad_output_columns.empty() &&
                            (grad_output_columns.size() == 1 ||
                             activation_backward.kind == QuantizeActivation::kNone),
                        "fp8_linear_backward: one gradient, or column pieces without activation");
  Fp8LinearGrads grads;
  const auto whole = adjacent_columns_as_one(grad_output_columns);
  std::vector<at::Tensor> g;
  g.reserve(grad_output_columns.size());
  int64_t columns = 0;
  for (const auto& piece : whole.defined() ? std::vector<at::Tensor>{whole} : grad_output_columns) {
    auto padded = pad_rows(piece, padded_rows(rows));
    if (padded.scalar_type() != at::kFloat && padded.scalar_type() != at::kBFloat16 &&
        padded.scalar_type() != at::kHalf) {
      padded = padded.to(at::kFloat);
    }
    columns += padded.size(1);
    g.push_back(std::move(padded));
  }
  // The bias gradient comes from the read that quantizes the gradient (cast_transpose's dbias;
  // the zero rows of the padding add nothing), with a workspace of one float per 128 rows and
  // column, written in the bias's dtype. LibTorch's own column reduction read the gradient once
  // more and staged its partial sums in a workspace about the gradient's size (138 MB at
  // 16384 × 4096 in bf16).
  at::Tensor dbias;
  if (need_bias && saved.has_bias) {
    // The layer's output features: twice the gradient's columns where SwiGLU's backward (d gate,
    // d up) happens in the cast.
    const int64_t features =
        activation_backward.kind == QuantizeActivation::kDSwiGlu ? 2 * columns : columns;
    dbias = empty_bias_grad(saved, features, g.front());
  }
  auto g_q = activation_backward.kind == QuantizeActivation::kNone
                 ? quantize_columns_for(g, recipe, meta, Fp8Slot::kGradOutput, dbias)
                 : quantize_for(g.front(), recipe, meta, Fp8Slot::kGradOutput, dbias,
                                activation_backward);
  g.clear();
  if (dbias.defined()) {
    grads.bias = dbias.scalar_type() == saved.bias_dtype ? dbias : dbias.to(saved.bias_dtype);
  }
  if (recipe.delayed()) {
    register_backward_group(&meta, meta.backward_group(), recipe, meta.amax_reduction_group());
  }
  // Weight gradient first, so that the gradient's transpose and the saved input transpose
  // (when the caller gave up its reference) are freed before dgrad allocates its output: the
  // backward's peak holds three FP8 copies of an activation, not three plus dx.
  if (meta.fp8_params()) {
    // The FP8 weight has no autograd gradient; its FP32 master's comes through main_grad,
    // accumulated by the GEMM itself (Megatron's gradient-accumulation fusion): no
    // temporary fp32 gradient.
    meta.main_grad().add_product(g_q.transposed, x_t);
  } else if (need_weight) {
    // dW[N,K] = dyᵀ[N,M] · x[M,K] = dyᵀ · (xᵀ[K,M])ᵀ
    grads.weight = fp8_gemm(g_q.transposed, x_t, saved.weight_dtype);
  }
  g_q.transposed = Fp8Tensor();
  x_t = Fp8Tensor();
  if (need_input) {
    // dx[M,K] = dy[M,N] · W[N,K] = dy · (Wᵀ[K,N])ᵀ. Under fp8_params Wᵀ is made only now, after
    // wgrad has freed its operands, and freed with this frame.
    const auto& saved_w = w.weight;
    // amp8's byte-transpose kernel: ATen's strided copy of a 1-byte transpose
    // (t().contiguous()) ran at a tenth of the copy rate, 5 ms of a 1b step (profiled).
    const auto w_t = w.transposed ? saved_w : fp8_transpose(saved_w);
    grads.input = fp8_gemm(g_q.data, w_t, saved.input_dtype).narrow(0, 0, rows);
  }
  return grads;
}

namespace {

// The block-scaled GEMMs write float32 or bfloat16; a float16 result (and its residual) goes
// through float32.
at::Tensor blockwise_gemm(const Fp8BlockwiseTensor& a, const Fp8BlockwiseTensor& b,
                          at::ScalarType out_dtype, const Fp8GemmOptions& options = {}) {
  if (out_dtype == at::kFloat || out_dtype == at::kBFloat16)
    return fp8_blockwise_gemm(a, b, out_dtype, options);
  auto in_float = options;
  if (in_float.residual.defined()) in_float.residual = in_float.residual.to(at::kFloat);
  return fp8_blockwise_gemm(a, b, at::kFloat, in_float).to(out_dtype);
}

BlockwiseQuantizeOptions row_tiles(Fp8Format format) {
  BlockwiseQuantizeOptions tiles;
  tiles.block = Fp8BlockShape::k1x128;
  tiles.format = format;
  return tiles;
}

}  // namespace

at::Tensor fp8_linear_forward_blockwise(torch::autograd::AutogradContext* ctx,
                                        const Fp8LinearSaved& saved, const at::Tensor& x,
                                        const Fp8BlockwiseCastTranspose& weight_blocks,
                                        const at::Tensor& bias, at::ScalarType out_dtype,
                                        const std::string& key,
                                        QuantizeActivation::Kind activation,
                                        const at::Tensor& residual) {
  TORCH_INTERNAL_ASSERT(activation == QuantizeActivation::kNone ||
                            activation == QuantizeActivation::kGelu,
                        "fp8_linear_forward_blockwise: the input's activation is GELU or none");
  const auto tiles = row_tiles(saved.recipe.forward_format);
  auto x_q = activation == QuantizeActivation::kGelu
                 ? quantize_blockwise_gelu(x, tiles, /*transposed=*/true)
                 : quantize_blockwise(x, tiles, /*transposed=*/true);
  Fp8GemmOptions gemm;
  gemm.bias = bias;
  gemm.residual = residual;
  auto y = blockwise_gemm(x_q.data, weight_blocks.data, out_dtype, gemm);
  save_transpose_pair(ctx, x_q.transposed.data, x_q.transposed.scale_inv, key);
  return y.size(0) == saved.rows ? y : y.narrow(0, 0, saved.rows);
}

Fp8BlockwiseTensor take_input_transpose_blockwise(torch::autograd::AutogradContext* ctx,
                                                  Fp8Format format, const std::string& key) {
  auto [data, scale_inv] = take_transpose_pair(ctx, key);
  return {std::move(data), std::move(scale_inv), format, Fp8BlockShape::k1x128};
}

Fp8LinearGrads fp8_linear_backward_blockwise(const Fp8LinearSaved& saved,
                                             const at::Tensor& grad_output2d,
                                             Fp8BlockwiseTensor x_t, const Fp8BlockwiseTensor& w,
                                             bool w_transposed, bool need_input, bool need_weight,
                                             bool need_bias,
                                             const QuantizeActivation& activation_backward) {
  return fp8_linear_backward_blockwise(saved, std::vector<at::Tensor>{grad_output2d},
                                       std::move(x_t), w, w_transposed, need_input, need_weight,
                                       need_bias, activation_backward);
}

Fp8LinearGrads fp8_linear_backward_blockwise(const Fp8LinearSaved& saved,
                                             const std::vector<at::Tensor>& grad_output_columns,
                                             Fp8BlockwiseTensor x_t, const Fp8BlockwiseTensor& w,
                                             bool w_transposed, bool need_input, bool need_weight,
                                             bool need_bias,
                                             const QuantizeActivation& activation_backward) {
  TORCH_INTERNAL_ASSERT(activation_backward.kind == QuantizeActivation::kNone ||
                            activation_backward.kind == QuantizeActivation::kDGelu,
                        "fp8_linear_backward_blockwise: the gradient's activation is dGELU or none");
  TORCH_INTERNAL_ASSERT(!grad_output_columns.empty() &&
                            (grad_output_columns.size() == 1 ||
                             activation_backward.kind == QuantizeActivation::kNone),
                        "fp8_linear_backward_blockwise: one gradient, or column pieces without "
                        "activation");
  const auto& recipe = saved.recipe;
  auto& meta = *saved.meta;
  Fp8LinearGrads grads;
  const auto whole = adjacent_columns_as_one(grad_output_columns);
  std::vector<at::Tensor> g;
  int64_t columns = 0;
  for (const auto& piece : whole.defined() ? std::vector<at::Tensor>{whole} : grad_output_columns) {
    auto padded = pad_rows(piece, padded_rows(saved.rows));
    if (padded.scalar_type() != at::kFloat && padded.scalar_type() != at::kBFloat16 &&
        padded.scalar_type() != at::kHalf) {
      padded = padded.to(at::kFloat);
    }
    columns += padded.size(1);
    g.push_back(std::move(padded));
  }
  // The bias gradient from the read that quantizes the gradient, as fp8_linear_backward's (the
  // kernel sums where it writes the transpose; the padding rows are zero and add nothing).
  const at::Tensor dbias =
      need_bias && saved.has_bias ? empty_bias_grad(saved, columns, g.front()) : at::Tensor();
  const auto tiles = row_tiles(recipe.backward_format);
  const bool transposed = need_weight || meta.fp8_params();
  auto g_q = activation_backward.kind == QuantizeActivation::kDGelu
                 ? quantize_blockwise_dgelu(
                       g.front(),
                       pad_rows(activation_backward.input.to(g.front().scalar_type()),
                                g.front().size(0)),
                       tiles, transposed, dbias)
                 : quantize_blockwise_columns(g, tiles, transposed, dbias);
  g.clear();
  if (dbias.defined()) {
    grads.bias = dbias.scalar_type() == saved.bias_dtype ? dbias : dbias.to(saved.bias_dtype);
  }
  if (meta.fp8_params()) {
    // The FP8 weight has no autograd gradient; its master's accumulates in main_grad.
    meta.main_grad().add_product(g_q.transposed, x_t);
  } else if (need_weight) {
    // dW[N,K] = dyᵀ[N,T] · x[T,K] = dyᵀ · (xᵀ[K,T])ᵀ, both in 1×128 tiles along T.
    grads.weight = blockwise_gemm(g_q.transposed, x_t, saved.weight_dtype);
  }
  g_q.transposed = {};
  x_t = {};
  if (need_input) {
    // dx[T,K] = dy[T,N] · W[N,K] = dy · (Wᵀ[K,N])ᵀ, Wᵀ in the weight's 128×128 blocks.
    grads.input = blockwise_gemm(g_q.data, w_transposed ? w : transpose_blocks(w),
                                 saved.input_dtype)
                      .narrow(0, 0, saved.rows);
  }
  return grads;
}

}  // namespace amp8::detail
