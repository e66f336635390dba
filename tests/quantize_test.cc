#include "ops/quantize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using testing::ExpectErrorContaining;
using ::testing::HasSubstr;
using testing::item;
using testing::SameFloat;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

at::Tensor scalar(float v) { return at::full({1}, v, at::kFloat); }

std::vector<float> dequantized(const Fp8Tensor& t) {
  auto values = t.data.to(at::kFloat).contiguous();
  return std::vector<float>(values.data_ptr<float>(), values.data_ptr<float>() + values.numel());
}

class QuantizeTest : public testing::SeededTest {};

TEST_F(QuantizeTest, E4M3SaturatesAt448) {
  auto x = at::tensor({447.0f, 448.0f, 449.0f, -1e6f, 1e6f, 464.0f, -447.0f});
  auto q = quantize(x, scalar(1.0f), Fp8Format::kE4M3);
  // 447 rounds to 448 (E4M3's spacing is 32 there); everything larger clamps to ±448.
  EXPECT_THAT(dequantized(q),
              ::testing::ElementsAre(448.0f, 448.0f, 448.0f, -448.0f, 448.0f, 448.0f, -448.0f));
}

TEST_F(QuantizeTest, E5M2SaturatesAt57344) {
  auto x = at::tensor({57344.0f, 60000.0f, 61440.0f, -1e9f, 49152.0f});
  auto q = quantize(x, scalar(1.0f), Fp8Format::kE5M2);
  // A plain cast would round 61440 (the midpoint to 65536) up to infinity; we clamp first.
  EXPECT_THAT(dequantized(q),
              ::testing::ElementsAre(57344.0f, 57344.0f, 57344.0f, -57344.0f, 49152.0f));
}

TEST_F(QuantizeTest, NonFiniteValues) {
  auto x = at::tensor({kNaN, -kNaN, kInf, -kInf});
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto amax = at::zeros({1});
    auto q = quantize(x, scalar(2.0f), format, amax);
    auto v = dequantized(q);
    EXPECT_TRUE(std::isnan(v[0])) << format;
    EXPECT_TRUE(std::isnan(v[1])) << format;
    EXPECT_EQ(v[2], fp8_max(format)) << format;  // infinities saturate
    EXPECT_EQ(v[3], -fp8_max(format)) << format;
    EXPECT_TRUE(std::isnan(item(amax))) << "a NaN in x must show in amax";
  }
  auto amax = at::zeros({1});
  quantize(at::tensor({1.0f, -kInf}), scalar(1.0f), Fp8Format::kE4M3, amax);
  EXPECT_EQ(item(amax), kInf);
}

TEST_F(QuantizeTest, ScaleIsAppliedBeforeRoundingToNearestEven) {
  // 1 * 100 = 100 lies halfway between 96 and 104 (spacing 8 in [64, 128)): ties to even, 96.
  // 1.01 * 100 = 101 rounds to 104 after the multiply; 3 * 100 = 300 -> 288 (spacing 32);
  // -0.5 * 100 = -50 ties between -48 and -52 (spacing 4): even mantissa, -48.
  auto x = at::tensor({1.0f, 1.01f, 3.0f, -0.5f});
  auto q = quantize(x, scalar(100.0f), Fp8Format::kE4M3);
  EXPECT_THAT(dequantized(q), ::testing::ElementsAre(96.0f, 104.0f, 288.0f, -48.0f));
  EXPECT_EQ(item(q.scale_inv), 1.0f / 100.0f);
}

TEST_F(QuantizeTest, Denormals) {
  // E4M3's smallest subnormal is 2^-9, E5M2's 2^-16. Half of it ties to zero (even);
  // three quarters rounds up to it; the subnormal itself is exact.
  const float e4 = std::ldexp(1.0f, -9), e5 = std::ldexp(1.0f, -16);
  auto q4 =
      quantize(at::tensor({e4, e4 / 2, e4 * 0.75f, 3 * e4, -e4}), scalar(1.0f), Fp8Format::kE4M3);
  EXPECT_THAT(dequantized(q4), ::testing::ElementsAre(e4, 0.0f, e4, 3 * e4, -e4));
  auto q5 = quantize(at::tensor({e5, e5 / 2, e5 * 0.75f, 3 * e5}), scalar(1.0f), Fp8Format::kE5M2);
  EXPECT_THAT(dequantized(q5), ::testing::ElementsAre(e5, 0.0f, e5, 3 * e5));
  // A float32 subnormal input (3 * 2^-140) scaled by 2^126 into E5M2's normal range.
  const float tiny = 3 * std::ldexp(1.0f, -140);
  ASSERT_EQ(std::fpclassify(tiny), FP_SUBNORMAL);
  auto q = quantize(at::tensor({tiny}), scalar(std::ldexp(1.0f, 126)), Fp8Format::kE5M2);
  EXPECT_EQ(dequantized(q)[0], 3 * std::ldexp(1.0f, -14));
}

TEST_F(QuantizeTest, EveryRepresentableValueRoundTrips) {
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto codes = at::arange(256, at::kInt).to(at::kByte).view(fp8_dtype(format));
    auto values = codes.to(at::kFloat);
    auto finite = at::isfinite(values);
    auto q = quantize(values, scalar(1.0f), format);
    auto expected =
        at::where(finite, codes.view(at::kByte), at::full_like(codes.view(at::kByte), 0));
    auto actual =
        at::where(finite, q.data.view(at::kByte), at::full_like(codes.view(at::kByte), 0));
    EXPECT_TRUE(BytesEqual(actual, expected)) << format;
  }
}

TEST_F(QuantizeTest, AmaxIsTakenBeforeScalingIntoTheGivenSlot) {
  auto x = testing::random_wide({37, 53}, at::kFloat);
  auto history = at::full({4, 3}, 7.0f);
  auto slot = history[0][1];
  quantize(x, scalar(0.001f), Fp8Format::kE4M3, slot);
  EXPECT_EQ(item(history[0][1]), x.abs().max().item<float>());
  // Every other entry is untouched.
  history[0][1] = 7.0f;
  EXPECT_TRUE(BytesEqual(history, at::full({4, 3}, 7.0f)));
}

TEST_F(QuantizeTest, AccumulatedAmaxIsTheMaxOfSlotAndTensor) {
  auto x = testing::random_wide({33, 17}, at::kBFloat16);
  const float m = x.to(at::kFloat).abs().max().item<float>();
  for (float before : {0.0f, m / 2, m * 2}) {
    auto slot = at::full({1}, before);
    cast_transpose(x, scalar(1.0f), Fp8Format::kE4M3, slot, /*accumulate_amax=*/true);
    EXPECT_EQ(item(slot), std::max(before, m)) << "slot held " << before;
    auto slot2 = at::full({1}, before);
    quantize(x, scalar(1.0f), Fp8Format::kE5M2, slot2, /*accumulate_amax=*/true);
    EXPECT_EQ(item(slot2), std::max(before, m));
  }
  auto nan_slot = at::full({1}, kNaN);
  quantize(x, scalar(1.0f), Fp8Format::kE4M3, nan_slot, true);
  EXPECT_TRUE(std::isnan(item(nan_slot))) << "a NaN already recorded this step stays";
  auto overwritten = at::full({1}, m * 2);
  quantize(x, scalar(1.0f), Fp8Format::kE4M3, overwritten);
  EXPECT_EQ(item(overwritten), m) << "without accumulate the slot is overwritten";
}

TEST_F(QuantizeTest, HalfInputsQuantizeLikeTheirFloatValues) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    auto x = testing::random_wide({129, 31}, dtype);
    for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      auto a1 = at::zeros({1}), a2 = at::zeros({1});
      auto from_half = quantize(x, scalar(3.0f), format, a1);
      auto from_float = quantize(x.to(at::kFloat), scalar(3.0f), format, a2);
      EXPECT_TRUE(BytesEqual(from_half.data, from_float.data)) << dtype << " " << format;
      EXPECT_TRUE(SameFloat(item(a1), item(a2)));
    }
  }
}

TEST_F(QuantizeTest, DequantizeErrorIsWithinHalfAnUlp) {
  // Relative rounding error of a normal value is at most 2^-(mantissa bits + 1).
  auto x = testing::random_wide({1000}, at::kFloat) * 0.01;
  for (auto [format, bound] :
       {std::pair{Fp8Format::kE4M3, 1.0 / 16}, std::pair{Fp8Format::kE5M2, 1.0 / 8}}) {
    auto scale = scalar(fp8_max(format) / x.abs().max().item<float>());
    auto q = quantize(x, scale, format);
    auto relative = ((q.dequantize() - x).abs() / x.abs());
    // Elements that land in FP8's subnormal range have absolute, not relative, error.
    auto normal = (x.abs() * scale) >=
                  (format == Fp8Format::kE4M3 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -14));
    EXPECT_LE(relative.masked_select(normal).max().item<double>(), bound) << format;
  }
}

TEST_F(QuantizeTest, AmaxOp) {
  auto x = testing::random_wide({3221}, at::kBFloat16);
  EXPECT_EQ(item(compute_amax(x)), x.to(at::kFloat).abs().max().item<float>());
  EXPECT_TRUE(std::isnan(item(compute_amax(at::tensor({1.0f, kNaN, 2.0f})))));
}

TEST_F(QuantizeTest, CurrentScaling) {
  auto x = at::tensor({0.5f, -2.0f, 1.0f});
  auto amax = at::zeros({1}), scale = at::zeros({1});
  auto q = quantize_current_scaling(x, Fp8Format::kE4M3, /*margin=*/1, amax, scale);
  EXPECT_EQ(item(amax), 2.0f);
  EXPECT_EQ(item(scale), 448.0f / 2.0f / 2.0f);
  EXPECT_EQ(item(q.scale_inv), 1.0f / 112.0f);
  EXPECT_THAT(dequantized(q), ::testing::ElementsAre(56.0f, -224.0f, 112.0f));
  // All zeros: amax 0, so the scale falls back to 1.
  auto zq = quantize_current_scaling(at::zeros({5}), Fp8Format::kE5M2, 0, amax, scale);
  EXPECT_EQ(item(scale), 1.0f);
  EXPECT_EQ(item(zq.scale_inv), 1.0f);
  // The largest element lands exactly on fp8_max.
  auto y = testing::random_wide({777}, at::kFloat);
  auto yq = quantize_current_scaling(y, Fp8Format::kE5M2);
  EXPECT_EQ(yq.data.to(at::kFloat).abs().max().item<float>(), 57344.0f);
}

// Into a caller's buffer (a view into a flat parameter buffer, as the distributed optimizer
// writes FP8 weights): the same codes as a new tensor, the bytes around the view untouched.
TEST_F(QuantizeTest, IntoAViewOfABuffer) {
  auto x = testing::random_wide({7, 13}, at::kFloat);
  auto buffer = at::full({200}, 0.5f).to(at::kFloat8_e4m3fn);
  auto view = buffer.narrow(0, 50, 91);
  auto q = quantize(x, scalar(3.0f), Fp8Format::kE4M3, {}, false, view);
  auto expected = quantize(x, scalar(3.0f), Fp8Format::kE4M3);
  EXPECT_EQ(q.data.sizes(), x.sizes());
  EXPECT_EQ(q.data.data_ptr(), view.data_ptr());
  EXPECT_TRUE(BytesEqual(view, expected.data.reshape({-1})));
  EXPECT_TRUE(BytesEqual(buffer.narrow(0, 0, 50), at::full({50}, 0.5f).to(at::kFloat8_e4m3fn)));
  EXPECT_TRUE(BytesEqual(buffer.narrow(0, 141, 59), at::full({59}, 0.5f).to(at::kFloat8_e4m3fn)));
  testing::ExpectErrorContaining(
      [&] { quantize(x, scalar(3.0f), Fp8Format::kE5M2, {}, false, view); },
      "quantize: out must be a contiguous Float8_e5m2 tensor of 91 elements on cpu, got "
      "Float8_e4m3fn [91] on cpu");
  testing::ExpectErrorContaining(
      [&] { quantize(x, scalar(3.0f), Fp8Format::kE4M3, {}, false, buffer.narrow(0, 0, 90)); },
      "quantize: out must be a contiguous Float8_e4m3fn tensor of 91 elements");
}

// Many tensors, each with the scale its index picks (shared by some), written into views of one
// buffer as the distributed optimizer writes its FP8 weight shards: the bytes quantize() writes
// for each, and nothing between the views touched.
TEST_F(QuantizeTest, QuantizeManyIsQuantizeOfEachWithItsScale) {
  const std::vector<int64_t> sizes = {1, 13, 4097, 300, 29};
  const std::vector<int64_t> scale_index = {2, 0, 2, 1, 3};
  auto scales = at::tensor({0.5f, 3.0f, 40.0f, 1e-3f});
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    std::vector<at::Tensor> xs, outs;
    auto buffer = at::full({5000}, 0.5f).to(at::kFloat8_e5m2);
    int64_t offset = 3;
    for (auto n : sizes) {
      xs.push_back(testing::random_wide({n}, dtype));
      outs.push_back(buffer.narrow(0, offset, n));
      offset += n + 2;
    }
    quantize_many(xs, scales, scale_index, Fp8Format::kE5M2, outs);
    offset = 3;
    for (size_t i = 0; i < xs.size(); ++i) {
      auto expected = quantize(xs[i], scales.narrow(0, scale_index[i], 1), Fp8Format::kE5M2);
      EXPECT_TRUE(BytesEqual(outs[i], expected.data)) << "tensor " << i;
      EXPECT_TRUE(BytesEqual(buffer.narrow(0, offset - (i == 0 ? 3 : 2), i == 0 ? 3 : 2),
                             at::full({i == 0 ? 3 : 2}, 0.5f).to(at::kFloat8_e5m2)))
          << "before tensor " << i;
      offset += sizes[i] + 2;
    }
  }
  auto x = at::ones({4}), out = at::empty({4}, at::kFloat8_e4m3fn);
  quantize_many({}, scales, {}, Fp8Format::kE4M3, {});  // nothing to do
  testing::ExpectErrorContaining([&] { quantize_many({x, x}, scales, {0}, Fp8Format::kE4M3, {out, out}); },
                                 "quantize_many: xs, outs and scale_index must have one entry per tensor, got 2, 2 "
                                 "and 1");
  testing::ExpectErrorContaining([&] { quantize_many({x}, scales, {4}, Fp8Format::kE4M3, {out}); },
                                 "quantize_many: scale_index[0] is 4, scales has 4 elements");
  testing::ExpectErrorContaining(
      [&] { quantize_many({x, x.to(at::kHalf)}, scales, {0, 1}, Fp8Format::kE4M3, {out, out}); },
      "quantize_many: xs[1] is Half on cpu, xs[0] Float on cpu: all must have one dtype and device");
  testing::ExpectErrorContaining([&] { quantize_many({x}, scales, {0}, Fp8Format::kE5M2, {out}); },
                                 "quantize_many: outs[0] must be a contiguous Float8_e5m2 tensor of 4 elements on "
                                 "cpu, got Float8_e4m3fn [4] on cpu");
  testing::ExpectErrorContaining([&] { quantize_many({x}, scales.to(at::kDouble), {0}, Fp8Format::kE4M3, {out}); },
                                 "quantize_many: scales must be a contiguous 1-D float32 tensor on cpu, got Double");
  testing::ExpectErrorContaining([&] { quantize_many({at::ones({2, 3}).t()}, scales, {0}, Fp8Format::kE4M3, {out}); },
                                 "quantize_many: xs[0] must be contiguous");
}

// Tensors of three dtypes, each dtype with every awkward size (empty, one element, the kernel's
// 4096-element chunk edges, primes), 200 small float32 ones (more than one launch's 128 tensors
// of a dtype), a NaN in one and an infinity in another.
std::vector<at::Tensor> amax_many_inputs(at::Device device) {
  std::vector<at::Tensor> xs;
  const std::vector<int64_t> sizes = {0, 1, 7, 4095, 4096, 4097, 3221, 1481 * 67, 2333};
  const std::vector<at::ScalarType> types = {at::kFloat, at::kBFloat16, at::kHalf};
  for (size_t i = 0; i < 2 * sizes.size() * types.size(); ++i) {
    auto x = at::randn({sizes[i % sizes.size()]}).mul(0.25 + static_cast<double>(i % 7));
    if (i == 21) x[3] = NAN;
    if (i == 22) x[x.numel() - 1] = -INFINITY;
    xs.push_back(x.to(device, types[(i / sizes.size()) % types.size()]));
  }
  for (int i = 0; i < 200; ++i) xs.push_back(at::randn({1 + i % 50}).to(device));  // > 128 float32
  xs.push_back(at::randn({37, 29}).to(device));
  return xs;
}

TEST_F(QuantizeTest, AmaxOfManyIsTheAmaxOfEach) {
  const auto xs = amax_many_inputs(at::kCPU);
  const auto amaxes = compute_amax_many(xs);
  ASSERT_EQ(amaxes.sizes(), (std::vector<int64_t>{static_cast<int64_t>(xs.size())}));
  EXPECT_EQ(amaxes.scalar_type(), at::kFloat);
  for (size_t i = 0; i < xs.size(); ++i) {
    const float expected = xs[i].numel() == 0 ? 0.0f : item(compute_amax(xs[i]));
    EXPECT_TRUE(SameFloat(amaxes[static_cast<int64_t>(i)].item<float>(), expected)) << "xs[" << i << "]";
  }
  EXPECT_TRUE(std::isnan(amaxes[21].item<float>()));
  EXPECT_EQ(amaxes[22].item<float>(), INFINITY);
  EXPECT_GT(amaxes[6].item<float>(), 0.0f);
  ExpectErrorContaining([] { compute_amax_many({}); }, "xs must hold at least one tensor");
  ExpectErrorContaining([] { compute_amax_many({at::ones({2}), at::ones({2}, at::kInt)}); },
                        "xs[1] must be float32, bfloat16 or float16, got Int");
  ExpectErrorContaining([] { compute_amax_many({at::ones({2}), at::ones({3, 2}).t()}); },
                        "xs[1] ([2, 3]) must be contiguous");
}

// The multi-tensor kernel gives each tensor's exact amax, as the CPU (max is exact in float32).
// A NaN amax is compared as NaN, not by its bits: the GPU's float16-to-float32 conversion
// gives the canonical NaN 0x7FFFFFFF where the CPU's keeps the input's payload (0x7FC00000).
TEST(AmaxManyTest, MatchesCpu_CUDA) {
  if (!testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(9);
  const auto cpu = amax_many_inputs(at::kCPU);
  std::vector<at::Tensor> gpu;
  for (const auto& x : cpu) gpu.push_back(x.to(at::kCUDA));
  const auto expected = compute_amax_many(cpu);
  const auto amaxes = compute_amax_many(gpu);
  EXPECT_TRUE(amaxes.is_cuda());
  const auto got = amaxes.cpu();
  ASSERT_EQ(got.sizes(), expected.sizes());
  for (int64_t i = 0; i < got.numel(); ++i) {
    EXPECT_TRUE(SameFloat(got[i].item<float>(), expected[i].item<float>())) << "xs[" << i << "]";
  }
  EXPECT_TRUE(std::isnan(got[21].item<float>()));
}

// One scale per amax, as the distributed optimizer computes them for all FP8 weights at once:
// each is (fp8_max / amax) / 2^margin, 1 for 0, NaN or an infinity, FLT_MAX when it overflows.
TEST_F(QuantizeTest, CurrentScaleOfManyAmaxes) {
  const float inf = std::numeric_limits<float>::infinity();
  auto amax = at::tensor({2.0f, 0.0f, kNaN, inf, 1e-39f, 448.0f, 0.3f});
  auto scale = compute_current_scale(amax, Fp8Format::kE4M3, /*margin=*/1);
  ASSERT_EQ(scale.sizes(), at::IntArrayRef({7}));
  EXPECT_THAT(std::vector<float>(scale.data_ptr<float>(), scale.data_ptr<float>() + 7),
              ::testing::ElementsAre(112.0f, 1.0f, 1.0f, 1.0f, FLT_MAX, 0.5f,
                                     (448.0f / 0.3f) / 2.0f));
  // One value (0-dim or [1]) still gives [1].
  EXPECT_EQ(compute_current_scale(at::tensor(4.0f), Fp8Format::kE5M2).sizes(),
            at::IntArrayRef({1}));
  EXPECT_EQ(item(compute_current_scale(at::tensor(4.0f), Fp8Format::kE5M2)), 57344.0f / 4.0f);
  testing::ExpectErrorContaining(
      [&] { compute_current_scale(at::ones({2, 2}), Fp8Format::kE4M3); },
      "compute_current_scale: amax must be float32, one value or a 1-D tensor of them, got Float "
      "[2, 2]");
  testing::ExpectErrorContaining(
      [&] { compute_current_scale(at::ones({3}, at::kDouble), Fp8Format::kE4M3); },
      "compute_current_scale: amax must be float32, one value or a 1-D tensor of them, got Double");
}

TEST(CurrentScaleTest, ManyAmaxesMatchCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  // More values than one block of the kernel holds, with zeros, NaNs, infinities and
  // overflowing quotients among them.
  auto amax = at::rand({3001}) * 1000;
  amax.index_put_({at::indexing::Slice(0, 3001, 7)}, 0.0f);
  amax.index_put_({at::indexing::Slice(3, 3001, 11)}, std::numeric_limits<float>::quiet_NaN());
  amax.index_put_({at::indexing::Slice(5, 3001, 13)}, std::numeric_limits<float>::infinity());
  amax.index_put_({at::indexing::Slice(6, 3001, 17)}, 1e-39f);
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto cpu = compute_current_scale(amax, format, 3);
    auto gpu = compute_current_scale(amax.cuda(), format, 3);
    EXPECT_TRUE(BytesEqual(gpu, cpu)) << fp8_format_name(format);
  }
}

TEST_F(QuantizeTest, BadInputsAreNamed) {
  auto expect_error = [](auto&& fn, const std::string& text) {
    testing::ExpectErrorContaining(fn, text);
  };
  auto s = scalar(1.0f);
  expect_error([&] { quantize(at::ones({4}, at::kInt), s, Fp8Format::kE4M3); },
               "quantize: x must be float32, bfloat16 or float16, got Int");
  expect_error([&] { quantize(at::ones({4}, at::kDouble), s, Fp8Format::kE4M3); },
               "x must be float32, bfloat16 or float16, got Double");
  expect_error(
      [&] {
        quantize(at::ones({4, 6}).t(), s, Fp8Format::kE4M3);
      },
      "quantize: x must be contiguous");
  expect_error(
      [&] {
        quantize(at::ones({0, 3}), s, Fp8Format::kE4M3);
      },
      "quantize: x must be non-empty, got shape [0, 3]");
  expect_error([&] { quantize(at::ones({4}), at::ones({2}), Fp8Format::kE4M3); },
               "quantize: scale must hold exactly one element");
  expect_error([&] { quantize(at::ones({4}), at::ones({1}, at::kHalf), Fp8Format::kE4M3); },
               "quantize: scale must be float32, got Half");
  expect_error([&] { quantize(at::ones({4}), s, Fp8Format::kE4M3, at::ones({1}, at::kDouble)); },
               "quantize: amax_out must be float32, got Double");
  expect_error([&] { quantize(at::Tensor(), s, Fp8Format::kE4M3); },
               "quantize: x must be a defined tensor");
  expect_error(
      [&] {
        cast_transpose(at::ones({2, 3, 4}), s, Fp8Format::kE4M3);
      },
      "cast_transpose: x must be 2-D [rows, cols], got shape [2, 3, 4]");
  expect_error([&] { quantize_current_scaling(at::ones({4}), Fp8Format::kE4M3, -1); },
               "quantize_current_scaling: margin must be in [0, 126], got -1");
}

TEST_F(QuantizeTest, CastTransposeOnCpuMatchesQuantizeAndItsTranspose) {
  for (auto [rows, cols] :
       {std::pair<int64_t, int64_t>{1, 3221}, {1481, 677}, {2333, 1}, {64, 48}}) {
    auto x = testing::random_wide({rows, cols}, at::kBFloat16);
    auto amax = at::zeros({1});
    auto ct = cast_transpose(x, scalar(0.75f), Fp8Format::kE5M2, amax);
    auto q = quantize(x, scalar(0.75f), Fp8Format::kE5M2);
    EXPECT_TRUE(BytesEqual(ct.data.data, q.data));
    EXPECT_EQ(ct.transposed.sizes(), (at::IntArrayRef{cols, rows}));
    EXPECT_TRUE(BytesEqual(ct.transposed.data, q.data.t().contiguous()));
    EXPECT_EQ(item(amax), x.to(at::kFloat).abs().max().item<float>());
    EXPECT_EQ(item(ct.transposed.scale_inv), 1.0f / 0.75f);
  }
}

// Column pieces of awkward widths (one of them a single column) cast as their concatenation is:
// the same bytes in both layouts, amax (set, then accumulated into a slot holding more), scale_inv
// and column sums. A piece written at the wrong offset, or the amax of the last piece only, shows.
TEST_F(QuantizeTest, CastTransposeColumnsIsTheCastOfTheConcatenation) {
  for (int64_t rows : {1, 37, 160}) {
    std::vector<at::Tensor> pieces = {testing::random_wide({rows, 24}, at::kBFloat16),
                                      testing::random_wide({rows, 1}, at::kBFloat16) * 4,
                                      testing::random_wide({rows, 43}, at::kBFloat16)};
    const auto whole = at::cat(pieces, 1);
    auto amax = at::full({1}, -1.0f), amax_whole = at::zeros({1});
    auto dbias = at::full({68}, NAN), dbias_whole = at::empty({68});
    auto ct = cast_transpose_columns(pieces, scalar(3.0f), Fp8Format::kE4M3, amax, false, dbias);
    auto expected =
        cast_transpose(whole, scalar(3.0f), Fp8Format::kE4M3, amax_whole, false, dbias_whole);
    EXPECT_TRUE(BytesEqual(ct.data.data, expected.data.data)) << rows;
    EXPECT_TRUE(BytesEqual(ct.transposed.data, expected.transposed.data)) << rows;
    EXPECT_TRUE(SameFloat(item(amax), item(amax_whole))) << rows;
    EXPECT_EQ(item(amax), whole.to(at::kFloat).abs().max().item<float>());
    EXPECT_TRUE(BytesEqual(dbias, dbias_whole)) << rows;
    EXPECT_EQ(item(ct.transposed.scale_inv), 1.0f / 3.0f);
    const float m = item(amax_whole);
    for (float before : {m / 2, m * 2}) {
      auto slot = at::full({1}, before);
      cast_transpose_columns(pieces, scalar(3.0f), Fp8Format::kE4M3, slot, true);
      EXPECT_EQ(item(slot), std::max(before, m)) << rows;
    }
  }
}

TEST_F(QuantizeTest, CastTransposeColumnsNamesTheBadPiece) {
  auto x = at::ones({4, 8});
  const std::vector<std::pair<std::vector<at::Tensor>, std::string>> bad = {
      {{}, "cast_transpose_columns: pieces must hold at least one tensor"},
      {{at::ones({})}, "cast_transpose_columns: pieces[0] must be 2-D [rows, cols], got shape []"},
      {{x, at::ones({5, 8})},
       "cast_transpose_columns: pieces[1] must be 2-D with pieces[0]'s 4 rows, dtype Float and "
       "device cpu, got Float [5, 8]"},
      {{x, at::ones({4, 8}, at::kBFloat16)}, "pieces[1] must be 2-D with pieces[0]'s 4 rows"},
      {{x, at::ones({8, 4}).t()}, "cast_transpose_columns: pieces[1] must be contiguous"},
      {{x, at::ones({4, 8}, at::kInt)}, "pieces[1] must be float32, bfloat16 or float16"}};
  for (const auto& [pieces, what] : bad) {
    testing::ExpectErrorContaining(
        [&] { cast_transpose_columns(pieces, scalar(1.0f), Fp8Format::kE4M3); }, what);
  }
  testing::ExpectErrorContaining(
      [&] { cast_transpose_columns({x}, scalar(1.0f).to(at::kDouble), Fp8Format::kE4M3); },
      "cast_transpose_columns: scale must be float32, got Double");
  testing::ExpectErrorContaining(
      [&] {
        cast_transpose_columns({x, x}, scalar(1.0f), Fp8Format::kE4M3, {}, false, at::zeros({8}));
      },
      "cast_transpose_columns: dbias_out must be a contiguous float32, bfloat16 or float16 [16]");
}

// dbias_out: the column sums (the bias gradient of a gradient), beside the unchanged cast.
TEST_F(QuantizeTest, CastTransposeDbiasIsTheColumnSum) {
  auto x = testing::random_wide({77, 45}, at::kBFloat16);
  auto dbias = at::full({45}, 7.0f);
  auto ct = cast_transpose(x, scalar(0.5f), Fp8Format::kE4M3, {}, false, dbias);
  EXPECT_TRUE(BytesEqual(dbias, x.sum(0, false, at::kFloat)));
  EXPECT_TRUE(BytesEqual(ct.data.data, quantize(x, scalar(0.5f), Fp8Format::kE4M3).data));
  for (const auto& [bad, what] : std::vector<std::pair<at::Tensor, std::string>>{
           {at::zeros({44}), "got Float [44]"}, {at::zeros({45}, at::kDouble), "got Double"},
           {at::zeros({2, 45}), "got Float [2, 45]"}}) {
    auto call = [&] { cast_transpose(x, scalar(0.5f), Fp8Format::kE4M3, {}, false, bad); };
    testing::ExpectErrorContaining(call,
                                   "cast_transpose: dbias_out must be a contiguous float32, "
                                   "bfloat16 or float16 [45] tensor");
    testing::ExpectErrorContaining(call, what);
  }
}

// dbias_out in the bias's own half dtype: the float32 column sum rounded once, no float32 copy
// for the caller to cast.
TEST_F(QuantizeTest, CastTransposeDbiasInTheBiasDtype) {
  auto x = testing::random_wide({77, 45}, at::kBFloat16);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    auto dbias = at::full({45}, 7.0f, dtype);
    cast_transpose(x, scalar(0.5f), Fp8Format::kE4M3, {}, false, dbias);
    EXPECT_EQ(dbias.scalar_type(), dtype);
    EXPECT_TRUE(BytesEqual(dbias, x.sum(0, false, at::kFloat).to(dtype))) << dtype;
  }
}

// Two FP8 casts of the same values computed two ways (rounding apart in float32): every byte
// within one FP8 step of the other, and nearly all identical. A wrong activation moves most.
// The float32 values themselves differ by more than an ulp where GELU's derivative nearly
// cancels (x near -0.75, where it crosses zero, and |x| large, where 1 - tanh² does), relative
// errors up to 1e-3 there between two orderings of the same formula, measured: so up to 2% of
// the bytes may differ by that one step.
void expect_same_fp8_values(const Fp8Tensor& actual, const Fp8Tensor& expected,
                            const std::string& where) {
  auto a = actual.data.cpu().to(at::kFloat), e = expected.data.cpu().to(at::kFloat);
  ASSERT_EQ(a.sizes(), e.sizes()) << where;
  // One step: at most 2^-2 of the magnitude (E5M2's), or E4M3's smallest subnormal near zero.
  const auto step = at::maximum(a.abs(), e.abs()) * 0.25 + std::ldexp(1.0, -9);
  EXPECT_TRUE(((a - e).abs() <= step).all().item<bool>()) << where;
  const int64_t differing = (a != e).sum().item<int64_t>();
  EXPECT_LE(differing, 2 + a.numel() / 50) << where << ": " << differing << " of "
                                             << a.numel() << " bytes differ";
}

// cast_transpose_gelu / _dgelu on the CPU: the casts of LibTorch's GELU and GELU backward
// (tanh), with those values' amax and column sums.
TEST_F(QuantizeTest, CastTransposeGeluIsTheCastOfLibTorchsGelu) {
  auto x = at::randn({77, 45}).mul(3).to(at::kBFloat16);
  auto values = at::gelu(x.to(at::kFloat), "tanh");
  auto amax = at::zeros({1});
  auto ct = cast_transpose_gelu(x, scalar(8.0f), Fp8Format::kE4M3, amax);
  auto expected = cast_transpose(values, scalar(8.0f), Fp8Format::kE4M3);
  expect_same_fp8_values(ct.data, expected.data, "gelu");
  expect_same_fp8_values(ct.transposed, expected.transposed, "gelu transposed");
  EXPECT_NEAR(item(amax), values.abs().max().item<float>(), 1e-6 * item(amax));
  EXPECT_EQ(item(ct.data.scale_inv), 1.0f / 8.0f);
}

// cast_transpose_swiglu on the CPU: the cast of LibTorch's silu(gate) · up over the two halves,
// in float32 (not rounded to the input's bfloat16), with its amax; an odd width is named.
TEST_F(QuantizeTest, CastTransposeSwigluIsTheCastOfSiluTimesUp) {
  auto gate_up = at::randn({77, 2 * 40}).mul(3).to(at::kBFloat16);
  const auto halves = gate_up.to(at::kFloat).chunk(2, 1);
  auto values = at::silu(halves[0]) * halves[1];
  auto amax = at::zeros({1});
  auto ct = cast_transpose_swiglu(gate_up, scalar(8.0f), Fp8Format::kE4M3, amax);
  ASSERT_EQ(ct.data.sizes(), (std::vector<int64_t>{77, 40}));
  auto expected = cast_transpose(values, scalar(8.0f), Fp8Format::kE4M3);
  expect_same_fp8_values(ct.data, expected.data, "swiglu");
  expect_same_fp8_values(ct.transposed, expected.transposed, "swiglu transposed");
  EXPECT_NEAR(item(amax), values.abs().max().item<float>(), 1e-6 * item(amax));
  testing::ExpectErrorContaining(
      [] { cast_transpose_swiglu(at::randn({4, 7}), at::ones({1}), Fp8Format::kE4M3); },
      "cast_transpose_swiglu: gate_up must have an even number of columns");
}

// cast_transpose_dswiglu on the CPU: the cast of LibTorch's own gradient of silu(gate) · up
// (float64 autograd, both halves: d gate then d up), in float32 (not rounded to the inputs'
// bfloat16), with its amax and column sums; a gate_up that is not [rows, 2·cols] is named.
TEST_F(QuantizeTest, CastTransposeDswigluIsTheCastOfSiluTimesUpsGradient) {
  auto gate_up = at::randn({77, 2 * 40}).mul(3).to(at::kBFloat16);
  auto grad = at::randn({77, 40}).to(at::kBFloat16);
  auto leaf = gate_up.to(at::kDouble).requires_grad_(true);
  const auto halves = leaf.chunk(2, 1);
  (at::silu(halves[0]) * halves[1]).backward(grad.to(at::kDouble));
  const auto values = leaf.grad().to(at::kFloat);
  auto amax = at::zeros({1});
  auto dbias = at::full({80}, NAN);
  auto ct = cast_transpose_dswiglu(grad, gate_up, scalar(8.0f), Fp8Format::kE5M2, amax, false,
                                   dbias);
  ASSERT_EQ(ct.data.sizes(), (std::vector<int64_t>{77, 80}));
  auto expected = cast_transpose(values, scalar(8.0f), Fp8Format::kE5M2);
  expect_same_fp8_values(ct.data, expected.data, "dswiglu");
  expect_same_fp8_values(ct.transposed, expected.transposed, "dswiglu transposed");
  EXPECT_NEAR(item(amax), values.abs().max().item<float>(), 1e-6 * item(amax));
  EXPECT_TRUE(at::allclose(dbias, values.sum(0), 1e-5, 1e-5));
  testing::ExpectErrorContaining(
      [] {
        cast_transpose_dswiglu(at::randn({4, 8}), at::randn({4, 8}), at::ones({1}),
                               Fp8Format::kE5M2);
      },
      "cast_transpose_dswiglu: gate_up must be a contiguous Float [4, 16] tensor");
}

TEST_F(QuantizeTest, CastTransposeDgeluIsTheCastOfLibTorchsGeluBackward) {
  auto grad = at::randn({77, 45}).to(at::kBFloat16);
  auto gelu_input = at::randn({77, 45}).mul(3).to(at::kBFloat16);
  auto values =
      at::gelu_backward(grad.to(at::kFloat), gelu_input.to(at::kFloat), "tanh");
  auto amax = at::zeros({1});
  auto dbias = at::full({45}, 7.0f);
  auto ct = cast_transpose_dgelu(grad, gelu_input, scalar(64.0f), Fp8Format::kE5M2, amax, false,
                                 dbias);
  auto expected = cast_transpose(values, scalar(64.0f), Fp8Format::kE5M2);
  expect_same_fp8_values(ct.data, expected.data, "dgelu");
  expect_same_fp8_values(ct.transposed, expected.transposed, "dgelu transposed");
  EXPECT_NEAR(item(amax), values.abs().max().item<float>(), 1e-6 * item(amax));
  EXPECT_TRUE(at::allclose(dbias, values.sum(0), 1e-5, 1e-5));
  // gelu_input must match grad.
  for (const auto& [bad, what] : std::vector<std::pair<at::Tensor, std::string>>{
           {at::randn({77, 44}).to(at::kBFloat16), "got BFloat16 [77, 44]"},
           {at::randn({77, 45}), "got Float [77, 45]"},
           {at::randn({45, 77}).to(at::kBFloat16).t(), "not contiguous"}}) {
    auto call = [&] { cast_transpose_dgelu(grad, bad, scalar(1.0f), Fp8Format::kE5M2); };
    testing::ExpectErrorContaining(
        call, "cast_transpose_dgelu: gelu_input must be a contiguous BFloat16 [77, 45] tensor");
    testing::ExpectErrorContaining(call, what);
  }
  testing::ExpectErrorContaining(
      [&] { cast_transpose_dgelu(grad, gelu_input, scalar(1.0f), Fp8Format::kE5M2, {}, false,
                                 at::zeros({44})); },
      "cast_transpose_dgelu: dbias_out must be a contiguous float32, bfloat16 or float16 [45] "
      "tensor");
}

// The four inputs of one activation-fused cast on `device`: x, and GELU's input / gate-up.
struct ActivationInputs {
  std::string name;
  at::Tensor x, second;
};
std::vector<ActivationInputs> activation_inputs(int64_t rows, int64_t cols, at::ScalarType dtype,
                                                at::Device device) {
  auto make = [&](std::vector<int64_t> sizes, double scale) {
    return (at::randn(sizes) * scale).to(dtype).to(device);
  };
  return {{"gelu", make({rows, cols}, 3), {}},
          {"dgelu", make({rows, cols}, 1), make({rows, cols}, 3)},
          {"swiglu", make({rows, 2 * cols}, 3), {}},
          {"dswiglu", make({rows, cols}, 1), make({rows, 2 * cols}, 3)}};
}

at::Tensor activation_amax(const ActivationInputs& in) {
  if (in.name == "gelu") return compute_amax_gelu(in.x);
  if (in.name == "dgelu") return compute_amax_dgelu(in.x, in.second);
  if (in.name == "swiglu") return compute_amax_swiglu(in.x);
  return compute_amax_dswiglu(in.x, in.second);
}

// The amax the fused cast records for the same inputs (a fresh slot).
at::Tensor fused_cast_amax(const ActivationInputs& in, const at::Tensor& scale) {
  auto slot = at::full({1}, -1.0f, in.x.options().dtype(at::kFloat));
  if (in.name == "gelu") cast_transpose_gelu(in.x, scale, Fp8Format::kE4M3, slot);
  if (in.name == "dgelu") cast_transpose_dgelu(in.x, in.second, scale, Fp8Format::kE4M3, slot);
  if (in.name == "swiglu") cast_transpose_swiglu(in.x, scale, Fp8Format::kE4M3, slot);
  if (in.name == "dswiglu") cast_transpose_dswiglu(in.x, in.second, scale, Fp8Format::kE4M3, slot);
  return slot;
}

// LibTorch's own float32 formulas of the same values (tanh GELU; SwiGLU's backward by autograd).
at::Tensor libtorch_values(const ActivationInputs& in) {
  const auto x = in.x.to(at::kFloat);
  if (in.name == "gelu") return at::gelu(x, "tanh");
  if (in.name == "dgelu") return at::gelu_backward(x, in.second.to(at::kFloat), "tanh");
  const auto gate_up = (in.name == "swiglu" ? in.x : in.second).to(at::kFloat);
  const int64_t ffn = gate_up.size(1) / 2;
  auto gu = gate_up.detach().requires_grad_(true);
  auto y = at::silu(gu.narrow(1, 0, ffn)) * gu.narrow(1, ffn, ffn);
  if (in.name == "swiglu") return y.detach();
  y.backward(x);
  return gu.grad();
}

// compute_amax_gelu / _dgelu / _swiglu / _dswiglu on the CPU: LibTorch's formulas' amax within
// float32 rounding; a NaN among the inputs gives NaN. An amax of the inputs instead of the
// values, or of one SwiGLU half, misses by far more. (The CPU casts measure the same reference
// values, so the GPU test below is the one that compares with a cast's amax.)
TEST_F(QuantizeTest, ActivationAmaxIsTheAmaxOfTheValuesTheFusedCastQuantizes) {
  for (const auto& in : activation_inputs(37, 24, at::kBFloat16, at::kCPU)) {
    const float amax = item(activation_amax(in));
    const float expected = libtorch_values(in).abs().max().item<float>();
    EXPECT_NEAR(amax, expected, 2e-6 * expected) << in.name;
    auto with_nan = in;
    with_nan.x = in.x.clone();
    with_nan.x[5][3] = NAN;
    EXPECT_TRUE(std::isnan(item(activation_amax(with_nan)))) << in.name;
  }
  testing::ExpectErrorContaining([] { compute_amax_dgelu(at::ones({4, 8}), at::ones({4, 9})); },
                        "compute_amax_dgelu: gelu_input must be a contiguous Float [4, 8] tensor");
  testing::ExpectErrorContaining([] { compute_amax_dswiglu(at::ones({4, 8}), at::ones({4, 8})); },
                        "compute_amax_dswiglu: gate_up must be a contiguous Float [4, 16] tensor");
  testing::ExpectErrorContaining([] { compute_amax_swiglu(at::ones({4, 7})); },
                        "compute_amax_swiglu: gate_up must have an even number of columns");
  testing::ExpectErrorContaining([] { compute_amax_gelu(at::ones({4, 8, 2})); },
                        "compute_amax_gelu: x must be 2-D [rows, cols], got shape [4, 8, 2]");
}

}  // namespace
}  // namespace amp8

// ---- CUDA vs the CPU reference: identical bytes, amax and scale_inv. ----

namespace amp8 {
namespace {

struct GpuCase {
  int64_t rows, cols;
  at::ScalarType dtype;
  Fp8Format format;
};

std::string case_name(const ::testing::TestParamInfo<GpuCase>& info) {
  return testing::shape_name(info.param.rows, info.param.cols) + "_" +
         std::string(c10::toString(info.param.dtype)) + "_" + fp8_format_name(info.param.format);
}

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> cases;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 3221}, {1481, 677}, {2333, 1}, {8192, 8192}, {16, 8}, {48, 136}, {1000, 1024}, {400, 264},
      {48, 160}};
  for (auto [rows, cols] : shapes) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        cases.push_back({rows, cols, dtype, format});
      }
    }
  }
  return cases;
}

class QuantizeGpuTest : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override { at::manual_seed(7); }
};

TEST_P(QuantizeGpuTest, MatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto x = testing::random_wide({p.rows, p.cols}, p.dtype);
  // A scale that sends the top of the range into saturation and the bottom into subnormals.
  auto scale = scalar(fp8_max(p.format) / x.to(at::kFloat).abs().max().item<float>() * 4.0f);
  auto amax_cpu = at::zeros({1}), amax_gpu = at::zeros({1}, at::kCUDA);
  auto cpu = quantize(x, scale, p.format, amax_cpu);
  auto gpu = quantize(x.cuda(), scale.cuda(), p.format, amax_gpu);
  EXPECT_TRUE(BytesEqual(gpu.data, cpu.data));
  EXPECT_TRUE(SameFloat(item(amax_gpu), item(amax_cpu)));
  EXPECT_TRUE(SameFloat(item(gpu.scale_inv), item(cpu.scale_inv)));
}

TEST_P(QuantizeGpuTest, CastTransposeMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto x = testing::random_wide({p.rows, p.cols}, p.dtype);
  auto scale = scalar(fp8_max(p.format) / x.to(at::kFloat).abs().max().item<float>() * 4.0f);
  auto amax_cpu = at::zeros({1}), amax_gpu = at::full({1}, -1.0f, at::kCUDA);
  auto cpu = cast_transpose(x, scale, p.format, amax_cpu);
  auto gpu = cast_transpose(x.cuda(), scale.cuda(), p.format, amax_gpu);
  EXPECT_TRUE(BytesEqual(gpu.data.data, cpu.data.data));
  EXPECT_TRUE(BytesEqual(gpu.transposed.data, cpu.transposed.data));
  EXPECT_TRUE(SameFloat(item(amax_gpu), item(amax_cpu)));
  EXPECT_TRUE(SameFloat(item(gpu.data.scale_inv), item(cpu.data.scale_inv)));
  // Accumulating into a slot that already holds a smaller or a larger amax.
  const float m = item(amax_cpu);
  for (float before : {m / 2, m * 2}) {
    auto slot_cpu = at::full({1}, before), slot_gpu = at::full({1}, before, at::kCUDA);
    cast_transpose(x, scale, p.format, slot_cpu, true);
    cast_transpose(x.cuda(), scale.cuda(), p.format, slot_gpu, true);
    EXPECT_TRUE(SameFloat(item(slot_gpu), item(slot_cpu)));
    EXPECT_TRUE(SameFloat(item(slot_gpu), std::max(before, m)));
  }
}

// Three column pieces (widths cols, 8 and cols, cast into a wider matrix: rows 3·cols + 8 bytes
// apart, the fast kernel where the widths allow and the general one elsewhere) against the CPU's
// cast of their concatenation: identical bytes in both layouts and amax, and the fused dbias
// within the bound of the test below. A kernel that ignores the row stride overwrites the
// other pieces' rows.
TEST_P(QuantizeGpuTest, CastTransposeColumnsMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  if (p.rows * p.cols > (1 << 24)) GTEST_SKIP() << "the larger shapes add nothing here";
  std::vector<at::Tensor> pieces = {at::randn({p.rows, p.cols}).to(p.dtype),
                                    (at::randn({p.rows, 8}) * 5).to(p.dtype),
                                    at::randn({p.rows, p.cols}).to(p.dtype)};
  const auto whole = at::cat(pieces, 1);
  std::vector<at::Tensor> on_gpu;
  for (const auto& piece : pieces) on_gpu.push_back(piece.cuda());
  auto scale = scalar(fp8_max(p.format) / whole.to(at::kFloat).abs().max().item<float>() * 4.0f);
  const int64_t width = whole.size(1);
  auto amax_cpu = at::zeros({1}), amax_gpu = at::full({1}, -1.0f, at::kCUDA);
  auto dbias_cpu = at::empty({width}), dbias_gpu = at::full({width}, NAN, at::kCUDA);
  auto cpu = cast_transpose(whole, scale, p.format, amax_cpu, false, dbias_cpu);
  auto gpu = cast_transpose_columns(on_gpu, scale.cuda(), p.format, amax_gpu, false, dbias_gpu);
  EXPECT_TRUE(BytesEqual(gpu.data.data, cpu.data.data));
  EXPECT_TRUE(BytesEqual(gpu.transposed.data, cpu.transposed.data));
  EXPECT_TRUE(SameFloat(item(amax_gpu), item(amax_cpu)));
  const auto bound = whole.to(at::kFloat).abs().sum(0) * 1e-5f + 1e-6f;
  EXPECT_TRUE(((dbias_gpu.cpu() - dbias_cpu).abs() <= bound).all().item<bool>());
  // Accumulating into a slot that already holds a smaller or a larger amax.
  const float m = item(amax_cpu);
  for (float before : {m / 2, m * 2}) {
    auto slot = at::full({1}, before, at::kCUDA);
    cast_transpose_columns(on_gpu, scale.cuda(), p.format, slot, true);
    EXPECT_TRUE(SameFloat(item(slot), std::max(before, m)));
  }
}

// compute_amax_gelu / ... on the GPU: the CPU's within a float32 rounding (expf and tanhf of each
// side's library), and, where the fused cast takes the shape (rows % 16 == 0, cols % 8 == 0),
// bit for bit the amax that cast records from the same device formula.
TEST_P(QuantizeGpuTest, ActivationAmaxMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  if (p.format == Fp8Format::kE5M2 || p.rows * p.cols > (1 << 24)) {
    GTEST_SKIP() << "no format here; the larger shapes add nothing";
  }
  const bool fused_shape = p.rows % 16 == 0 && p.cols % 8 == 0;
  for (const auto& cpu : activation_inputs(p.rows, p.cols, p.dtype, at::kCPU)) {
    ActivationInputs gpu{cpu.name, cpu.x.cuda(),
                         cpu.second.defined() ? cpu.second.cuda() : at::Tensor()};
    const float on_gpu = item(activation_amax(gpu)), on_cpu = item(activation_amax(cpu));
    EXPECT_NEAR(on_gpu, on_cpu, 1e-6 * on_cpu) << cpu.name;
    if (fused_shape) {
      EXPECT_TRUE(SameFloat(on_gpu, item(fused_cast_amax(gpu, scalar(4.0f).cuda())))) << cpu.name;
    }
    auto with_nan = gpu;
    with_nan.x = gpu.x.clone();
    with_nan.x.view(-1)[with_nan.x.numel() / 2] = NAN;
    EXPECT_TRUE(std::isnan(item(activation_amax(with_nan)))) << cpu.name;
  }
}

// The fused dbias (per-tile column sums, then a fixed-order sum over the tiles) against the CPU's
// column sum, and the cast next to it byte for byte the CPU's. Normal data: a lost or doubled
// tile of 128 rows moves a column sum by ~11, far outside the rounding bound used here.
TEST_P(QuantizeGpuTest, CastTransposeDbiasMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto x = at::randn({p.rows, p.cols}).to(p.dtype);
  auto scale = scalar(fp8_max(p.format) / x.to(at::kFloat).abs().max().item<float>() * 4.0f);
  auto dbias_cpu = at::empty({p.cols}), dbias_gpu = at::full({p.cols}, NAN, at::kCUDA);
  auto amax_cpu = at::zeros({1}), amax_gpu = at::zeros({1}, at::kCUDA);
  auto cpu = cast_transpose(x, scale, p.format, amax_cpu, false, dbias_cpu);
  auto gpu = cast_transpose(x.cuda(), scale.cuda(), p.format, amax_gpu, false, dbias_gpu);
  EXPECT_TRUE(BytesEqual(gpu.data.data, cpu.data.data));
  EXPECT_TRUE(BytesEqual(gpu.transposed.data, cpu.transposed.data));
  EXPECT_TRUE(SameFloat(item(amax_gpu), item(amax_cpu)));
  const auto bound = x.to(at::kFloat).abs().sum(0) * 1e-5f + 1e-6f;
  const auto error = (dbias_gpu.cpu() - dbias_cpu).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>())
      << "largest error " << error.max().item<float>() << " at column "
      << error.argmax().item<int64_t>() << "; bound there " << bound[error.argmax()].item<float>();
}

// A bf16 / fp16 dbias_out is the float32 one rounded once, on the fused path and off it, for the
// plain cast and the GELU-backward cast.
TEST_P(QuantizeGpuTest, DbiasInTheBiasDtypeIsTheRoundedFloatSum_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto x = at::randn({p.rows, p.cols}, at::kCUDA).to(p.dtype);
  auto gelu_input = (at::randn({p.rows, p.cols}, at::kCUDA) * 3).clamp(-4, 4).to(p.dtype);
  auto scale = scalar(fp8_max(p.format) / 8.0f).cuda();
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    auto as_float = at::full({p.cols}, NAN, at::kCUDA);
    auto rounded = at::full({p.cols}, NAN, at::kCUDA).to(dtype);
    cast_transpose(x, scale, p.format, {}, false, as_float);
    cast_transpose(x, scale, p.format, {}, false, rounded);
    EXPECT_TRUE(BytesEqual(rounded, as_float.to(dtype))) << "cast_transpose " << dtype;
    cast_transpose_dgelu(x, gelu_input, scale, p.format, {}, false, as_float);
    cast_transpose_dgelu(x, gelu_input, scale, p.format, {}, false, rounded);
    EXPECT_TRUE(BytesEqual(rounded, as_float.to(dtype))) << "cast_transpose_dgelu " << dtype;
  }
}

// The activation-fused casts against the CPU reference (the same float32 formula; tanh is
// computed by each side's own library, so a rare FP8 rounding may differ by one step), fused
// where the shape allows and through LibTorch's GELU elsewhere; dbias as above.
TEST_P(QuantizeGpuTest, CastTransposeGeluMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto x = (at::randn({p.rows, p.cols}) * 3).to(p.dtype);
  auto scale = scalar(fp8_max(p.format) / 12.0f);
  auto amax_cpu = at::zeros({1}), amax_gpu = at::full({1}, -1.0f, at::kCUDA);
  auto cpu = cast_transpose_gelu(x, scale, p.format, amax_cpu);
  auto gpu = cast_transpose_gelu(x.cuda(), scale.cuda(), p.format, amax_gpu);
  expect_same_fp8_values(gpu.data, cpu.data, "gelu");
  expect_same_fp8_values(gpu.transposed, cpu.transposed, "gelu transposed");
  EXPECT_NEAR(item(amax_gpu), item(amax_cpu), 1e-6 * item(amax_cpu));
  EXPECT_TRUE(SameFloat(item(gpu.data.scale_inv), item(cpu.data.scale_inv)));
}

// SwiGLU's cast over a gate/up tensor [rows, 2·cols] against the CPU reference (expf of each
// side's library: a rare FP8 rounding one step apart), fused where the shape allows.
TEST_P(QuantizeGpuTest, CastTransposeSwigluMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto gate_up = (at::randn({p.rows, 2 * p.cols}) * 3).to(p.dtype);
  auto scale = scalar(fp8_max(p.format) / 12.0f);
  auto amax_cpu = at::zeros({1}), amax_gpu = at::full({1}, -1.0f, at::kCUDA);
  auto cpu = cast_transpose_swiglu(gate_up, scale, p.format, amax_cpu);
  auto gpu = cast_transpose_swiglu(gate_up.cuda(), scale.cuda(), p.format, amax_gpu);
  expect_same_fp8_values(gpu.data, cpu.data, "swiglu");
  expect_same_fp8_values(gpu.transposed, cpu.transposed, "swiglu transposed");
  EXPECT_NEAR(item(amax_gpu), item(amax_cpu), 1e-6 * item(amax_cpu));
  EXPECT_TRUE(SameFloat(item(gpu.data.scale_inv), item(cpu.data.scale_inv)));
}

// SwiGLU's backward cast ([d gate | d up] from the gradient [rows, cols] and gate/up
// [rows, 2·cols]) against the CPU reference, fused where the shape allows; with a dbias_out
// through the unfused path (the kernel has no dbias variant).
TEST_P(QuantizeGpuTest, CastTransposeDswigluMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto grad = at::randn({p.rows, p.cols}).to(p.dtype);
  auto gate_up = (at::randn({p.rows, 2 * p.cols}) * 3).to(p.dtype);
  auto scale = scalar(fp8_max(p.format) / 8.0f);
  for (bool with_dbias : {false, true}) {
    auto dbias_cpu = with_dbias ? at::empty({2 * p.cols}) : at::Tensor();
    auto dbias_gpu = with_dbias ? at::full({2 * p.cols}, NAN, at::kCUDA) : at::Tensor();
    auto amax_cpu = at::zeros({1}), amax_gpu = at::full({1}, -1.0f, at::kCUDA);
    auto cpu = cast_transpose_dswiglu(grad, gate_up, scale, p.format, amax_cpu, false, dbias_cpu);
    auto gpu = cast_transpose_dswiglu(grad.cuda(), gate_up.cuda(), scale.cuda(), p.format,
                                      amax_gpu, false, dbias_gpu);
    const std::string where = with_dbias ? "dswiglu with dbias" : "dswiglu";
    expect_same_fp8_values(gpu.data, cpu.data, where);
    expect_same_fp8_values(gpu.transposed, cpu.transposed, where + " transposed");
    EXPECT_NEAR(item(amax_gpu), item(amax_cpu), 1e-6 * item(amax_cpu)) << where;
    EXPECT_TRUE(SameFloat(item(gpu.data.scale_inv), item(cpu.data.scale_inv))) << where;
    if (with_dbias) {
      EXPECT_TRUE(at::allclose(dbias_gpu.cpu(), dbias_cpu, 1e-4, 1e-4)) << where;
    }
  }
}

TEST_P(QuantizeGpuTest, CastTransposeDgeluMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto grad = at::randn({p.rows, p.cols}).to(p.dtype);
  // GELU's inputs within ±4: beyond, 1 - tanh² comes within a few float32 ulps of 0 and two
  // correct tanh implementations (CUDA's, the host's) disagree on the derivative by more than an
  // FP8 step there (seen at 8192² float32 inputs); both are within float32's resolution of it.
  auto gelu_input = (at::randn({p.rows, p.cols}) * 3).clamp(-4, 4).to(p.dtype);
  auto scale = scalar(fp8_max(p.format) / 8.0f);
  for (bool with_dbias : {true, false}) {
    auto dbias_cpu = with_dbias ? at::empty({p.cols}) : at::Tensor();
    auto dbias_gpu = with_dbias ? at::full({p.cols}, NAN, at::kCUDA) : at::Tensor();
    auto amax_cpu = at::zeros({1}), amax_gpu = at::zeros({1}, at::kCUDA);
    auto cpu = cast_transpose_dgelu(grad, gelu_input, scale, p.format, amax_cpu, false, dbias_cpu);
    auto gpu = cast_transpose_dgelu(grad.cuda(), gelu_input.cuda(), scale.cuda(), p.format,
                                    amax_gpu, false, dbias_gpu);
    expect_same_fp8_values(gpu.data, cpu.data, "dgelu");
    expect_same_fp8_values(gpu.transposed, cpu.transposed, "dgelu transposed");
    EXPECT_NEAR(item(amax_gpu), item(amax_cpu), 1e-6 * item(amax_cpu));
    if (with_dbias) {
      const auto values = at::gelu_backward(grad.to(at::kFloat), gelu_input.to(at::kFloat), "tanh");
      // Summation order (1e-5 of the magnitudes), plus each element's float32 error: tanh near
      // ±1 is known to a few ulps of 1 (4.8e-7), which the derivative multiplies by at most
      // 0.5 + 2|x/2|β(1 + 3κx²) <= 11 for |x| <= 4, times |grad|. (Shapes the fused kernel does
      // not take use LibTorch's gelu_backward, whose tanh is not the formula's.)
      const auto bound =
          values.abs().sum(0) * 1e-5f + grad.to(at::kFloat).abs().sum(0) * 6e-6f + 1e-6f;
      EXPECT_TRUE(((dbias_gpu.cpu() - dbias_cpu).abs() <= bound).all().item<bool>());
    }
  }
}

TEST_P(QuantizeGpuTest, CurrentScalingMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto& p = GetParam();
  auto x = testing::random_wide({p.rows, p.cols}, p.dtype);
  auto cpu = quantize_current_scaling(x, p.format, 2);
  auto gpu = quantize_current_scaling(x.cuda(), p.format, 2);
  EXPECT_TRUE(BytesEqual(gpu.data, cpu.data));
  EXPECT_TRUE(SameFloat(item(gpu.scale_inv), item(cpu.scale_inv)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantizeGpuTest, ::testing::ValuesIn(gpu_cases()), case_name);

// quantize_many on the GPU against its CPU reference: 300 tensors (three launches of 128), of
// sizes around the kernel's 4096-element chunks and its 4-element loads, written into one buffer
// at odd offsets (the kernel's byte path) or at 16-byte boundaries (its packed path), with scales
// that saturate some and send others into subnormals.
TEST(QuantizeManyTest, MatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  at::manual_seed(11);
  const std::vector<int64_t> sizes = {1, 7, 4095, 4096, 4097, 12289, 333, 100003};
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf})
    for (auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2})
      for (int64_t alignment : {1, 16}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + fp8_format_name(format) + ", outputs at " +
                     (alignment == 1 ? "odd offsets" : "16-byte boundaries"));
        auto next_offset = [&](int64_t end) { return alignment == 1 ? end + 1 : (end + 16) / 16 * 16; };
        std::vector<at::Tensor> xs_cpu, xs_gpu, outs_cpu, outs_gpu;
        std::vector<int64_t> scale_index;
        int64_t total = next_offset(0);
        for (int i = 0; i < 300; ++i) total = next_offset(total + sizes[i % sizes.size()]);
        auto buffer_cpu = at::zeros({total}, at::kByte).view(fp8_dtype(format));
        auto buffer_gpu = buffer_cpu.cuda();
        auto scales = at::rand({37}) * fp8_max(format) / 16.0f + 1e-4f;
        int64_t offset = next_offset(0);
        for (int i = 0; i < 300; ++i) {
          const auto n = sizes[i % sizes.size()];
          xs_cpu.push_back(testing::random_wide({n}, dtype));
          xs_gpu.push_back(xs_cpu.back().cuda());
          outs_cpu.push_back(buffer_cpu.narrow(0, offset, n));
          outs_gpu.push_back(buffer_gpu.narrow(0, offset, n));
          scale_index.push_back((i * 7) % 37);
          offset = next_offset(offset + n);
        }
        quantize_many(xs_cpu, scales, scale_index, format, outs_cpu);
        quantize_many(xs_gpu, scales.cuda(), scale_index, format, outs_gpu);
        EXPECT_TRUE(BytesEqual(buffer_gpu, buffer_cpu));
      }
}

TEST(QuantizeSpecialValuesTest, EveryRoundingBoundaryMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  // For every pair of neighbouring FP8 values: the midpoint and the floats just beside it,
  // both signs; plus NaN, infinities, zeros and float32 subnormals.
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto codes = at::arange(0, 128, at::kInt).to(at::kByte).view(fp8_dtype(format)).to(at::kFloat);
    codes = codes.masked_select(at::isfinite(codes));
    auto lo = codes.slice(0, 0, -1), hi = codes.slice(0, 1);
    auto mid = (lo + hi) / 2;
    auto below = at::nextafter(mid, lo), above = at::nextafter(mid, hi);
    auto specials = at::tensor({0.0f, -0.0f, kNaN, -kNaN, kInf, -kInf, 1e-45f, -1e-40f,
                                fp8_max(format) * 1.0001f, fp8_max(format) * 1.5f});
    auto x = at::cat({codes, mid, below, above, -codes, -mid, -below, -above, specials});
    for (float scale : {1.0f, 0.5f, 3.0f}) {
      auto cpu = quantize(x, scalar(scale), format);
      auto gpu = quantize(x.cuda(), scalar(scale).cuda(), format);
      EXPECT_TRUE(BytesEqual(gpu.data, cpu.data)) << format << " scale " << scale;
      auto x2 = x.reshape({1, -1});
      auto gpu_t = cast_transpose(x2.cuda(), scalar(scale).cuda(), format);
      EXPECT_TRUE(BytesEqual(gpu_t.transposed.data.reshape({-1}), cpu.data)) << format;
    }
  }
}

TEST(QuantizeDeviceTest, WrongDeviceArgumentsAreNamed_CUDA) {
  AMP8_REQUIRE_CUDA();
  auto x = at::ones({8}, at::kCUDA);
  try {
    quantize(x, scalar(1.0f), Fp8Format::kE4M3);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("quantize: scale must be on cuda:0 like x, got cpu"));
  }
  EXPECT_THROW(quantize(x, scalar(1.0f).cuda(), Fp8Format::kE4M3, at::zeros({1})), c10::Error);
}

}  // namespace
}  // namespace amp8
