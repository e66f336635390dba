#include "ops/quantize.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"
#include "ops/detail/fp8_cpu.h"
#include "ops/detail/gelu_formula.h"
#include "ops/detail/gelu_values.h"
#include "ops/detail/row_sum.h"
#include "ops/detail/scale_formula.h"
#include "ops/swiglu.h"

namespace amp8 {
namespace {

constexpr int64_t kGrain = 1 << 15;

template <typename T>
float amax_cpu_typed(const T* x, int64_t n) {
  return at::parallel_reduce(
      0, n, kGrain, 0.0f,
      [&](int64_t begin, int64_t end, float acc) {
        for (int64_t i = begin; i < end; ++i) {
          acc = detail::nan_max(acc, std::fabs(static_cast<float>(x[i])));
        }
        return acc;
      },
      detail::nan_max);
}

template <typename T, typename Fp8T>
float quantize_cpu_typed(const T* x, Fp8T* out, int64_t n, float scale, float fp8_max) {
  return at::parallel_reduce(
      0, n, kGrain, 0.0f,
      [&](int64_t begin, int64_t end, float acc) {
        for (int64_t i = begin; i < end; ++i) {
          const float v = static_cast<float>(x[i]);
          acc = detail::nan_max(acc, std::fabs(v));
          out[i] = detail::saturating_cast_cpu<Fp8T>(v, scale, fp8_max);
        }
        return acc;
      },
      detail::nan_max);
}

// Quantizes x into out (same numel), returns max|x|.
float quantize_cpu(const at::Tensor& x, float scale, Fp8Format format, const at::Tensor& out) {
  float result = 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "amp8_quantize", [&] {
    const auto* in = x.const_data_ptr<scalar_t>();
    if (format == Fp8Format::kE4M3) {
      result = quantize_cpu_typed(in, out.mutable_data_ptr<c10::Float8_e4m3fn>(), x.numel(), scale,
                                  fp8_max(format));
    } else {
      result = quantize_cpu_typed(in, out.mutable_data_ptr<c10::Float8_e5m2>(), x.numel(), scale,
                                  fp8_max(format));
    }
  });
  return result;
}

float amax_cpu(const at::Tensor& x) {
  float result = 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "amp8_amax", [&] {
    result = amax_cpu_typed(x.const_data_ptr<scalar_t>(), x.numel());
  });
  return result;
}

void check_quantize_args(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& amax_out,
                         std::string_view op) {
  detail::check_high_precision_input(x, op);
  TORCH_CHECK(scale.defined(), op, ": scale must be a defined tensor");
  detail::check_scalar_slot(scale, x, op, "scale");
  if (amax_out.defined()) detail::check_scalar_slot(amax_out, x, op, "amax_out");
}

using detail::check_dbias_out;

void record_amax(const at::Tensor& amax_out, float value, bool accumulate) {
  if (!amax_out.defined()) return;
  amax_out.fill_(accumulate ? detail::nan_max(amax_out.item<float>(), value) : value);
}


void check_activation_input(const at::Tensor& x, const at::Tensor& scale,
                            const at::Tensor& amax_out, std::string_view op) {
  check_quantize_args(x, scale, amax_out, op);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, cols], got shape ", x.sizes());
}

// gate_up: SwiGLU's input, its gate and up halves side by side.
void check_gate_up(const at::Tensor& gate_up, std::string_view op) {
  TORCH_CHECK(gate_up.size(1) % 2 == 0, op, ": gate_up must have an even number ",
              "of columns (gate and up halves), got shape ", gate_up.sizes());
}


// gate_up: the SwiGLU input of the gradient grad of its output.
void check_gate_up_of(const at::Tensor& grad, const at::Tensor& gate_up, std::string_view op) {
  TORCH_CHECK(gate_up.defined() && gate_up.dim() == 2 && gate_up.size(0) == grad.size(0) &&
                  gate_up.size(1) == 2 * grad.size(1) &&
                  gate_up.scalar_type() == grad.scalar_type() &&
                  gate_up.device() == grad.device() && gate_up.is_contiguous(),
              op, ": gate_up must be a contiguous ", grad.scalar_type(), " [", grad.size(0), ", ",
              2 * grad.size(1), "] tensor on ", grad.device(),
              " (grad's rows, twice its columns), got ",
              gate_up.defined() ? c10::str(gate_up.scalar_type(), " ", gate_up.sizes(), " on ",
                                           gate_up.device(),
                                           gate_up.is_contiguous() ? "" : ", not contiguous")
                                : std::string("an undefined tensor"));
}

// The CPU reference values of SwiGLU and of its backward, in float32 and not rounded to the
// inputs' dtype: what the fused kernels quantize.
at::Tensor swiglu_values(const at::Tensor& gate_up) {
  return swiglu(gate_up.to(at::kFloat).contiguous());
}
at::Tensor dswiglu_values(const at::Tensor& grad, const at::Tensor& gate_up) {
  return swiglu_backward(grad.to(at::kFloat).contiguous(), gate_up.to(at::kFloat));
}

// The checks every 2-D input of an amax op passes.
void check_amax_input(const at::Tensor& x, std::string_view op, std::string_view name = "x") {
  detail::check_high_precision_input(x, op, name);
  TORCH_CHECK(x.dim() == 2, op, ": ", name, " must be 2-D [rows, cols], got shape ", x.sizes());
}

#ifdef AMP8_WITH_CUDA
float* amax_ptr(const at::Tensor& amax_out) {
  return amax_out.defined() ? amax_out.mutable_data_ptr<float>() : nullptr;
}
#endif

}  // namespace

namespace detail {

at::Tensor gelu_values_cpu(const at::Tensor& x, const at::Tensor& gate) {
  auto values = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  float* out = values.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "amp8_gelu", [&] {
    const auto* in = x.const_data_ptr<scalar_t>();
    const auto* g = gate.defined() ? gate.const_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float v = static_cast<float>(in[i]);
        out[i] = g ? gelu_tanh_backward(v, static_cast<float>(g[i])) : gelu_tanh(v);
      }
    });
  });
  return values;
}

}  // namespace detail


Fp8Tensor quantize(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                   const at::Tensor& amax_out, bool accumulate_amax, const at::Tensor& out_arg) {
  check_quantize_args(x, scale, amax_out, "quantize");
  at::Tensor out;
  if (out_arg.defined()) {
    TORCH_CHECK(out_arg.scalar_type() == fp8_dtype(format) && out_arg.is_contiguous() &&
                    out_arg.numel() == x.numel() && out_arg.device() == x.device(),
                "quantize: out must be a contiguous ", fp8_dtype(format), " tensor of ",
                x.numel(), " elements on ", x.device(), ", got ", out_arg.scalar_type(), " ",
                out_arg.sizes(), (out_arg.is_contiguous() ? "" : " (not contiguous)"), " on ",
                out_arg.device());
    out = out_arg.view(x.sizes());
  } else {
    out = at::empty(x.sizes(), x.options().dtype(fp8_dtype(format)));
  }
  auto scale_inv = at::empty({1}, scale.options());
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::quantize_cuda(x, scale, format, out, scale_inv, amax_ptr(amax_out), accumulate_amax);
#else
    detail::no_cuda("quantize");
#endif
  } else {
    const float s = scale.item<float>();
    const float m = quantize_cpu(x, s, format, out);
    scale_inv.fill_(1.0f / s);
    record_amax(amax_out, m, accumulate_amax);
  }
  return Fp8Tensor(out, scale_inv, format);
}

void quantize_many(const std::vector<at::Tensor>& xs, const at::Tensor& scales,
                   const std::vector<int64_t>& scale_index, Fp8Format format,
                   const std::vector<at::Tensor>& outs) {
  TORCH_CHECK(outs.size() == xs.size() && scale_index.size() == xs.size(), "quantize_many: xs, outs and "
              "scale_index must have one entry per tensor, got ", xs.size(), ", ", outs.size(), " and ",
              scale_index.size());
  if (xs.empty()) return;
  TORCH_CHECK(scales.defined() && scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                  scales.is_contiguous() && scales.device() == xs.front().device(),
              "quantize_many: scales must be a contiguous 1-D float32 tensor on ", xs.front().device(), ", got ",
              scales.defined() ? c10::str(scales.scalar_type(), " ", scales.sizes(), " on ", scales.device())
                               : std::string("an undefined tensor"));
  for (size_t i = 0; i < xs.size(); ++i) {
    const auto name = "xs[" + std::to_string(i) + "]";
    detail::check_high_precision_input(xs[i], "quantize_many", name);
    TORCH_CHECK(xs[i].scalar_type() == xs.front().scalar_type() && xs[i].device() == xs.front().device(),
                "quantize_many: ", name,
                " is ", xs[i].scalar_type(), " on ", xs[i].device(), ", xs[0] ", xs.front().scalar_type(), " on ",
                xs.front().device(), ": all must have one dtype and device");
    TORCH_CHECK(scale_index[i] >= 0 && scale_index[i] < scales.numel(), "quantize_many: scale_index[", i, "] is ",
                scale_index[i], ", scales has ", scales.numel(), " elements");
    const auto& out = outs[i];
    TORCH_CHECK(out.defined() && out.scalar_type() == fp8_dtype(format) && out.is_contiguous() &&
                    out.numel() == xs[i].numel() && out.device() == xs[i].device(),
                "quantize_many: outs[", i, "] must be a contiguous ", fp8_dtype(format), " tensor of ",
                xs[i].numel(), " elements on ", xs[i].device(), ", got ",
                out.defined() ? c10::str(out.scalar_type(), " ", out.sizes(), out.is_contiguous() ? "" : " (not contiguous)",
                                         " on ", out.device())
                              : std::string("an undefined tensor"));
  }
  if (xs.front().is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::quantize_many_cuda(xs, scales, scale_index, format, outs);
#else
    detail::no_cuda("quantize_many");
#endif
    return;
  }
  const auto scale_values = scales.accessor<float, 1>();
  for (size_t i = 0; i < xs.size(); ++i) {
    quantize_cpu(xs[i], scale_values[scale_index[i]], format, outs[i].view(xs[i].sizes()));
  }
}

namespace {

// The cast_transpose of a checked 2-D x into out [rows, cols] (unit column stride, rows
// out.stride(0) apart: a column block of a wider matrix, or all of one) and out_t [cols, rows]
// (contiguous), scale_inv ← 1 / scale; amax_out and dbias_out as cast_transpose's.
void cast_transpose_into(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                         const at::Tensor& out, const at::Tensor& out_t,
                         const at::Tensor& scale_inv, const at::Tensor& amax_out,
                         bool accumulate_amax, const at::Tensor& dbias_out) {
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::cast_transpose_cuda(x, scale, format, out, out_t, scale_inv, amax_ptr(amax_out),
                                accumulate_amax, dbias_out);
#else
    detail::no_cuda("cast_transpose");
#endif
    return;
  }
  const float s = scale.item<float>();
  const at::Tensor codes = out.is_contiguous() ? out : at::empty(x.sizes(), out.options());
  const float m = quantize_cpu(x, s, format, codes);
  if (!codes.is_same(out)) out.copy_(codes);
  out_t.copy_(codes.t());
  scale_inv.fill_(1.0f / s);
  record_amax(amax_out, m, accumulate_amax);
  if (dbias_out.defined()) detail::sum_rows_into(dbias_out, x);
}

}  // namespace

Fp8CastTranspose cast_transpose(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                                const at::Tensor& amax_out, bool accumulate_amax,
                                const at::Tensor& dbias_out) {
  check_quantize_args(x, scale, amax_out, "cast_transpose");
  TORCH_CHECK(x.dim() == 2, "cast_transpose: x must be 2-D [rows, cols], got shape ", x.sizes());
  const int64_t rows = x.size(0), cols = x.size(1);
  if (dbias_out.defined()) check_dbias_out(dbias_out, x, "cast_transpose");
  auto options = x.options().dtype(fp8_dtype(format));
  auto out = at::empty({rows, cols}, options);
  auto out_t = at::empty({cols, rows}, options);
  auto scale_inv = at::empty({1}, scale.options());
  cast_transpose_into(x, scale, format, out, out_t, scale_inv, amax_out, accumulate_amax,
                      dbias_out);
  return {Fp8Tensor(out, scale_inv, format), Fp8Tensor(out_t, scale_inv, format)};
}

Fp8CastTranspose cast_transpose_columns(const std::vector<at::Tensor>& pieces,
                                        const at::Tensor& scale, Fp8Format format,
                                        const at::Tensor& amax_out, bool accumulate_amax,
                                        const at::Tensor& dbias_out) {
  TORCH_CHECK(!pieces.empty(), "cast_transpose_columns: pieces must hold at least one tensor");
  const auto& first = pieces.front();
  detail::check_high_precision_input(first, "cast_transpose_columns", "pieces[0]");
  TORCH_CHECK(first.dim() == 2, "cast_transpose_columns: pieces[0] must be 2-D [rows, cols], got shape ",
              first.sizes());
  int64_t cols = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& piece = pieces[i];
    const auto name = "pieces[" + std::to_string(i) + "]";
    detail::check_high_precision_input(piece, "cast_transpose_columns", name);
    TORCH_CHECK(piece.dim() == 2 && piece.size(0) == first.size(0) &&
                    piece.scalar_type() == first.scalar_type() &&
                    piece.device() == first.device(),
                "cast_transpose_columns: ", name, " must be 2-D with pieces[0]'s ",
                first.size(0), " rows, dtype ", first.scalar_type(), " and device ",
                first.device(), ", got ", piece.scalar_type(), " ", piece.sizes(), " on ",
                piece.device());
    cols += piece.size(1);
  }
  TORCH_CHECK(scale.defined(), "cast_transpose_columns: scale must be a defined tensor");
  detail::check_scalar_slot(scale, first, "cast_transpose_columns", "scale", "pieces[0]");
  if (amax_out.defined()) {
    detail::check_scalar_slot(amax_out, first, "cast_transpose_columns", "amax_out", "pieces[0]");
  }
  if (dbias_out.defined()) {
    check_dbias_out(dbias_out, cols, first.device(), "cast_transpose_columns");
  }
  const int64_t rows = first.size(0);
  auto options = first.options().dtype(fp8_dtype(format));
  auto out = at::empty({rows, cols}, options);
  auto out_t = at::empty({cols, rows}, options);
  auto scale_inv = at::empty({1}, scale.options());
  // The CUDA kernels sum each column in an order that does not depend on the matrix's width, so
  // each piece's column block of dbias_out comes with its cast. ATen's CPU column sum orders
  // by the width (vector chunks): the CPU reference sums the concatenation once, as
  // cast_transpose of it does.
  const bool dbias_per_piece = dbias_out.defined() && first.is_cuda();
  int64_t col = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t width = pieces[i].size(1);
    // The first piece sets amax_out as the caller asked; the others max-merge into it.
    cast_transpose_into(pieces[i], scale, format, out.narrow(1, col, width),
                        out_t.narrow(0, col, width), scale_inv, amax_out,
                        accumulate_amax || i > 0,
                        dbias_per_piece ? dbias_out.narrow(0, col, width) : at::Tensor());
    col += width;
  }
  if (dbias_out.defined() && !dbias_per_piece) {
    detail::sum_rows_into(dbias_out, pieces.size() == 1 ? first : at::cat(pieces, 1));
  }
  return {Fp8Tensor(out, scale_inv, format), Fp8Tensor(out_t, scale_inv, format)};
}

Fp8CastTranspose cast_transpose_gelu(const at::Tensor& x, const at::Tensor& scale,
                                     Fp8Format format, const at::Tensor& amax_out,
                                     bool accumulate_amax) {
  check_activation_input(x, scale, amax_out, "cast_transpose_gelu");
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    const auto options = x.options().dtype(fp8_dtype(format));
    auto out = at::empty(x.sizes(), options);
    auto out_t = at::empty({x.size(1), x.size(0)}, options);
    auto scale_inv = at::empty({1}, scale.options());
    if (detail::cast_transpose_gelu_cuda(x, scale, format, out, out_t, scale_inv,
                                         amax_ptr(amax_out), accumulate_amax)) {
      return {Fp8Tensor(out, scale_inv, format), Fp8Tensor(out_t, scale_inv, format)};
    }
    return cast_transpose(at::gelu(x.to(at::kFloat), "tanh"), scale, format, amax_out,
                          accumulate_amax);
#else
    detail::no_cuda("cast_transpose_gelu");
#endif
  }
  return cast_transpose(detail::gelu_values_cpu(x, {}), scale, format, amax_out, accumulate_amax);
}

Fp8CastTranspose cast_transpose_swiglu(const at::Tensor& gate_up, const at::Tensor& scale,
                                       Fp8Format format, const at::Tensor& amax_out,
                                       bool accumulate_amax) {
  check_activation_input(gate_up, scale, amax_out, "cast_transpose_swiglu");
  check_gate_up(gate_up, "cast_transpose_swiglu");
  if (gate_up.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
    const auto options = gate_up.options().dtype(fp8_dtype(format));
    auto out = at::empty({rows, ffn}, options);
    auto out_t = at::empty({ffn, rows}, options);
    auto scale_inv = at::empty({1}, scale.options());
    if (gate_up.is_contiguous() &&
        detail::cast_transpose_swiglu_cuda(gate_up, scale, format, out, out_t, scale_inv,
                                           amax_ptr(amax_out), accumulate_amax)) {
      return {Fp8Tensor(out, scale_inv, format), Fp8Tensor(out_t, scale_inv, format)};
    }
#else
    detail::no_cuda("cast_transpose_swiglu");
#endif
  }
  return cast_transpose(swiglu_values(gate_up), scale, format, amax_out, accumulate_amax);
}

Fp8CastTranspose cast_transpose_dswiglu(const at::Tensor& grad, const at::Tensor& gate_up,
                                        const at::Tensor& scale, Fp8Format format,
                                        const at::Tensor& amax_out, bool accumulate_amax,
                                        const at::Tensor& dbias_out) {
  check_activation_input(grad, scale, amax_out, "cast_transpose_dswiglu");
  check_gate_up_of(grad, gate_up, "cast_transpose_dswiglu");
  if (dbias_out.defined()) check_dbias_out(dbias_out, gate_up, "cast_transpose_dswiglu");
  if (grad.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    const int64_t rows = grad.size(0), cols = gate_up.size(1);
    const auto options = grad.options().dtype(fp8_dtype(format));
    auto out = at::empty({rows, cols}, options);
    auto out_t = at::empty({cols, rows}, options);
    auto scale_inv = at::empty({1}, scale.options());
    if (grad.is_contiguous() &&
        detail::cast_transpose_dswiglu_cuda(grad, gate_up, scale, format, out, out_t, scale_inv,
                                            amax_ptr(amax_out), accumulate_amax, dbias_out)) {
      return {Fp8Tensor(out, scale_inv, format), Fp8Tensor(out_t, scale_inv, format)};
    }
#else
    detail::no_cuda("cast_transpose_dswiglu");
#endif
  }
  return cast_transpose(dswiglu_values(grad, gate_up), scale, format, amax_out, accumulate_amax,
                        dbias_out);
}

Fp8CastTranspose cast_transpose_dgelu(const at::Tensor& grad, const at::Tensor& gelu_input,
                                      const at::Tensor& scale, Fp8Format format,
                                      const at::Tensor& amax_out, bool accumulate_amax,
                                      const at::Tensor& dbias_out) {
  check_activation_input(grad, scale, amax_out, "cast_transpose_dgelu");
  detail::check_gelu_input(grad, gelu_input, "cast_transpose_dgelu");
  if (dbias_out.defined()) check_dbias_out(dbias_out, grad, "cast_transpose_dgelu");
  if (grad.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    const auto options = grad.options().dtype(fp8_dtype(format));
    auto out = at::empty(grad.sizes(), options);
    auto out_t = at::empty({grad.size(1), grad.size(0)}, options);
    auto scale_inv = at::empty({1}, scale.options());
    if (detail::cast_transpose_dgelu_cuda(grad, gelu_input, scale, format, out, out_t, scale_inv,
                                          amax_ptr(amax_out), accumulate_amax, dbias_out)) {
      return {Fp8Tensor(out, scale_inv, format), Fp8Tensor(out_t, scale_inv, format)};
    }
    return cast_transpose(
        at::gelu_backward(grad.to(at::kFloat), gelu_input.to(at::kFloat), "tanh"), scale, format,
        amax_out, accumulate_amax, dbias_out);
#else
    detail::no_cuda("cast_transpose_dgelu");
#endif
  }
  return cast_transpose(detail::gelu_values_cpu(grad, gelu_input), scale, format, amax_out,
                        accumulate_amax, dbias_out);
}

at::Tensor compute_amax(const at::Tensor& x) {
  detail::check_high_precision_input(x, "compute_amax");
  auto result = at::empty({1}, x.options().dtype(at::kFloat));
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::amax_cuda(x, result);
#else
    detail::no_cuda("compute_amax");
#endif
  } else {
    result.fill_(amax_cpu(x));
  }
  return result;
}

at::Tensor compute_amax_many(const std::vector<at::Tensor>& xs) {
  detail::check_multi_tensor_list(xs, "compute_amax_many", "xs");
  const auto device = xs.front().device();
  auto result = at::zeros({static_cast<int64_t>(xs.size())}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (device.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::amax_many_cuda(xs, result);
#else
    detail::no_cuda("compute_amax_many");
#endif
    return result;
  }
  auto values = result.accessor<float, 1>();
  for (size_t i = 0; i < xs.size(); ++i) values[static_cast<int64_t>(i)] = xs[i].numel() > 0 ? amax_cpu(xs[i]) : 0.0f;
  return result;
}

namespace {

// An activation's amax: on the CPU the reference values `cpu_values()` measured, on CUDA
// activation_amax_cuda into a new float32 [1] tensor on x's device.
template <typename CpuValues>
at::Tensor activation_amax(detail::AmaxActivation activation, const at::Tensor& x,
                           const at::Tensor& gate, std::string_view op, CpuValues&& cpu_values) {
  if (!x.is_cuda()) return compute_amax(cpu_values());
  auto result = at::empty({1}, x.options().dtype(at::kFloat));
#ifdef AMP8_WITH_CUDA
  detail::activation_amax_cuda(activation, x, gate, result);
#else
  detail::no_cuda(op);
#endif
  return result;
}

}  // namespace

at::Tensor compute_amax_gelu(const at::Tensor& x) {
  check_amax_input(x, "compute_amax_gelu");
  return activation_amax(detail::AmaxActivation::kGelu, x, {}, "compute_amax_gelu",
                         [&] { return detail::gelu_values_cpu(x, {}); });
}

at::Tensor compute_amax_dgelu(const at::Tensor& grad, const at::Tensor& gelu_input) {
  check_amax_input(grad, "compute_amax_dgelu", "grad");
  detail::check_gelu_input(grad, gelu_input, "compute_amax_dgelu");
  return activation_amax(detail::AmaxActivation::kDGelu, grad, gelu_input, "compute_amax_dgelu",
                         [&] { return detail::gelu_values_cpu(grad, gelu_input); });
}

at::Tensor compute_amax_swiglu(const at::Tensor& gate_up) {
  check_amax_input(gate_up, "compute_amax_swiglu", "gate_up");
  check_gate_up(gate_up, "compute_amax_swiglu");
  return activation_amax(detail::AmaxActivation::kSwiGlu, gate_up, {}, "compute_amax_swiglu",
                         [&] { return swiglu_values(gate_up); });
}

at::Tensor compute_amax_dswiglu(const at::Tensor& grad, const at::Tensor& gate_up) {
  check_amax_input(grad, "compute_amax_dswiglu", "grad");
  check_gate_up_of(grad, gate_up, "compute_amax_dswiglu");
  return activation_amax(detail::AmaxActivation::kDSwiGlu, grad, gate_up, "compute_amax_dswiglu",
                         [&] { return dswiglu_values(grad, gate_up); });
}

at::Tensor compute_current_scale(const at::Tensor& amax, Fp8Format format, int margin) {
  TORCH_CHECK(amax.defined() && amax.scalar_type() == at::kFloat && amax.dim() <= 1 &&
                  amax.numel() >= 1,
              "compute_current_scale: amax must be float32, one value or a 1-D tensor of them, got ",
              amax.defined() ? c10::toString(amax.scalar_type()) : "an undefined tensor", " ",
              amax.defined() ? amax.sizes() : at::IntArrayRef{});
  TORCH_CHECK(margin >= 0 && margin < 127,
              "compute_current_scale: margin must be in [0, 126], got ", margin);
  const float margin_divisor = std::ldexp(1.0f, margin);
  const auto values = amax.reshape({amax.numel()}).contiguous();
  auto scale = at::empty({amax.numel()}, amax.options());
  if (amax.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::current_scale_cuda(values, fp8_max(format), margin_divisor, scale);
#else
    detail::no_cuda("compute_current_scale");
#endif
  } else {
    const float* in = values.const_data_ptr<float>();
    float* out = scale.mutable_data_ptr<float>();
    for (int64_t i = 0; i < values.numel(); ++i) {
      out[i] = detail::scale_from_amax(in[i], 1.0f, fp8_max(format), margin_divisor);
    }
  }
  return scale;
}

Fp8Tensor quantize_current_scaling(const at::Tensor& x, Fp8Format format, int margin,
                                   const at::Tensor& amax_out, const at::Tensor& scale_out) {
  detail::check_high_precision_input(x, "quantize_current_scaling");
  TORCH_CHECK(margin >= 0 && margin < 127,
              "quantize_current_scaling: margin must be in [0, 126], got ", margin);
  if (amax_out.defined())
    detail::check_scalar_slot(amax_out, x, "quantize_current_scaling", "amax_out");
  if (scale_out.defined())
    detail::check_scalar_slot(scale_out, x, "quantize_current_scaling", "scale_out");
  auto amax_value = compute_amax(x);
  auto scale = compute_current_scale(amax_value, format, margin);
  if (amax_out.defined()) amax_out.copy_(amax_value.reshape(amax_out.sizes()));
  if (scale_out.defined()) scale_out.copy_(scale.reshape(scale_out.sizes()));
  return quantize(x, scale, format);
}

}  // namespace amp8
