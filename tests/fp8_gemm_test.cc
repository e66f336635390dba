#include "ops/fp8_gemm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ops/quantize.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using ::testing::HasSubstr;
using testing::item;
using testing::relative_error;

// Quantized operand with current scaling, on `device`.
Fp8Tensor operand(int64_t rows, int64_t cols, Fp8Format format, at::Device device) {
  auto x = at::randn({rows, cols}).to(device);
  return quantize_current_scaling(x, format);
}

// fp64 reference of what the tensor cores compute.
at::Tensor reference(const Fp8Tensor& a, const Fp8Tensor& b, const at::Tensor& bias = {}) {
  auto ad = a.data.cpu().to(at::kDouble) * a.scale_inv.cpu().to(at::kDouble);
  auto bd = b.data.cpu().to(at::kDouble) * b.scale_inv.cpu().to(at::kDouble);
  auto y = at::matmul(ad, bd.t());
  if (bias.defined()) y = y + bias.cpu().to(at::kDouble);
  return y;
}

// Per-dtype tolerance of ‖out − ref‖ / ‖ref‖. The products of FP8 values are exact; what
// differs is the sum. On the CPU it is a true fp32 sum (K ≤ 1024: far below 1e-5). Hopper's FP8
// tensor cores keep fewer accumulator bits than fp32 between promotions (about 14 mantissa
// bits, measured in DeepSeek-V3's report, §3.3.2), so the GPU's fp32 output carries an error
// of order 2^-14 per partial sum: 2.5e-4 bounds it. A bf16/fp16 output adds one rounding of
// the result (2^-9 / 2^-12 relative), which dominates on both devices.
double tolerance(at::ScalarType out_dtype, at::Device device) {
  switch (out_dtype) {
    case at::kFloat:
      return device.is_cuda() ? 2.5e-4 : 1e-5;
    case at::kBFloat16:
      return 4e-3;
    case at::kHalf:
      return 5e-4;
    default:
      return 0;
  }
}

struct Case {
  at::ScalarType out_dtype;
  bool bias;
};

class Fp8GemmTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { at::manual_seed(11); }
  void run(at::Device device) {
    const auto [out_dtype, with_bias] = GetParam();
    auto a = operand(48, 160, Fp8Format::kE4M3, device);
    auto b = operand(96, 160, Fp8Format::kE5M2, device);
    Fp8GemmOptions options;
    at::Tensor bias;
    if (with_bias) options.bias = bias = at::randn({96}).to(at::kBFloat16).to(device);
    auto y = fp8_gemm(a, b, out_dtype, options);
    EXPECT_EQ(y.scalar_type(), out_dtype);
    EXPECT_EQ(y.sizes(), (at::IntArrayRef{48, 96}));
    const double err = relative_error(y, reference(a, b, bias));
    EXPECT_LE(err, tolerance(out_dtype, device)) << out_dtype << " bias=" << with_bias;

    // Accumulate into an existing output.
    auto start = at::randn({48, 96}).to(out_dtype).to(device);
    Fp8GemmOptions acc = options;
    acc.out = start.clone();
    acc.accumulate = true;
    auto z = fp8_gemm(a, b, out_dtype, acc);
    EXPECT_EQ(z.data_ptr(), acc.out.data_ptr());
    const double acc_err = relative_error(z, reference(a, b, bias) + start.cpu().to(at::kDouble));
    EXPECT_LE(acc_err, tolerance(out_dtype, device)) << "accumulate " << out_dtype;

    // A residual added by the GEMM (C at beta = 1, another tensor than the output): scaled up
    // so that a residual left out, or added twice, moves the result far past the bound.
    Fp8GemmOptions with_residual = options;
    with_residual.residual = (at::randn({48, 96}) * 4).to(out_dtype).to(device);
    auto r = fp8_gemm(a, b, out_dtype, with_residual);
    EXPECT_NE(r.data_ptr(), with_residual.residual.data_ptr());
    const double residual_err = relative_error(
        r, reference(a, b, bias) + with_residual.residual.cpu().to(at::kDouble));
    EXPECT_LE(residual_err, tolerance(out_dtype, device)) << "residual " << out_dtype;
    // The residual may be `out` itself (out += A·Bᵀ + bias, C = D); under the measured choice
    // its candidates must then not write `out` before the real launch reads it.
    Fp8GemmOptions in_place = options;
    in_place.out = start.clone();
    in_place.residual = in_place.out;
    auto w = fp8_gemm(a, b, out_dtype, in_place);
    EXPECT_EQ(w.data_ptr(), in_place.out.data_ptr());
    EXPECT_LE(relative_error(w, reference(a, b, bias) + start.cpu().to(at::kDouble)),
              tolerance(out_dtype, device))
        << "residual is out " << out_dtype;
  }
};

TEST_P(Fp8GemmTest, MatchesFp64Reference) { run(at::kCPU); }

TEST_P(Fp8GemmTest, MatchesFp64Reference_CUDA) {
  AMP8_REQUIRE_CUDA();
  run(at::kCUDA);
}

// The measured algorithm gives the heuristic's results within the same bounds, accumulating too:
// the timed launches write a scratch output, not `out` (into `out` they would add A·Bᵀ again).
TEST_P(Fp8GemmTest, FastestMeasuredAlgoMatchesFp64Reference_CUDA) {
  AMP8_REQUIRE_CUDA();
  const Fp8GemmAlgoSelectionGuard measured(Fp8GemmAlgoSelection::kFastestMeasured);
  run(at::kCUDA);
}

INSTANTIATE_TEST_SUITE_P(OutputDtypes, Fp8GemmTest,
                         ::testing::Values(Case{at::kFloat, false}, Case{at::kFloat, true},
                                           Case{at::kBFloat16, false}, Case{at::kBFloat16, true},
                                           Case{at::kHalf, false}, Case{at::kHalf, true}),
                         [](const auto& info) {
                           return std::string(c10::toString(info.param.out_dtype)) +
                                  (info.param.bias ? "_bias" : "");
                         });

void fp8_output_case(at::Device device) {
  at::manual_seed(5);
  auto a = operand(64, 128, Fp8Format::kE4M3, device);
  auto b = operand(32, 128, Fp8Format::kE4M3, device);
  auto ref = reference(a, b);
  const float ref_amax = ref.abs().max().item<float>();
  Fp8GemmOptions options;
  options.out_scale = at::full({1}, 448.0f / ref_amax * 0.5f).to(device);
  options.out_amax = at::zeros({1}).to(device);
  auto y = fp8_gemm(a, b, at::kFloat8_e4m3fn, options);
  EXPECT_EQ(y.scalar_type(), at::kFloat8_e4m3fn);
  // amax of the fp32 result before scaling: exact sums on CPU, Hopper's accumulator on GPU.
  EXPECT_NEAR(item(options.out_amax), ref_amax, ref_amax * tolerance(at::kFloat, device));
  auto deq = y.to(at::kFloat).cpu() / options.out_scale.cpu();
  // One E4M3 rounding of the result: relative error per element ≤ 2^-4.
  EXPECT_LE(relative_error(deq, ref), 1.0 / 16);
}

TEST(Fp8GemmOutputTest, Fp8OutputWithScaleAndAmax) { fp8_output_case(at::kCPU); }

TEST(Fp8GemmOutputTest, Fp8OutputWithScaleAndAmax_CUDA) {
  AMP8_REQUIRE_CUDA();
  fp8_output_case(at::kCUDA);
}

// Restores PyTorch's deterministic-algorithms setting when a scope ends.
class DeterministicAlgorithmsGuard {
 public:
  explicit DeterministicAlgorithmsGuard(bool on)
      : on_(at::globalContext().deterministicAlgorithms()),
        warn_only_(at::globalContext().deterministicAlgorithmsWarnOnly()) {
    at::globalContext().setDeterministicAlgorithms(on, false);
  }
  ~DeterministicAlgorithmsGuard() { at::globalContext().setDeterministicAlgorithms(on_, warn_only_); }

 private:
  bool on_, warn_only_;
};

// At shapes with several candidates (1040 rows: not a multiple of the tiles) the measured choice
// times them once per configuration and choice: none under the heuristic, some when measured,
// none at the next call, none under deterministic algorithms, some again once those are off.
// Accumulating, the result holds A·Bᵀ once (the timed launches write a scratch output).
TEST(Fp8GemmAlgoSelectionTest, FastestMeasuredTimesCandidatesOncePerConfiguration_CUDA) {
  AMP8_REQUIRE_CUDA();
  at::manual_seed(17);
  auto a = operand(1040, 768, Fp8Format::kE4M3, at::kCUDA);
  auto b = operand(1536, 768, Fp8Format::kE5M2, at::kCUDA);
  const auto start = at::randn({1040, 1536}).to(at::kCUDA);
  const auto expected = reference(a, b) + start.cpu().to(at::kDouble);
  Fp8GemmOptions options;
  options.accumulate = true;
  auto accumulate = [&] {
    options.out = start.clone();
    return fp8_gemm(a, b, at::kFloat, options);
  };
  const auto before = fp8_gemm_candidates_timed();
  {
    const Fp8GemmAlgoSelectionGuard heuristic(Fp8GemmAlgoSelection::kHeuristic);
    EXPECT_LE(relative_error(accumulate(), expected), tolerance(at::kFloat, at::kCUDA));
    EXPECT_EQ(fp8_gemm_candidates_timed(), before);
  }
  const Fp8GemmAlgoSelectionGuard measured(Fp8GemmAlgoSelection::kFastestMeasured);
  EXPECT_LE(relative_error(accumulate(), expected), tolerance(at::kFloat, at::kCUDA));
  const auto timed = fp8_gemm_candidates_timed();
  EXPECT_GE(timed, before + 2) << "cuBLASLt offered one candidate at 1040x768x1536, or none was timed";
  EXPECT_LE(relative_error(accumulate(), expected), tolerance(at::kFloat, at::kCUDA));
  EXPECT_EQ(fp8_gemm_candidates_timed(), timed);

  auto c = operand(1040, 896, Fp8Format::kE4M3, at::kCUDA);
  auto d = operand(1536, 896, Fp8Format::kE4M3, at::kCUDA);
  {
    const DeterministicAlgorithmsGuard deterministic(true);
    EXPECT_LE(relative_error(fp8_gemm(c, d, at::kFloat), reference(c, d)), tolerance(at::kFloat, at::kCUDA));
    EXPECT_EQ(fp8_gemm_candidates_timed(), timed);
  }
  EXPECT_LE(relative_error(fp8_gemm(c, d, at::kFloat), reference(c, d)), tolerance(at::kFloat, at::kCUDA));
  EXPECT_GE(fp8_gemm_candidates_timed(), timed + 2);
}

// An FP8 output under the measured choice: the candidates write `out` and the amax, and the last
// launch leaves the scaled result and max|A·Bᵀ| there.
TEST(Fp8GemmAlgoSelectionTest, Fp8OutputAndAmaxUnderTheMeasuredChoice_CUDA) {
  AMP8_REQUIRE_CUDA();
  at::manual_seed(19);
  const Fp8GemmAlgoSelectionGuard measured(Fp8GemmAlgoSelection::kFastestMeasured);
  auto a = operand(1040, 640, Fp8Format::kE4M3, at::kCUDA);
  auto b = operand(1536, 640, Fp8Format::kE4M3, at::kCUDA);
  const auto ref = reference(a, b);
  const float ref_amax = ref.abs().max().item<float>();
  Fp8GemmOptions options;
  options.out_scale = at::full({1}, 448.0f / ref_amax * 0.5f).to(at::kCUDA);
  options.out_amax = at::zeros({1}).to(at::kCUDA);
  const auto before = fp8_gemm_candidates_timed();
  auto y = fp8_gemm(a, b, at::kFloat8_e4m3fn, options);
  EXPECT_GE(fp8_gemm_candidates_timed(), before + 2);
  EXPECT_NEAR(item(options.out_amax), ref_amax, ref_amax * tolerance(at::kFloat, at::kCUDA));
  EXPECT_LE(relative_error(y.to(at::kFloat).cpu() / options.out_scale.cpu(), ref), 1.0 / 16);
}

TEST(Fp8GemmAlgoSelectionTest, TheChoiceIsKeptUntilChanged) {
  const Fp8GemmAlgoSelectionGuard heuristic(Fp8GemmAlgoSelection::kHeuristic);
  EXPECT_EQ(fp8_gemm_algo_selection(), Fp8GemmAlgoSelection::kHeuristic);
  {
    const Fp8GemmAlgoSelectionGuard measured(Fp8GemmAlgoSelection::kFastestMeasured);
    EXPECT_EQ(fp8_gemm_algo_selection(), Fp8GemmAlgoSelection::kFastestMeasured);
  }
  EXPECT_EQ(fp8_gemm_algo_selection(), Fp8GemmAlgoSelection::kHeuristic);
}

TEST(Fp8GemmScaledMmTest, MatchesScaledMm_CUDA) {
  AMP8_REQUIRE_CUDA();
  at::manual_seed(9);
  for (auto [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{256, 512, 384},
                         {1024, 1024, 1024},
                         {16, 4096, 2048}}) {
    for (bool fast : {false, true}) {
      for (auto out_dtype : {at::kBFloat16, at::kFloat}) {
        auto a = operand(m, k, Fp8Format::kE4M3, at::kCUDA);
        auto b = operand(n, k, Fp8Format::kE4M3, at::kCUDA);
        // _scaled_mm takes a bias only for 16-bit outputs.
        at::Tensor bias;
        if (out_dtype == at::kBFloat16) {
          bias = at::randn({n}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
        }
        Fp8GemmOptions options;
        options.use_fast_accum = fast;
        options.bias = bias;
        auto ours = fp8_gemm(a, b, out_dtype, options);
        auto theirs =
            at::_scaled_mm(a.data, b.data.t(), a.scale_inv, b.scale_inv,
                           bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                           std::nullopt, out_dtype, fast);
        // Same library, same inputs: equal up to cuBLASLt's choice of accumulation order.
        EXPECT_LE(relative_error(ours, theirs), out_dtype == at::kFloat ? 1e-6 : 4e-3)
            << m << "x" << k << "x" << n << " fast=" << fast << " " << out_dtype;
      }
    }
  }
}

// Operands and outputs at 16-byte offsets into larger buffers (views, as a narrowed tensor is),
// after the same shape ran on 256-byte aligned ones: cuBLASLt must not reuse an algorithm chosen
// for the aligned pointers (its heuristic assumes 256-byte alignment unless told otherwise).
TEST(Fp8GemmAlignmentTest, OffsetOperandsMatchTheReference_CUDA) {
  AMP8_REQUIRE_CUDA();
  at::manual_seed(13);
  const int64_t m = 272, k = 512, n = 384;
  auto a = operand(m, k, Fp8Format::kE4M3, at::kCUDA);
  auto b = operand(n, k, Fp8Format::kE4M3, at::kCUDA);
  for (auto out_dtype : {at::kBFloat16, at::kFloat}) {
    const double bound = tolerance(out_dtype, at::kCUDA);
    EXPECT_LE(relative_error(fp8_gemm(a, b, out_dtype), reference(a, b)), bound);
    // An FP8 matrix `offset` bytes into a buffer; an output `offset` bytes in likewise.
    auto at_offset = [](const Fp8Tensor& t, int64_t offset) {
      auto buffer = at::zeros({t.data.numel() + 256}, t.data.options());
      auto view = buffer.narrow(0, offset, t.data.numel()).view(t.data.sizes());
      view.copy_(t.data);
      return Fp8Tensor(view, t.scale_inv, t.format);
    };
    for (int64_t offset : {16, 48, 144}) {
      const auto a_off = at_offset(a, offset), b_off = at_offset(b, offset + 32);
      ASSERT_NE(reinterpret_cast<uintptr_t>(a_off.data.const_data_ptr()) % 256, 0u);
      const int64_t out_offset = offset / at::elementSize(out_dtype);
      auto out_buffer = at::zeros({m * n + 256}, at::TensorOptions().dtype(out_dtype).device(at::kCUDA));
      Fp8GemmOptions options;
      options.out = out_buffer.narrow(0, out_offset, m * n).view({m, n});
      const auto y = fp8_gemm(a_off, b_off, out_dtype, options);
      EXPECT_LE(relative_error(y, reference(a, b)), bound) << out_dtype << " offset " << offset;
      // Accumulating reads C at the same offset.
      const auto start = y.clone();
      options.accumulate = true;
      fp8_gemm(a_off, b_off, out_dtype, options);
      EXPECT_LE(relative_error(options.out, reference(a, b) + start.cpu().to(at::kDouble)), bound)
          << "accumulate " << out_dtype << " offset " << offset;
    }
  }
}

// fp16 loss scaling relies on overflowing gradients becoming inf: an FP8 weight's wgrad GEMM
// writes (and, in a data-parallel bucket, accumulates into) an fp16 main_grad directly, so an
// fp16 output too large for fp16 must be inf, not saturated at 65504.
void fp16_overflow_case(at::Device device) {
  const auto e4m3 = at::TensorOptions().dtype(at::kFloat8_e4m3fn).device(device);
  const auto one = at::ones({}, at::TensorOptions().device(device));
  const Fp8Tensor a(at::full({16, 32}, 448.0, e4m3), one, Fp8Format::kE4M3);
  const Fp8Tensor b(at::full({16, 32}, 448.0, e4m3), one, Fp8Format::kE4M3);
  // Every element is 32 · 448² ≈ 6.4e6 > 65504.
  const auto written = fp8_gemm(a, b, at::kHalf);
  EXPECT_TRUE(written.isinf().all().item<bool>()) << written.to(at::kFloat).max().item<float>();
  Fp8GemmOptions accumulate;
  accumulate.out = at::full({16, 16}, 1.0, at::TensorOptions().dtype(at::kHalf).device(device));
  accumulate.accumulate = true;
  fp8_gemm(a, b, at::kHalf, accumulate);
  EXPECT_TRUE(accumulate.out.isinf().all().item<bool>())
      << accumulate.out.to(at::kFloat).max().item<float>();
}

TEST(Fp8GemmOutputTest, Fp16OutputOverflowsToInf) { fp16_overflow_case(at::kCPU); }

TEST(Fp8GemmOutputTest, Fp16OutputOverflowsToInf_CUDA) {
  AMP8_REQUIRE_CUDA();
  fp16_overflow_case(at::kCUDA);
}

TEST(Fp8GemmErrorsTest, BadShapesAndOptionsAreNamed) {
  auto expect_error = [](auto&& fn, const std::string& text) {
    testing::ExpectErrorContaining(fn, text);
  };
  auto a = operand(8, 32, Fp8Format::kE4M3, at::kCPU);
  auto b = operand(16, 32, Fp8Format::kE4M3, at::kCPU);
  expect_error([&] { fp8_gemm(a, operand(16, 48, Fp8Format::kE4M3, at::kCPU), at::kFloat); },
               "a [M, K] and b [N, K] must share K");
  expect_error(
      [&] {
        fp8_gemm(operand(8, 24, Fp8Format::kE4M3, at::kCPU),
                 operand(16, 24, Fp8Format::kE4M3, at::kCPU), at::kFloat);
      },
      "K and N must be multiples of 16 for FP8 GEMMs, got M=8 K=24 N=16");
  expect_error(
      [&] {
        fp8_gemm(operand(8, 32, Fp8Format::kE5M2, at::kCPU),
                 operand(16, 32, Fp8Format::kE5M2, at::kCPU), at::kFloat);
      },
      "e5m2 x e5m2 is not supported");
  expect_error([&] { fp8_gemm(a, b, at::kDouble); }, "out_dtype must be Float, BFloat16, Half");
  expect_error(
      [&] { fp8_gemm(operand(16, 32, Fp8Format::kE4M3, at::kCPU), b, at::kFloat8_e4m3fn); },
      "an FP8 output needs out_scale");
  Fp8GemmOptions bad_bias;
  bad_bias.bias = at::ones({15});
  expect_error([&] { fp8_gemm(a, b, at::kFloat, bad_bias); },
               "bias must have shape [16], got [15]");
  Fp8GemmOptions no_out;
  no_out.accumulate = true;
  expect_error([&] { fp8_gemm(a, b, at::kFloat, no_out); }, "accumulate needs `out`");
  Fp8GemmOptions wrong_out;
  wrong_out.out = at::zeros({8, 16}, at::kHalf);
  expect_error([&] { fp8_gemm(a, b, at::kFloat, wrong_out); },
               "out must be a contiguous [8, 16] Float tensor");
  Fp8GemmOptions wrong_residual;
  wrong_residual.residual = at::zeros({8, 16}, at::kBFloat16);
  expect_error([&] { fp8_gemm(a, b, at::kFloat, wrong_residual); },
               "residual must be a contiguous [8, 16] Float tensor on cpu, got [8, 16] BFloat16");
  wrong_residual.residual = at::zeros({16, 8}).t();
  expect_error([&] { fp8_gemm(a, b, at::kFloat, wrong_residual); },
               "residual must be a contiguous [8, 16] Float tensor");
  Fp8GemmOptions residual_and_accumulate;
  residual_and_accumulate.residual = at::zeros({8, 16});
  residual_and_accumulate.out = at::zeros({8, 16});
  residual_and_accumulate.accumulate = true;
  expect_error([&] { fp8_gemm(a, b, at::kFloat, residual_and_accumulate); },
               "residual and accumulate are exclusive");
  Fp8GemmOptions fp8_residual;
  fp8_residual.residual = at::zeros({8, 16});
  fp8_residual.out_scale = at::ones({1});
  expect_error(
      [&] { fp8_gemm(operand(16, 32, Fp8Format::kE4M3, at::kCPU), b, at::kFloat8_e4m3fn, fp8_residual); },
      "residual needs a float32, bfloat16 or float16 output");
}

}  // namespace
}  // namespace amp8
