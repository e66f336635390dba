#include "ops/layer_norm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "ops/quantize.h"
#include "tests/test_util.h"

namespace amp8 {

// How gtest names a Normalization in test names and messages.
void PrintTo(Normalization normalization, std::ostream* os) { *os << normalization_name(normalization); }

namespace {

using testing::BytesEqual;
using testing::ExpectErrorContaining;

struct Tolerance {
  double rtol, atol;
};

// The output is computed in float32 from float32 statistics and rounded once to its dtype:
// float32 keeps ~1e-6 of the normalized value (≈ O(1)), bfloat16/float16 lose half a spacing.
Tolerance tolerance_for(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return {1.0 / 256, 1e-5};
    case at::kHalf:
      return {1.0 / 1024, 1e-5};
    default:
      return {1e-5, 1e-5};
  }
}

// Elementwise |actual - expected| <= atol + rtol·|expected|; reports the worst element.
::testing::AssertionResult AllClose(const at::Tensor& actual, const at::Tensor& expected,
                                    Tolerance tol) {
  auto a = actual.detach().cpu().to(at::kDouble).reshape({-1});
  auto e = expected.detach().cpu().to(at::kDouble).reshape({-1});
  auto excess = (a - e).abs() - (tol.atol + tol.rtol * e.abs());
  const int64_t worst = excess.argmax().item<int64_t>();
  if (excess[worst].item<double>() <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "at flat index " << worst << ": actual " << a[worst].item<double>() << " vs expected "
         << e[worst].item<double>() << " (rtol " << tol.rtol << ", atol " << tol.atol << ")";
}

double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  auto a = actual.detach().cpu().to(at::kDouble);
  auto e = expected.detach().cpu().to(at::kDouble);
  const double norm = e.norm().item<double>();
  // Gradients that vanish in exact arithmetic (hidden size 1: x̂ = 0) are compared absolutely;
  // every other reference here has a norm far above 1.
  return (a - e).norm().item<double>() / std::max(norm, 1.0);
}

struct Fp64Reference {
  at::Tensor out, mean, rstd, grad_input, grad_gamma, grad_beta;
};

// at::layer_norm (at::rms_norm) in float64 with autograd, on the same (rounded) inputs.
Fp64Reference fp64_reference(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                             double eps, const at::Tensor& grad_out,
                             Normalization norm = Normalization::kLayerNorm) {
  auto xd = x.cpu().to(at::kDouble).requires_grad_(true);
  auto gd = gamma.defined() ? gamma.cpu().to(at::kDouble).requires_grad_(true) : at::Tensor();
  auto bd = beta.defined() ? beta.cpu().to(at::kDouble).requires_grad_(true) : at::Tensor();
  const bool rms = norm == Normalization::kRMSNorm;
  auto y = rms ? at::rms_norm(xd, {x.size(1)}, gd, eps) : at::layer_norm(xd, {x.size(1)}, gd, bd, eps);
  Fp64Reference ref;
  ref.out = y.detach();
  if (!rms) ref.mean = xd.detach().mean(1);
  ref.rstd = at::rsqrt((rms ? xd.detach().square().mean(1) : xd.detach().var(1, /*unbiased=*/false)) + eps);
  if (grad_out.defined()) {
    y.backward(grad_out.cpu().to(at::kDouble));
    ref.grad_input = xd.grad();
    if (gd.defined()) ref.grad_gamma = gd.grad();
    if (bd.defined()) ref.grad_beta = bd.grad();
  }
  return ref;
}

// Inputs with a non-zero mean and uneven scale, as activations have.
at::Tensor activation(int64_t rows, int64_t hidden, at::ScalarType dtype, at::Device device) {
  return (at::randn({rows, hidden}) * 3 + 0.5).to(dtype).to(device);
}

using Case = std::tuple<at::ScalarType, int64_t, int64_t>;  // dtype, rows, hidden

// Each test runs for LayerNorm and for RMSNorm (beta undefined: RMSNorm has none).
class LayerNormTest : public testing::SeededTest,
                      public ::testing::WithParamInterface<std::tuple<Normalization, Case>> {
 protected:
  Normalization norm() const { return std::get<0>(GetParam()); }
  const Case& shape() const { return std::get<1>(GetParam()); }
};

// The op under test: layer_norm* or rms_norm* (which has no beta).
LayerNormResult forward(Normalization norm, const at::Tensor& x, const at::Tensor& gamma,
                        const at::Tensor& beta, double eps) {
  return norm == Normalization::kRMSNorm ? rms_norm(x, gamma, eps) : layer_norm(x, gamma, beta, eps);
}

LayerNormFp8Result forward_fp8(Normalization norm, const at::Tensor& x, const at::Tensor& gamma,
                               const at::Tensor& beta, double eps, const at::Tensor& scale,
                               Fp8Format format, const at::Tensor& amax) {
  return norm == Normalization::kRMSNorm ? rms_norm_fp8(x, gamma, eps, scale, format, amax)
                                         : layer_norm_fp8(x, gamma, beta, eps, scale, format, amax);
}

LayerNormGrads backward(Normalization norm, const at::Tensor& grad_out, const at::Tensor& x,
                        const LayerNormStats& stats, const at::Tensor& gamma,
                        const at::Tensor& beta, const at::Tensor& grad_residual = {}) {
  return norm == Normalization::kRMSNorm
             ? rms_norm_backward(grad_out, x, stats, gamma, grad_residual)
             : layer_norm_backward(grad_out, x, stats, gamma, beta, grad_residual);
}

// beta for `norm`: random for LayerNorm, undefined for RMSNorm.
at::Tensor beta_for(Normalization norm, int64_t hidden, at::ScalarType dtype, at::Device device) {
  if (norm == Normalization::kRMSNorm) return {};
  return at::randn({hidden}).to(dtype).to(device);
}

void forward_backward_case(Normalization norm, const Case& c, at::Device device) {
  const auto [dtype, rows, hidden] = c;
  const double eps = 1e-5;
  auto x = activation(rows, hidden, dtype, device);
  auto gamma = (at::rand({hidden}) + 0.5).to(device);
  auto beta = beta_for(norm, hidden, at::kFloat, device);
  auto grad_out = at::randn({rows, hidden}).to(dtype).to(device);
  const auto ref = fp64_reference(x, gamma, beta, eps, grad_out, norm);
  const auto tol = tolerance_for(dtype);

  auto result = forward(norm, x, gamma, beta, eps);
  EXPECT_EQ(result.out.scalar_type(), dtype);
  EXPECT_EQ(result.out.device(), x.device());
  EXPECT_TRUE(AllClose(result.out, ref.out, tol)) << "out";
  if (norm == Normalization::kLayerNorm) {
    EXPECT_TRUE(AllClose(result.stats.mean, ref.mean, {1e-6, 1e-6})) << "mean";
  } else {
    EXPECT_FALSE(result.stats.mean.defined()) << "RMSNorm has no mean";
  }
  EXPECT_TRUE(AllClose(result.stats.rstd, ref.rstd, {1e-5, 0})) << "rstd";

  auto grads = backward(norm, grad_out, x, result.stats, gamma, beta);
  EXPECT_EQ(grads.grad_input.scalar_type(), dtype);
  // dx is rounded once to its dtype; dgamma/dbeta are float32 sums over rows.
  const double dx_bound = dtype == at::kFloat ? 1e-5 : 2 * tol.rtol;
  EXPECT_LE(relative_error(grads.grad_input, ref.grad_input), dx_bound) << "dx";
  EXPECT_LE(relative_error(grads.grad_gamma, ref.grad_gamma), 1e-5) << "dgamma";
  if (beta.defined()) {
    EXPECT_LE(relative_error(grads.grad_beta, ref.grad_beta), 1e-5) << "dbeta";
  } else {
    EXPECT_FALSE(grads.grad_beta.defined());
  }
}

TEST_P(LayerNormTest, ForwardAndBackwardMatchFp64) {
  forward_backward_case(norm(), shape(), at::kCPU);
}

TEST_P(LayerNormTest, ForwardAndBackwardMatchFp64_CUDA) {
  AMP8_REQUIRE_CUDA();
  forward_backward_case(norm(), shape(), at::kCUDA);
}

// A residual's gradient is added to dx before dx's one rounding: on the CPU the bytes of
// round(dx computed from the float32 values + grad_residual) (the float32 backward of the same
// values gives that dx unrounded); on CUDA within the dx bound of forward_backward_case against
// float64 (its block sums run in another order). dgamma and dbeta do not change.
void residual_gradient_case(Normalization norm, const Case& c, at::Device device) {
  const auto [dtype, rows, hidden] = c;
  auto x = activation(rows, hidden, dtype, device);
  auto gamma = (at::rand({hidden}) + 0.5).to(device);
  auto beta = beta_for(norm, hidden, at::kFloat, device);
  auto grad_out = at::randn({rows, hidden}).to(dtype).to(device);
  auto grad_residual = (at::randn({rows, hidden}) * 4).to(dtype).to(device);
  const auto stats = forward(norm, x, gamma, beta, 1e-5).stats;
  const auto without = backward(norm, grad_out, x, stats, gamma, beta);
  const auto with = backward(norm, grad_out, x, stats, gamma, beta, grad_residual);
  EXPECT_EQ(with.grad_input.scalar_type(), dtype);
  EXPECT_TRUE(BytesEqual(with.grad_gamma, without.grad_gamma)) << "dgamma";
  if (beta.defined()) {
    EXPECT_TRUE(BytesEqual(with.grad_beta, without.grad_beta)) << "dbeta";
  }
  if (device.is_cpu()) {
    const auto unrounded =
        backward(norm, grad_out.to(at::kFloat), x.to(at::kFloat), stats, gamma, beta).grad_input;
    EXPECT_TRUE(BytesEqual(with.grad_input, (unrounded + grad_residual.to(at::kFloat)).to(dtype)));
  } else {
    const auto ref = fp64_reference(x, gamma, beta, 1e-5, grad_out, norm);
    const double dx_bound = dtype == at::kFloat ? 1e-5 : 2 * tolerance_for(dtype).rtol;
    EXPECT_LE(relative_error(with.grad_input,
                             ref.grad_input + grad_residual.cpu().to(at::kDouble)),
              dx_bound);
  }
}

TEST_P(LayerNormTest, ResidualGradientIsAddedBeforeTheRounding) {
  residual_gradient_case(norm(), shape(), at::kCPU);
}

TEST_P(LayerNormTest, ResidualGradientIsAddedBeforeTheRounding_CUDA) {
  AMP8_REQUIRE_CUDA();
  residual_gradient_case(norm(), shape(), at::kCUDA);
}

// The FP8 output is the saturating quantization of the float32 output, byte for byte (float32
// input on the CPU, where layer_norm's output is that float32 value), and amax is its max|y|.
TEST_P(LayerNormTest, Fp8OutputIsTheQuantizedOutput) {
  const auto [dtype, rows, hidden] = shape();
  auto x = activation(rows, hidden, at::kFloat, at::kCPU);
  auto gamma = at::rand({hidden}) + 0.5;
  auto beta = beta_for(norm(), hidden, at::kFloat, at::kCPU);
  auto y = forward(norm(), x, gamma, beta, 1e-5).out;
  for (auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto scale = at::full({1}, 37.0f);
    auto amax = at::zeros({1});
    auto q = forward_fp8(norm(), x, gamma, beta, 1e-5, scale, format, amax);
    auto expected = quantize(y, scale, format);
    EXPECT_TRUE(BytesEqual(q.out.data, expected.data)) << fp8_format_name(format);
    EXPECT_TRUE(testing::SameFloat(amax.item<float>(), y.abs().max().item<float>()));
    EXPECT_TRUE(testing::SameFloat(q.out.scale_inv.item<float>(), 1.0f / 37.0f));
    EXPECT_GT(q.out.data.to(at::kFloat).abs().max().item<float>(), 0);
  }
}

// CUDA against the CPU reference: statistics to float32 rounding; FP8 codes equal or one step
// apart (only where y·scale sits on a rounding boundary and the float32 sums differ).
TEST_P(LayerNormTest, Fp8OutputMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto [dtype, rows, hidden] = shape();
  auto x = activation(rows, hidden, dtype, at::kCPU);
  auto gamma = at::rand({hidden}) + 0.5;
  auto beta = beta_for(norm(), hidden, at::kFloat, at::kCPU);
  for (auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto scale = at::full({1}, 21.0f);
    auto amax_cpu = at::zeros({1});
    auto cpu = forward_fp8(norm(), x, gamma, beta, 1e-5, scale, format, amax_cpu);
    auto amax_gpu = at::zeros({1}, at::kCUDA);
    auto gpu = forward_fp8(norm(), x.cuda(), gamma.cuda(), beta.defined() ? beta.cuda() : beta,
                           1e-5, scale.cuda(), format, amax_gpu);
    // Ordered codes: sign-magnitude bytes → integers whose order is the value order.
    auto codes = [](const at::Tensor& data) {
      auto bytes = data.cpu().view(at::kByte).to(at::kInt);
      auto magnitude = bytes.bitwise_and(0x7F);
      return at::where(bytes.ge(0x80), -magnitude, magnitude);
    };
    auto diff = (codes(gpu.out.data) - codes(cpu.out.data)).abs();
    EXPECT_LE(diff.max().item<int>(), 1) << fp8_format_name(format);
    EXPECT_LE(diff.gt(0).sum().item<int64_t>(), std::max<int64_t>(1, x.numel() / 100));
    EXPECT_NEAR(amax_gpu.item<float>(), amax_cpu.item<float>(), 1e-5 * amax_cpu.item<float>());
    if (norm() == Normalization::kLayerNorm) {
      EXPECT_TRUE(AllClose(gpu.stats.mean, cpu.stats.mean, {1e-6, 1e-6}));
    }
    EXPECT_TRUE(AllClose(gpu.stats.rstd, cpu.stats.rstd, {1e-5, 0}));
    EXPECT_TRUE(BytesEqual(gpu.out.scale_inv, cpu.out.scale_inv));
  }
}

// gamma and beta held in a half dtype (as a bf16 model holds them; the CUDA kernels read them
// as they are when that is x's dtype, through float32 copies otherwise, and write dgamma/dbeta
// in it): the same output, statistics and dx as float32 copies of the same values, bit for bit,
// and dgamma/dbeta those float32 sums rounded once. Also gamma and beta of different dtypes.
void half_params_case(Normalization norm, const Case& c, at::Device device) {
  const auto [dtype, rows, hidden] = c;
  auto x = activation(rows, hidden, dtype, device);
  auto grad_out = at::randn({rows, hidden}).to(dtype).to(device);
  auto scale = at::full({1}, 19.0f, device);
  for (auto param_dtype : {at::kBFloat16, at::kHalf}) {
    auto gamma = (at::rand({hidden}) + 0.5).to(param_dtype).to(device);
    for (const bool beta_in_float : {false, true}) {
      if (norm == Normalization::kRMSNorm && beta_in_float) continue;  // no beta
      auto beta = beta_for(norm, hidden, beta_in_float ? at::kFloat : param_dtype, device);
      SCOPED_TRACE(std::string(c10::toString(param_dtype)) +
                   (beta_in_float ? " gamma, float32 beta" : " gamma and beta"));
      auto gamma_f = gamma.to(at::kFloat);
      auto beta_f = beta.defined() ? beta.to(at::kFloat) : beta;
      auto ours = forward(norm, x, gamma, beta, 1e-5);
      auto expected = forward(norm, x, gamma_f, beta_f, 1e-5);
      EXPECT_TRUE(BytesEqual(ours.out, expected.out)) << "out";
      EXPECT_TRUE(BytesEqual(ours.stats.rstd, expected.stats.rstd)) << "rstd";
      auto ours_fp8 = forward_fp8(norm, x, gamma, beta, 1e-5, scale, Fp8Format::kE4M3, {});
      auto expected_fp8 = forward_fp8(norm, x, gamma_f, beta_f, 1e-5, scale, Fp8Format::kE4M3, {});
      EXPECT_TRUE(BytesEqual(ours_fp8.out.data, expected_fp8.out.data)) << "fp8 out";
      auto grads = backward(norm, grad_out, x, ours.stats, gamma, beta);
      auto expected_grads = backward(norm, grad_out, x, expected.stats, gamma_f, beta_f);
      EXPECT_TRUE(BytesEqual(grads.grad_input, expected_grads.grad_input)) << "dx";
      EXPECT_EQ(grads.grad_gamma.scalar_type(), gamma.scalar_type());
      EXPECT_TRUE(BytesEqual(grads.grad_gamma, expected_grads.grad_gamma.to(gamma.scalar_type())))
          << "dgamma";
      if (beta.defined()) {
        EXPECT_EQ(grads.grad_beta.scalar_type(), beta.scalar_type());
        EXPECT_TRUE(BytesEqual(grads.grad_beta, expected_grads.grad_beta.to(beta.scalar_type())))
            << "dbeta";
      }
    }
  }
}

TEST_P(LayerNormTest, HalfParamsGiveTheirFloatValuesResults) {
  half_params_case(norm(), shape(), at::kCPU);
}

TEST_P(LayerNormTest, HalfParamsGiveTheirFloatValuesResults_CUDA) {
  AMP8_REQUIRE_CUDA();
  half_params_case(norm(), shape(), at::kCUDA);
}

// Shapes: odd and prime hidden sizes (scalar path), 16-byte rows (vector path), rows with a
// single element, hidden sizes beyond the fused kernels' register budget (ATen path), and more
// rows than resident blocks, with partly idle warps (each block of the backward walks several
// rows, grid-strided, into the same dgamma/dbeta partial sums).
INSTANTIATE_TEST_SUITE_P(
    Shapes, LayerNormTest,
    ::testing::Combine(::testing::Values(Normalization::kLayerNorm, Normalization::kRMSNorm),
                       ::testing::Values(Case{at::kFloat, 1, 3221}, Case{at::kBFloat16, 1481, 677},
                                         Case{at::kHalf, 2333, 1}, Case{at::kFloat, 37, 64},
                                         Case{at::kBFloat16, 129, 4096}, Case{at::kHalf, 64, 1024},
                                         Case{at::kBFloat16, 7, 12288},
                                         Case{at::kBFloat16, 4099, 1032},
                                         Case{at::kFloat, 3001, 520},
                                         Case{at::kFloat, 5, 20000})),
    [](const ::testing::TestParamInfo<std::tuple<Normalization, Case>>& info) {
      const Case& c = std::get<1>(info.param);
      return std::string(normalization_name(std::get<0>(info.param))) + "_" +
             c10::toString(std::get<0>(c)) + "_" +
             testing::shape_name(std::get<1>(c), std::get<2>(c));
    });

class LayerNormOpTest : public testing::SeededTest {};

TEST_F(LayerNormOpTest, WithoutAffineParameters) {
  auto x = activation(33, 48, at::kFloat, at::kCPU);
  auto grad_out = at::randn({33, 48});
  const auto ref = fp64_reference(x, {}, {}, 1e-6, grad_out);
  auto result = layer_norm(x, {}, {}, 1e-6);
  EXPECT_TRUE(AllClose(result.out, ref.out, tolerance_for(at::kFloat)));
  auto grads = layer_norm_backward(grad_out, x, result.stats, {}, {});
  EXPECT_LE(relative_error(grads.grad_input, ref.grad_input), 1e-5);
  EXPECT_FALSE(grads.grad_gamma.defined());
  EXPECT_FALSE(grads.grad_beta.defined());
}

TEST_F(LayerNormOpTest, AccumulatesAmaxAndWritesIntoAGivenBuffer) {
  auto x = activation(20, 32, at::kFloat, at::kCPU);
  auto y = layer_norm(x, {}, {}, 1e-5).out;
  auto buffer = at::zeros({32, 32}, at::kFloat8_e4m3fn);
  auto amax = at::full({1}, 1000.0f);
  auto q = layer_norm_fp8(x, {}, {}, 1e-5, at::ones({1}), Fp8Format::kE4M3, amax,
                          /*accumulate_amax=*/true, buffer.narrow(0, 0, 20));
  EXPECT_EQ(amax.item<float>(), 1000.0f);  // max(1000, max|y|)
  EXPECT_EQ(q.out.data.data_ptr(), buffer.data_ptr());
  EXPECT_TRUE(
      BytesEqual(buffer.narrow(0, 0, 20), quantize(y, at::ones({1}), Fp8Format::kE4M3).data));
  EXPECT_EQ(buffer.narrow(0, 20, 12).to(at::kFloat).abs().sum().item<float>(), 0.0f);
}

TEST_F(LayerNormOpTest, Fp8TransposeIsAByteTranspose) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 3221},
                            {1481, 677},
                            {2333, 1},
                            {64, 128},
                            {128, 4096},
                            {48, 20}}) {
    auto q = quantize(testing::random_wide({rows, cols}, at::kFloat), at::full({1}, 0.01f),
                      Fp8Format::kE5M2);
    auto t = fp8_transpose(q);
    EXPECT_TRUE(BytesEqual(t.data, q.data.t().contiguous())) << rows << "x" << cols;
    EXPECT_EQ(t.scale_inv.data_ptr(), q.scale_inv.data_ptr());
    if (testing::cuda_available()) {
      auto qg = Fp8Tensor(q.data.cuda(), q.scale_inv.cuda(), q.format);
      EXPECT_TRUE(BytesEqual(fp8_transpose(qg).data, t.data)) << "CUDA " << rows << "x" << cols;
    }
  }
}

TEST_F(LayerNormOpTest, BadArgumentsAreNamed) {
  auto x = at::randn({4, 8});
  ExpectErrorContaining([&] { layer_norm(x, at::ones({7}), {}, 1e-5); },
                        "gamma must have shape [8]");
  ExpectErrorContaining([&] { layer_norm(x, {}, at::ones({8}, at::kInt), 1e-5); },
                        "beta must be float32, bfloat16 or float16");
  ExpectErrorContaining([&] { layer_norm(x, {}, {}, 0.0); }, "eps must be positive");
  ExpectErrorContaining([&] { layer_norm(at::randn({8}), {}, {}, 1e-5); }, "x must be 2-D");
  ExpectErrorContaining([&] { layer_norm(x.to(at::kDouble), {}, {}, 1e-5); },
                        "x must be float32, bfloat16 or float16");
  ExpectErrorContaining(
      [&] {
        layer_norm_fp8(x, {}, {}, 1e-5, at::ones({1}), Fp8Format::kE4M3, {}, false,
                       at::empty({4, 8}, at::kFloat8_e5m2));
      },
      "out must be Float8_e4m3fn for format e4m3, got Float8_e5m2");
  ExpectErrorContaining([&] { layer_norm_fp8(x, {}, {}, 1e-5, at::ones({2}), Fp8Format::kE4M3); },
                        "scale must hold exactly one element");
  auto stats = layer_norm(x, {}, {}, 1e-5).stats;
  ExpectErrorContaining(
      [&] {
        layer_norm_backward(at::randn({4, 9}), x, stats, {}, {});
      },
      "grad_out must have x's shape");
  ExpectErrorContaining(
      [&] {
        layer_norm_backward(at::randn({4, 8}), x, {stats.mean, at::Tensor()}, {}, {});
      },
      "stats.rstd must be float32 [4] on cpu (from layer_norm / layer_norm_fp8)");
  ExpectErrorContaining(
      [&] { layer_norm_backward(at::randn({4, 8}), x, stats, {}, {}, at::randn({8, 4})); },
      "layer_norm_backward: grad_residual must have x's shape [4, 8] and dtype Float on cpu, "
      "got Float [8, 4] on cpu");
  ExpectErrorContaining(
      [&] {
        rms_norm_backward(at::randn({4, 8}), x, rms_norm(x, {}, 1e-5).stats, {},
                          at::ones({4, 8}, at::kBFloat16));
      },
      "rms_norm_backward: grad_residual must have x's shape [4, 8] and dtype Float on cpu, got "
      "BFloat16 [4, 8] on cpu");
  ExpectErrorContaining([&] { rms_norm(x, at::ones({7}), 1e-5); }, "rms_norm: gamma must have shape [8]");
  ExpectErrorContaining(
      [&] { rms_norm_backward(at::randn({4, 8}), x, {at::Tensor(), at::Tensor()}, {}); },
      "rms_norm_backward: stats.rstd must be float32 [4] on cpu (from rms_norm / rms_norm_fp8)");
}

// RMSNorm against its direct formula y = x / √(mean(x²) + eps) · gamma on a hand-sized row.
TEST_F(LayerNormOpTest, RmsNormIsTheDirectFormula) {
  auto x = at::tensor({1.0f, -2.0f, 3.0f, 0.5f, 4.0f}).reshape({1, 5});
  auto gamma = at::tensor({0.5f, 1.0f, 1.5f, 2.0f, -1.0f});
  const double ms = (1.0 + 4.0 + 9.0 + 0.25 + 16.0) / 5.0;
  auto result = rms_norm(x, gamma, 1e-6);
  for (int64_t c = 0; c < 5; ++c) {
    const double expected = x[0][c].item<double>() / std::sqrt(ms + 1e-6) * gamma[c].item<double>();
    EXPECT_NEAR(result.out[0][c].item<double>(), expected, 1e-6 * std::abs(expected)) << c;
  }
  EXPECT_NEAR(result.stats.rstd.item<double>(), 1.0 / std::sqrt(ms + 1e-6), 1e-7);
  // LayerNorm of the same row differs (its mean, 1.3, is removed): the two paths are distinct.
  EXPECT_FALSE(at::allclose(result.out, layer_norm(x, gamma, {}, 1e-6).out, 1e-3, 1e-3));
}

}  // namespace
}  // namespace amp8
