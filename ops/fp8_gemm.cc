#include "ops/fp8_gemm.h"

#include <atomic>

#include "ops/detail/cuda_ops.h"
#include "ops/quantize.h"

namespace amp8 {
namespace {

constexpr std::string_view kOp = "fp8_gemm";

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

at::ScalarType bias_dtype_for(at::ScalarType out_dtype) {
  return out_dtype == at::kHalf ? at::kHalf : at::kBFloat16;
}

void check_operand(const Fp8Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), kOp, ": ", name, " must be defined");
  TORCH_CHECK(t.data.dim() == 2, kOp, ": ", name, " must be 2-D, got shape ", t.data.sizes());
  TORCH_CHECK(t.data.is_contiguous(), kOp, ": ", name, " must be contiguous (row-major)");
}

void check_args(const Fp8Tensor& a, const Fp8Tensor& b, at::ScalarType out_dtype,
                const Fp8GemmOptions& o) {
  check_operand(a, "a");
  check_operand(b, "b");
  TORCH_CHECK(a.device() == b.device(), kOp, ": a and b must be on one device, got ", a.device(),
              " and ", b.device());
  const int64_t m = a.data.size(0), k = a.data.size(1), n = b.data.size(0);
  TORCH_CHECK(b.data.size(1) == k, kOp, ": a [M, K] and b [N, K] must share K, got a ",
              a.data.sizes(), " and b ", b.data.sizes());
  TORCH_CHECK(!(a.format == Fp8Format::kE5M2 && b.format == Fp8Format::kE5M2), kOp,
              ": e5m2 x e5m2 is not supported by FP8 tensor cores; quantize one operand as e4m3");
  TORCH_CHECK(k % 16 == 0 && n % 16 == 0, kOp,
              ": K and N must be multiples of 16 for FP8 GEMMs, got M=", m, " K=", k, " N=", n,
              " (pad them, or run this layer in high precision)");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf ||
                  is_fp8(out_dtype),
              kOp, ": out_dtype must be Float, BFloat16, Half, Float8_e4m3fn or Float8_e5m2, got ",
              out_dtype);
  if (is_fp8(out_dtype)) {
    TORCH_CHECK(m % 16 == 0, kOp, ": an FP8 output needs M divisible by 16, got M=", m);
    TORCH_CHECK(o.out_scale.defined() && o.out_scale.numel() == 1 &&
                    o.out_scale.scalar_type() == at::kFloat && o.out_scale.device() == a.device(),
                kOp, ": an FP8 output needs out_scale, one float32 on ", a.device());
    TORCH_CHECK(!o.accumulate, kOp, ": accumulate is not supported with an FP8 output");
  } else {
    TORCH_CHECK(!o.out_scale.defined() && !o.out_amax.defined(), kOp,
                ": out_scale/out_amax apply to FP8 outputs only, got out_dtype ", out_dtype);
  }
  if (o.out_amax.defined()) {
    TORCH_CHECK(o.out_amax.numel() == 1 && o.out_amax.scalar_type() == at::kFloat &&
                    o.out_amax.device() == a.device(),
                kOp, ": out_amax must be one float32 on ", a.device());
  }
  if (o.bias.defined()) {
    TORCH_CHECK(o.bias.dim() == 1 && o.bias.size(0) == n, kOp, ": bias must have shape [", n,
                "], got ", o.bias.sizes());
    TORCH_CHECK(at::isFloatingType(o.bias.scalar_type()) && !is_fp8(o.bias.scalar_type()), kOp,
                ": bias must be a float tensor, got ", o.bias.scalar_type());
    TORCH_CHECK(o.bias.device() == a.device(), kOp, ": bias must be on ", a.device(), ", got ",
                o.bias.device());
  }
  if (o.accumulate) {
    TORCH_CHECK(o.out.defined(), kOp, ": accumulate needs `out`");
  }
  if (o.residual.defined()) {
    TORCH_CHECK(!o.accumulate, kOp, ": residual and accumulate are exclusive (both are the "
                "GEMM's C)");
    TORCH_CHECK(!is_fp8(out_dtype), kOp, ": residual needs a float32, bfloat16 or float16 output, "
                "got ", out_dtype);
    TORCH_CHECK(o.residual.sizes() == at::IntArrayRef({m, n}) &&
                    o.residual.scalar_type() == out_dtype && o.residual.is_contiguous() &&
                    o.residual.device() == a.device(),
                kOp, ": residual must be a contiguous [", m, ", ", n, "] ", out_dtype,
                " tensor on ", a.device(), ", got ", o.residual.sizes(), " ",
                o.residual.scalar_type(), " on ", o.residual.device());
  }
  if (o.out.defined()) {
    TORCH_CHECK(o.out.sizes() == at::IntArrayRef({m, n}) && o.out.scalar_type() == out_dtype &&
                    o.out.is_contiguous() && o.out.device() == a.device(),
                kOp, ": out must be a contiguous [", m, ", ", n, "] ", out_dtype, " tensor on ",
                a.device(), ", got ", o.out.sizes(), " ", o.out.scalar_type(), " on ",
                o.out.device());
  }
}

at::Tensor fp8_gemm_cpu(const Fp8Tensor& a, const Fp8Tensor& b, at::ScalarType out_dtype,
                        const Fp8GemmOptions& o) {
  // FP8 products are exact in fp32; sums in fp32; then the two dequantization scales.
  auto acc = at::matmul(a.data.to(at::kFloat), b.data.to(at::kFloat).t());
  acc = acc * (a.scale_inv * b.scale_inv);
  // cuBLASLt's order: alpha·A·B + beta·C, then the bias epilogue.
  if (o.residual.defined()) acc = acc + o.residual.to(at::kFloat);
  if (o.bias.defined()) acc = acc + o.bias.to(bias_dtype_for(out_dtype)).to(at::kFloat);
  if (is_fp8(out_dtype)) {
    auto amax = o.out_amax.defined() ? o.out_amax : at::Tensor();
    auto q = quantize(acc, o.out_scale, fp8_format_of(out_dtype), amax);
    if (o.out.defined()) {
      o.out.copy_(q.data);
      return o.out;
    }
    return q.data;
  }
  if (o.accumulate) {
    o.out.copy_((o.out.to(at::kFloat) + acc).to(out_dtype));
    return o.out;
  }
  if (o.out.defined()) {
    o.out.copy_(acc);
    return o.out;
  }
  return acc.to(out_dtype);
}

}  // namespace

namespace {
std::atomic<Fp8GemmAlgoSelection> algo_selection{Fp8GemmAlgoSelection::kHeuristic};
}  // namespace

namespace detail {
std::atomic<int64_t> fp8_gemm_candidates_timed{0};
}  // namespace detail

void set_fp8_gemm_algo_selection(Fp8GemmAlgoSelection selection) { algo_selection = selection; }

Fp8GemmAlgoSelection fp8_gemm_algo_selection() { return algo_selection; }

int64_t fp8_gemm_candidates_timed() { return detail::fp8_gemm_candidates_timed; }

at::Tensor fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, at::ScalarType out_dtype,
                    const Fp8GemmOptions& options) {
  check_args(a, b, out_dtype, options);
  if (a.device().is_cuda()) {
#ifdef AMP8_WITH_CUDA
    Fp8GemmOptions o = options;
    if (o.bias.defined()) o.bias = o.bias.to(bias_dtype_for(out_dtype)).contiguous();
    return detail::fp8_gemm_cuda(a, b, out_dtype, o);
#else
    TORCH_CHECK(false, kOp, ": got CUDA tensors but amp8 was built without CUDA");
#endif
  }
  TORCH_CHECK(a.device().is_cpu(), kOp, ": tensors must be on CPU or CUDA, got ", a.device());
  return fp8_gemm_cpu(a, b, out_dtype, options);
}

}  // namespace amp8
