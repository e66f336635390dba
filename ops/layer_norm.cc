#include "ops/layer_norm.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <string_view>
#include <vector>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"
#include "ops/detail/fp8_cpu.h"
#include "ops/detail/scale_formula.h"
#include "ops/quantize.h"

namespace amp8 {
namespace {

void check_affine(const at::Tensor& t, const at::Tensor& x, std::string_view op,
                  std::string_view name) {
  if (!t.defined()) return;
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": ", name,
              " must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(1), op, ": ", name, " must have shape [",
              x.size(1), "] (x's hidden size), got ", t.sizes());
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on ", x.device(), " like x, got ",
              t.device());
}

void check_forward_args(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                        double eps, std::string_view op) {
  detail::check_high_precision_input(x, op);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, hidden], got shape ", x.sizes());
  check_affine(gamma, x, op, "gamma");
  check_affine(beta, x, op, "beta");
  TORCH_CHECK(eps > 0 && std::isfinite(eps), op, ": eps must be positive and finite, got ", eps);
}

at::Tensor as_float(const at::Tensor& t) {
  return t.defined() ? t.to(at::kFloat).contiguous() : at::Tensor();
}

#ifdef AMP8_WITH_CUDA
// gamma and beta as the CUDA kernels read them (and write their gradients): as they are when
// the defined ones share one dtype that is float32 or x's, else float32 copies. A bf16 model's
// LayerNorm then launches no casts (five per LayerNorm and step, forward and backward, before).
struct KernelAffine {
  at::Tensor gamma, beta;
};

KernelAffine kernel_affine(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta) {
  const auto& first = gamma.defined() ? gamma : beta;
  if (!first.defined()) return {};
  const auto dtype = first.scalar_type();
  const bool taken = (dtype == at::kFloat || dtype == x.scalar_type()) &&
                     (!beta.defined() || beta.scalar_type() == dtype) &&
                     (!gamma.defined() || gamma.is_contiguous()) &&
                     (!beta.defined() || beta.is_contiguous());
  if (taken) return {gamma, beta};
  return {as_float(gamma), as_float(beta)};
}
#endif

// ---- CPU reference ----

// Statistics of one row, accumulated in float64, rounded to float32 once (RMSNorm: mean 0).
template <typename T>
void row_stats(const T* x, int64_t hidden, double eps, Normalization norm, float& mean,
               float& rstd) {
  double sum = 0.0;
  if (norm == Normalization::kLayerNorm) {
    for (int64_t c = 0; c < hidden; ++c) sum += static_cast<float>(x[c]);
  }
  const double mu = sum / static_cast<double>(hidden);
  double squares = 0.0;
  for (int64_t c = 0; c < hidden; ++c) {
    const double d = static_cast<float>(x[c]) - mu;
    squares += d * d;
  }
  mean = static_cast<float>(mu);
  rstd = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(hidden) + eps));
}

// For each row: statistics, then emit(row, col, y) for y in float32.
template <typename T, typename Emit>
void layer_norm_cpu_rows(const at::Tensor& x, const at::Tensor& gamma_f, const at::Tensor& beta_f,
                         double eps, Normalization norm, const LayerNormStats& stats,
                         Emit&& emit) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* in = x.const_data_ptr<T>();
  const float* g = gamma_f.defined() ? gamma_f.const_data_ptr<float>() : nullptr;
  const float* b = beta_f.defined() ? beta_f.const_data_ptr<float>() : nullptr;
  float* mean_out = stats.mean.defined() ? stats.mean.mutable_data_ptr<float>() : nullptr;
  float* rstd_out = stats.rstd.mutable_data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = in + r * hidden;
      float mu = 0.0f, rs = 0.0f;
      row_stats(xr, hidden, eps, norm, mu, rs);
      if (mean_out != nullptr) mean_out[r] = mu;
      rstd_out[r] = rs;
      for (int64_t c = 0; c < hidden; ++c) {
        const float y =
            (static_cast<float>(xr[c]) - mu) * rs * (g ? g[c] : 1.0f) + (b ? b[c] : 0.0f);
        emit(r * hidden + c, y);
      }
    }
  });
}

void layer_norm_cpu(const at::Tensor& x, const at::Tensor& gamma_f, const at::Tensor& beta_f,
                    double eps, Normalization norm, const at::Tensor& out,
                    const LayerNormStats& stats) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "amp8_layer_norm", [&] {
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        layer_norm_cpu_rows<scalar_t>(x, gamma_f, beta_f, eps, norm, stats,
                                      [&](int64_t i, float y) { o[i] = static_cast<scalar_t>(y); });
      });
}

template <typename Fp8T>
float layer_norm_fp8_cpu_typed(const at::Tensor& x, const at::Tensor& gamma_f,
                               const at::Tensor& beta_f, double eps, Normalization norm,
                               float scale, float fp8_max, Fp8T* out,
                               const LayerNormStats& stats) {
  // Per-row maxima, merged afterwards, so that the parallel rows write no shared state.
  std::vector<float> row_max(static_cast<size_t>(x.size(0)), 0.0f);
  const int64_t hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "amp8_layer_norm_fp8", [&] {
        layer_norm_cpu_rows<scalar_t>(x, gamma_f, beta_f, eps, norm, stats, [&](int64_t i, float y) {
          float& m = row_max[static_cast<size_t>(i / hidden)];
          m = detail::nan_max(m, std::fabs(y));
          out[i] = detail::saturating_cast_cpu<Fp8T>(y, scale, fp8_max);
        });
      });
  float result = 0.0f;
  for (float m : row_max) result = detail::nan_max(result, m);
  return result;
}

template <typename T>
void layer_norm_backward_cpu_typed(const at::Tensor& dy, const at::Tensor& x,
                                   const LayerNormStats& stats, Normalization norm,
                                   const at::Tensor& gamma_f, const at::Tensor& dresidual,
                                   const at::Tensor& dx, const at::Tensor& dgamma,
                                   const at::Tensor& dbeta) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xin = x.const_data_ptr<T>();
  const T* dyin = dy.const_data_ptr<T>();
  const T* dres = dresidual.defined() ? dresidual.const_data_ptr<T>() : nullptr;
  T* dxout = dx.mutable_data_ptr<T>();
  const float* g = gamma_f.defined() ? gamma_f.const_data_ptr<float>() : nullptr;
  // RMSNorm: no mean to subtract, and no mean(g) term (y does not depend on x's mean).
  const float* mean =
      norm == Normalization::kLayerNorm ? stats.mean.const_data_ptr<float>() : nullptr;
  const float* rstd = stats.rstd.const_data_ptr<float>();
  auto mean_at = [&](int64_t r) { return mean != nullptr ? mean[r] : 0.0f; };
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xin + r * hidden;
      const T* dyr = dyin + r * hidden;
      double s1 = 0.0, s2 = 0.0;
      for (int64_t c = 0; c < hidden; ++c) {
        const float xhat = (static_cast<float>(xr[c]) - mean_at(r)) * rstd[r];
        const float wdy = static_cast<float>(dyr[c]) * (g ? g[c] : 1.0f);
        s1 += wdy;
        s2 += static_cast<double>(wdy) * xhat;
      }
      const float mean_wdy =
          mean != nullptr ? static_cast<float>(s1 / static_cast<double>(hidden)) : 0.0f;
      const float mean_wdy_xhat = static_cast<float>(s2 / static_cast<double>(hidden));
      for (int64_t c = 0; c < hidden; ++c) {
        const float xhat = (static_cast<float>(xr[c]) - mean_at(r)) * rstd[r];
        const float wdy = static_cast<float>(dyr[c]) * (g ? g[c] : 1.0f);
        const float d = rstd[r] * (wdy - mean_wdy - xhat * mean_wdy_xhat);
        dxout[r * hidden + c] =
            static_cast<T>(dres != nullptr ? d + static_cast<float>(dres[r * hidden + c]) : d);
      }
    }
  });
  if (!dgamma.defined() && !dbeta.defined()) return;
  float* dg = dgamma.defined() ? dgamma.mutable_data_ptr<float>() : nullptr;
  float* db = dbeta.defined() ? dbeta.mutable_data_ptr<float>() : nullptr;
  // Column sums in a fixed order (rows ascending), independent of the thread count.
  at::parallel_for(0, hidden, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double sum_g = 0.0, sum_b = 0.0;
      for (int64_t r = 0; r < rows; ++r) {
        const float d = static_cast<float>(dyin[r * hidden + c]);
        const float xhat = (static_cast<float>(xin[r * hidden + c]) - mean_at(r)) * rstd[r];
        sum_g += static_cast<double>(d) * xhat;
        sum_b += d;
      }
      if (dg) dg[c] = static_cast<float>(sum_g);
      if (db) db[c] = static_cast<float>(sum_b);
    }
  });
}

#ifdef AMP8_WITH_CUDA
// ---- ATen composite, for CUDA shapes the fused kernels do not take ----

// gamma/beta: float32 or x's dtype (kernel_affine); float32 arithmetic either way.
at::Tensor normalized_composite(const at::Tensor& x, const at::Tensor& gamma,
                                const at::Tensor& beta, double eps, Normalization norm,
                                const LayerNormStats& stats) {
  auto xf = x.to(at::kFloat);
  if (norm == Normalization::kLayerNorm) {
    auto mean = xf.mean(1, /*keepdim=*/true);
    stats.mean.copy_(mean.squeeze(1));
    xf = xf - mean;
  }
  auto rstd = at::rsqrt(xf.square().mean(1, /*keepdim=*/true) + eps);
  stats.rstd.copy_(rstd.squeeze(1));
  auto y = xf * rstd;
  if (gamma.defined()) y = y * gamma;
  if (beta.defined()) y = y + beta;
  return y;
}
#endif

LayerNormStats new_stats(const at::Tensor& x, Normalization norm) {
  auto options = x.options().dtype(at::kFloat);
  auto rstd = at::empty({x.size(0)}, options);
  if (norm == Normalization::kRMSNorm) return {at::Tensor(), rstd};
  return {at::empty({x.size(0)}, options), rstd};
}

// ---- LayerNorm and RMSNorm, one implementation (RMSNorm: beta undefined, no mean) ----

LayerNormResult normalize(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                          double eps, Normalization norm, std::string_view op) {
  check_forward_args(x, gamma, beta, eps, op);
  auto stats = new_stats(x, norm);
  auto out = at::empty_like(x);
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    const auto affine = kernel_affine(x, gamma, beta);
    if (!detail::layer_norm_cuda(x, affine.gamma, affine.beta, eps, norm, out, stats.mean,
                                 stats.rstd, {}, {}, nullptr, false)) {
      out.copy_(normalized_composite(x, affine.gamma, affine.beta, eps, norm, stats));
    }
#else
    detail::no_cuda(op);
#endif
  } else {
    layer_norm_cpu(x, as_float(gamma), as_float(beta), eps, norm, out, stats);
  }
  return {out, stats};
}

LayerNormFp8Result normalize_fp8(const at::Tensor& x, const at::Tensor& gamma,
                                 const at::Tensor& beta, double eps, Normalization norm,
                                 const at::Tensor& scale, Fp8Format format,
                                 const at::Tensor& amax_out, bool accumulate_amax,
                                 const at::Tensor& out, std::string_view op) {
  check_forward_args(x, gamma, beta, eps, op);
  TORCH_CHECK(scale.defined(), op, ": scale must be a defined tensor");
  detail::check_scalar_slot(scale, x, op, "scale");
  if (amax_out.defined()) detail::check_scalar_slot(amax_out, x, op, "amax_out");
  at::Tensor result = out;
  if (result.defined()) {
    TORCH_CHECK(result.scalar_type() == fp8_dtype(format), op, ": out must be ", fp8_dtype(format),
                " for format ", fp8_format_name(format), ", got ", result.scalar_type());
    TORCH_CHECK(result.sizes() == x.sizes() && result.is_contiguous(), op,
                ": out must be contiguous with x's shape ", x.sizes(), ", got ", result.sizes());
    TORCH_CHECK(result.device() == x.device(), op, ": out must be on ", x.device(), ", got ",
                result.device());
  } else {
    result = at::empty(x.sizes(), x.options().dtype(fp8_dtype(format)));
  }
  auto stats = new_stats(x, norm);
  auto scale_inv = at::empty({1}, scale.options());
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    const auto affine = kernel_affine(x, gamma, beta);
    float* amax = amax_out.defined() ? amax_out.mutable_data_ptr<float>() : nullptr;
    if (!detail::layer_norm_cuda(x, affine.gamma, affine.beta, eps, norm, result, stats.mean,
                                 stats.rstd, scale, scale_inv, amax, accumulate_amax)) {
      auto y = normalized_composite(x, affine.gamma, affine.beta, eps, norm, stats);
      auto q = quantize(y, scale, format, amax_out, accumulate_amax);
      result.copy_(q.data);
      scale_inv.copy_(q.scale_inv);
    }
#else
    detail::no_cuda(op);
#endif
  } else {
    const auto gamma_f = as_float(gamma), beta_f = as_float(beta);
    const float s = scale.item<float>();
    float m = 0.0f;
    if (format == Fp8Format::kE4M3) {
      m = layer_norm_fp8_cpu_typed(x, gamma_f, beta_f, eps, norm, s, fp8_max(format),
                                   result.mutable_data_ptr<c10::Float8_e4m3fn>(), stats);
    } else {
      m = layer_norm_fp8_cpu_typed(x, gamma_f, beta_f, eps, norm, s, fp8_max(format),
                                   result.mutable_data_ptr<c10::Float8_e5m2>(), stats);
    }
    scale_inv.fill_(1.0f / s);
    if (amax_out.defined()) {
      amax_out.fill_(accumulate_amax ? detail::nan_max(amax_out.item<float>(), m) : m);
    }
  }
  return {Fp8Tensor(result, scale_inv, format), stats};
}

LayerNormGrads normalize_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                  const LayerNormStats& stats, const at::Tensor& gamma,
                                  const at::Tensor& beta, const at::Tensor& grad_residual,
                                  Normalization norm, std::string_view op) {
  detail::check_high_precision_input(x, op);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, hidden], got shape ", x.sizes());
  TORCH_CHECK(grad_out.defined() && grad_out.sizes() == x.sizes(), op,
              ": grad_out must have x's shape ", x.sizes(), ", got ",
              grad_out.defined() ? grad_out.sizes() : at::IntArrayRef{});
  TORCH_CHECK(grad_out.device() == x.device(), op, ": grad_out must be on ", x.device(), ", got ",
              grad_out.device());
  check_affine(gamma, x, op, "gamma");
  check_affine(beta, x, op, "beta");
  const bool centered = norm == Normalization::kLayerNorm;
  auto check_stat = [&](const at::Tensor& t, std::string_view name) {
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.dim() == 1 &&
                    t.size(0) == x.size(0) && t.device() == x.device() && t.is_contiguous(),
                op, ": ", name, " must be float32 [", x.size(0), "] on ", x.device(), " (from ",
                centered ? "layer_norm / layer_norm_fp8" : "rms_norm / rms_norm_fp8", ")");
  };
  if (centered) check_stat(stats.mean, "stats.mean");
  check_stat(stats.rstd, "stats.rstd");
  if (grad_residual.defined()) {
    TORCH_CHECK(grad_residual.sizes() == x.sizes() && grad_residual.device() == x.device() &&
                    grad_residual.scalar_type() == x.scalar_type(),
                op, ": grad_residual must have x's shape ", x.sizes(), " and dtype ",
                x.scalar_type(), " on ", x.device(), ", got ", grad_residual.scalar_type(), " ",
                grad_residual.sizes(), " on ", grad_residual.device());
  }
  const auto dy = grad_out.to(x.scalar_type()).contiguous();
  const auto dres = grad_residual.defined() ? grad_residual.contiguous() : at::Tensor();
  auto dx = at::empty_like(x);
  at::Tensor dgamma, dbeta;
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    // dgamma and dbeta in the dtype the kernels read gamma in (gamma's own, usually).
    const auto affine = kernel_affine(x, gamma, beta);
    if (affine.gamma.defined()) dgamma = at::empty_like(affine.gamma);
    if (affine.beta.defined()) dbeta = at::empty_like(affine.beta);
    if (!detail::layer_norm_backward_cuda(dy, x, norm, stats.mean, stats.rstd, affine.gamma,
                                          dres, dx, dgamma, dbeta)) {
      auto xf = x.to(at::kFloat);
      if (centered) xf = xf - stats.mean.unsqueeze(1);
      auto xhat = xf * stats.rstd.unsqueeze(1);
      auto dyf = dy.to(at::kFloat);
      auto wdy = affine.gamma.defined() ? dyf * affine.gamma : dyf;
      auto centered_wdy = centered ? wdy - wdy.mean(1, true) : wdy;
      auto dxf = stats.rstd.unsqueeze(1) * (centered_wdy - xhat * (wdy * xhat).mean(1, true));
      dx.copy_(dres.defined() ? dxf + dres.to(at::kFloat) : dxf);
      if (dgamma.defined()) dgamma.copy_((dyf * xhat).sum(0));
      if (dbeta.defined()) dbeta.copy_(dyf.sum(0));
    }
#else
    detail::no_cuda(op);
#endif
  } else {
    auto float_options = x.options().dtype(at::kFloat);
    if (gamma.defined()) dgamma = at::empty({x.size(1)}, float_options);
    if (beta.defined()) dbeta = at::empty({x.size(1)}, float_options);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, x.scalar_type(), "amp8_layer_norm_bwd", [&] {
          layer_norm_backward_cpu_typed<scalar_t>(dy, x, stats, norm, as_float(gamma), dres, dx,
                                                  dgamma, dbeta);
        });
  }
  if (dgamma.defined() && dgamma.scalar_type() != gamma.scalar_type()) {
    dgamma = dgamma.to(gamma.scalar_type());
  }
  if (dbeta.defined() && dbeta.scalar_type() != beta.scalar_type()) {
    dbeta = dbeta.to(beta.scalar_type());
  }
  return {dx, dgamma, dbeta};
}

}  // namespace

const char* normalization_name(Normalization normalization) {
  return normalization == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm";
}

LayerNormResult layer_norm(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                           double eps) {
  return normalize(x, gamma, beta, eps, Normalization::kLayerNorm, "layer_norm");
}

LayerNormFp8Result layer_norm_fp8(const at::Tensor& x, const at::Tensor& gamma,
                                  const at::Tensor& beta, double eps, const at::Tensor& scale,
                                  Fp8Format format, const at::Tensor& amax_out,
                                  bool accumulate_amax, const at::Tensor& out) {
  return normalize_fp8(x, gamma, beta, eps, Normalization::kLayerNorm, scale, format, amax_out,
                       accumulate_amax, out, "layer_norm_fp8");
}

LayerNormGrads layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                   const LayerNormStats& stats, const at::Tensor& gamma,
                                   const at::Tensor& beta, const at::Tensor& grad_residual) {
  return normalize_backward(grad_out, x, stats, gamma, beta, grad_residual,
                            Normalization::kLayerNorm, "layer_norm_backward");
}

LayerNormResult rms_norm(const at::Tensor& x, const at::Tensor& gamma, double eps) {
  return normalize(x, gamma, {}, eps, Normalization::kRMSNorm, "rms_norm");
}

LayerNormFp8Result rms_norm_fp8(const at::Tensor& x, const at::Tensor& gamma, double eps,
                                const at::Tensor& scale, Fp8Format format,
                                const at::Tensor& amax_out, bool accumulate_amax,
                                const at::Tensor& out) {
  return normalize_fp8(x, gamma, {}, eps, Normalization::kRMSNorm, scale, format, amax_out,
                       accumulate_amax, out, "rms_norm_fp8");
}

LayerNormGrads rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                 const LayerNormStats& stats, const at::Tensor& gamma,
                                 const at::Tensor& grad_residual) {
  return normalize_backward(grad_out, x, stats, gamma, {}, grad_residual,
                            Normalization::kRMSNorm, "rms_norm_backward");
}

Fp8Tensor fp8_transpose(const Fp8Tensor& t) {
  TORCH_CHECK(t.defined(), "fp8_transpose: t must be a defined Fp8Tensor");
  TORCH_CHECK(t.data.dim() == 2, "fp8_transpose: t must be 2-D, got shape ", t.sizes());
  const auto in = t.data.contiguous();
  if (!in.is_cuda()) return Fp8Tensor(in.t().contiguous(), t.scale_inv, t.format);
#ifdef AMP8_WITH_CUDA
  auto out = at::empty({in.size(1), in.size(0)}, in.options());
  if (in.numel() > 0) detail::byte_transpose_cuda(in, out);
  return Fp8Tensor(out, t.scale_inv, t.format);
#else
  detail::no_cuda("fp8_transpose");
#endif
}

}  // namespace amp8
