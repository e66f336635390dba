#include "ops/blockwise.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using testing::relative_error;
using testing::SameFloat;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

BlockwiseQuantizeOptions tiles(Fp8BlockShape block, bool power_of_2 = true) {
  BlockwiseQuantizeOptions options;
  options.block = block;
  options.power_of_2_scales = power_of_2;
  return options;
}

float at2(const at::Tensor& t, int64_t i, int64_t j) { return t[i][j].item<float>(); }

class BlockwiseTest : public testing::SeededTest {};

// One row of two 1×128 tiles: tile 0 has an outlier of 1000 among ones, tile 1 is all zero.
// Tile 0: scale 448/1000 = 0.448, a power of two below: 0.25, so scale_inv 4 and the ones
// become 0.25 (exact); 1000 · 0.25 = 250 rounds to E4M3's 256. Tile 1: scale 1.
TEST_F(BlockwiseTest, HandComputedRowTiles) {
  auto x = at::zeros({1, 256});
  x.narrow(1, 0, 128).fill_(1.0f);
  x[0][5] = 1000.0f;
  const auto q = quantize_blockwise(x, tiles(Fp8BlockShape::k1x128)).data;
  ASSERT_EQ(q.scale_inv.sizes(), at::IntArrayRef({2, 1}));
  EXPECT_TRUE(SameFloat(at2(q.scale_inv, 0, 0), 4.0f));
  EXPECT_TRUE(SameFloat(at2(q.scale_inv, 1, 0), 1.0f));
  const auto values = q.data.to(at::kFloat);
  EXPECT_EQ(at2(values, 0, 0), 0.25f);
  EXPECT_EQ(at2(values, 0, 5), 256.0f);
  EXPECT_EQ(values.narrow(1, 128, 128).abs().max().item<float>(), 0.0f);
  EXPECT_EQ(at2(q.dequantize(), 0, 0), 1.0f);
  EXPECT_EQ(at2(q.dequantize(), 0, 5), 1024.0f);
  // Without power-of-two rounding the scale is the quotient itself, rounded to float32.
  const auto exact = quantize_blockwise(x, tiles(Fp8BlockShape::k1x128, false)).data;
  EXPECT_TRUE(SameFloat(at2(exact.scale_inv, 0, 0), 1.0f / (448.0f / 1000.0f)));
  EXPECT_EQ(at2(exact.data.to(at::kFloat), 0, 5), 448.0f);
}

// A NaN does not count towards its tile's amax (fmax) and stays NaN; an infinity makes the
// amax infinite, so the tile keeps scale 1 and the infinity saturates to 448; amax_epsilon
// lifts a tile of tiny values.
TEST_F(BlockwiseTest, NanInfAndEpsilonInATile) {
  auto x = at::full({3, 128}, 2.0f);
  x[0][7] = kNaN;
  x[1][9] = kInf;
  x[2].fill_(1e-6f);
  auto options = tiles(Fp8BlockShape::k1x128);
  options.amax_epsilon = 1e-3;
  const auto q = quantize_blockwise(x, options).data;
  const auto values = q.data.to(at::kFloat);
  // Row 0: amax 2 → 448/2 = 224 → 128; 2 · 128 = 256.
  EXPECT_TRUE(SameFloat(at2(q.scale_inv, 0, 0), 1.0f / 128.0f));
  EXPECT_TRUE(std::isnan(at2(values, 0, 7)));
  EXPECT_EQ(at2(values, 0, 0), 256.0f);
  EXPECT_TRUE(SameFloat(at2(q.scale_inv, 0, 1), 1.0f));
  EXPECT_EQ(at2(values, 1, 9), 448.0f);
  EXPECT_EQ(at2(values, 1, 0), 2.0f);
  // Row 2: amax raised to 1e-3: 448000 → 2^18.
  EXPECT_TRUE(SameFloat(at2(q.scale_inv, 0, 2), std::ldexp(1.0f, -18)));
}

// Shapes that are not multiples of 128: partial tiles at the edges, the layouts cuBLASLt
// reads (1×128: [ceil(cols/128), rows]; 128×128: [ceil(rows/128), round_up(ceil(cols/128), 4)]
// with zero padding), and the transposed copy: for 1×128 quantized from x in xᵀ's own tiles,
// for 128×128 the same bytes and scales transposed.
TEST_F(BlockwiseTest, LayoutsAndTransposesOnAwkwardShapes) {
  const auto x = testing::random_wide({130, 300}, at::kFloat);
  for (const auto block : {Fp8BlockShape::k1x128, Fp8BlockShape::k128x128}) {
    const bool rows_tiles = block == Fp8BlockShape::k1x128;
    const auto r = quantize_blockwise(x, tiles(block), /*transposed=*/true);
    EXPECT_EQ(r.data.scale_inv.sizes(),
              rows_tiles ? at::IntArrayRef({3, 130}) : at::IntArrayRef({2, 4}));
    EXPECT_EQ(r.transposed.data.sizes(), at::IntArrayRef({300, 130}));
    EXPECT_EQ(r.transposed.scale_inv.sizes(),
              rows_tiles ? at::IntArrayRef({2, 300}) : at::IntArrayRef({3, 4}));
    // Each element within half an E4M3 spacing of its tile's range: relative error of the
    // whole tensor at E4M3's RMS level (wide-range data leaves small elements coarser, so
    // the bound is the worst case of one spacing, 2^-3, not the RMS).
    EXPECT_LE(relative_error(r.data.dequantize(), x), 0.125) << rows_tiles;
    EXPECT_LE(relative_error(r.transposed.dequantize(), x.t()), 0.125) << rows_tiles;
    if (rows_tiles) {
      const auto direct = quantize_blockwise(x.t().contiguous(), tiles(block)).data;
      EXPECT_TRUE(BytesEqual(r.transposed.data, direct.data));
      EXPECT_TRUE(BytesEqual(r.transposed.scale_inv, direct.scale_inv));
      // A tile of xᵀ is 128 rows of one column of x: its own scale, not x's row tile's.
      EXPECT_FALSE(BytesEqual(r.transposed.data, r.data.data.t().contiguous()));
    } else {
      EXPECT_TRUE(BytesEqual(r.transposed.data, r.data.data.t().contiguous()));
      EXPECT_TRUE(BytesEqual(r.transposed.scale_inv.narrow(1, 0, 2),
                             r.data.scale_inv.narrow(1, 0, 3).t().contiguous()));
      EXPECT_EQ(r.data.scale_inv.narrow(1, 3, 1).abs().max().item<float>(), 0.0f)
          << "padding stays zero";
      // Block (1, 2) covers rows 128..129 and columns 256..299 only.
      const float amax = x.narrow(0, 128, 2).narrow(1, 256, 44).abs().max().item<float>();
      EXPECT_TRUE(SameFloat(at2(r.data.scale_inv, 1, 2),
                            1.0f / blockwise_scale(amax, tiles(block))));
    }
  }
}

// The scale rule itself, against values worked out by hand.
TEST_F(BlockwiseTest, ScaleFromAmax) {
  const auto pow2 = tiles(Fp8BlockShape::k1x128);
  EXPECT_EQ(blockwise_scale(448.0f, pow2), 1.0f);
  EXPECT_EQ(blockwise_scale(1.0f, pow2), 256.0f);  // 448 → 256
  EXPECT_EQ(blockwise_scale(0.0f, pow2), 1.0f);
  EXPECT_EQ(blockwise_scale(kInf, pow2), 1.0f);
  EXPECT_EQ(blockwise_scale(kNaN, pow2), 1.0f);
  EXPECT_EQ(blockwise_scale(1e-45f, tiles(Fp8BlockShape::k1x128, false)),
            std::numeric_limits<float>::max());
  auto e5m2 = pow2;
  e5m2.format = Fp8Format::kE5M2;
  EXPECT_EQ(blockwise_scale(1.0f, e5m2), 32768.0f);  // 57344 → 2^15
}

void expect_quantize_matches_cpu(const at::Tensor& x, const BlockwiseQuantizeOptions& options,
                                 const std::string& label) {
  const auto cpu = quantize_blockwise(x, options, /*transposed=*/true);
  const auto gpu = quantize_blockwise(x.cuda(), options, /*transposed=*/true);
  EXPECT_TRUE(BytesEqual(gpu.data.data, cpu.data.data)) << label;
  EXPECT_TRUE(BytesEqual(gpu.data.scale_inv, cpu.data.scale_inv)) << label;
  EXPECT_TRUE(BytesEqual(gpu.transposed.data, cpu.transposed.data)) << label << " (transposed)";
  EXPECT_TRUE(BytesEqual(gpu.transposed.scale_inv, cpu.transposed.scale_inv))
      << label << " (transposed)";
}

// CUDA and CPU give the same bytes: awkward shapes, every input dtype, both formats, both
// tile shapes, with and without power-of-two scales, with NaN, infinities and zero tiles.
TEST_F(BlockwiseTest, CudaMatchesCpuByteForByte_CUDA) {
  AMP8_REQUIRE_CUDA();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 130}, {257, 385}, {128, 128}, {300, 1000}, {7, 64}};
  for (const auto& [rows, cols] : shapes) {
    auto x = testing::random_wide({rows, cols}, at::kFloat);
    if (rows * cols > 200) {
      x.view(-1)[3] = kNaN;
      x.view(-1)[150] = -kInf;
      x.narrow(0, rows - 1, 1).zero_();
    }
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (const auto block : {Fp8BlockShape::k1x128, Fp8BlockShape::k128x128}) {
        for (const auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
          for (const bool power_of_2 : {true, false}) {
            auto options = tiles(block, power_of_2);
            options.format = format;
            options.amax_epsilon = power_of_2 ? 0.0 : 1e-4;
            expect_quantize_matches_cpu(
                x.to(dtype), options,
                testing::shape_name(rows, cols) + " " + c10::toString(dtype) +
                    (block == Fp8BlockShape::k1x128 ? " 1x128" : " 128x128") +
                    (format == Fp8Format::kE4M3 ? " e4m3" : " e5m2") +
                    (power_of_2 ? " pow2" : " fp32 scales"));
          }
        }
      }
    }
  }
}

// The CPU GEMM multiplies the dequantized tiles: against float64 on the same FP8 values, and
// within FP8 rounding of the unquantized product.
TEST_F(BlockwiseTest, GemmIsTheProductOfTheTiles) {
  const auto x = at::randn({48, 336});
  const auto w = at::randn({80, 336});
  const auto bias = at::randn({80});
  const auto a = quantize_blockwise(x, tiles(Fp8BlockShape::k1x128)).data;
  for (const auto block : {Fp8BlockShape::k1x128, Fp8BlockShape::k128x128}) {
    const auto b = quantize_blockwise(w, tiles(block)).data;
    Fp8GemmOptions with_bias;
    with_bias.bias = bias;
    const auto y = fp8_blockwise_gemm(a, b, at::kFloat, with_bias);
    const auto expected =
        at::matmul(a.dequantize(at::kDouble), b.dequantize(at::kDouble).t()) +
        bias.to(at::kBFloat16).to(at::kDouble);
    EXPECT_LE(relative_error(y, expected), 1e-6);
    EXPECT_LE(relative_error(y, at::matmul(x, w.t()) + bias), testing::kForwardBound);
    EXPECT_EQ(fp8_blockwise_gemm(a, b, at::kBFloat16).scalar_type(), at::kBFloat16);
    // Accumulating into an output, as a weight gradient into main_grad.
    Fp8GemmOptions accumulate;
    accumulate.out = at::randn({48, 80});
    accumulate.accumulate = true;
    const auto start = accumulate.out.clone();
    const auto sum = fp8_blockwise_gemm(a, b, at::kFloat, accumulate);
    EXPECT_TRUE(sum.is_same(accumulate.out));
    EXPECT_LE(relative_error(sum, expected - bias.to(at::kBFloat16).to(at::kDouble) +
                                      start.to(at::kDouble)),
              1e-6);
  }
}

TEST_F(BlockwiseTest, BadArgumentsAreNamed) {
  const auto a = quantize_blockwise(at::randn({16, 256}), tiles(Fp8BlockShape::k1x128)).data;
  const auto w2d = quantize_blockwise(at::randn({32, 256}), tiles(Fp8BlockShape::k128x128)).data;
  testing::ExpectErrorContaining([&] { fp8_blockwise_gemm(w2d, w2d, at::kFloat); },
                                 "a must be in 1x128 tiles");
  auto e5m2 = tiles(Fp8BlockShape::k1x128);
  e5m2.format = Fp8Format::kE5M2;
  const auto g = quantize_blockwise(at::randn({16, 256}), e5m2).data;
  testing::ExpectErrorContaining([&] { fp8_blockwise_gemm(g, g, at::kFloat); },
                                 "E5M2 x E5M2 is not supported");
  const auto odd = quantize_blockwise(at::randn({12, 256}), tiles(Fp8BlockShape::k1x128)).data;
  testing::ExpectErrorContaining([&] { fp8_blockwise_gemm(odd, w2d, at::kFloat); },
                                 "M, N multiples of 8");
  auto wrong = a;
  wrong.scale_inv = at::ones({16, 2});
  testing::ExpectErrorContaining([&] { fp8_blockwise_gemm(wrong, w2d, at::kFloat); },
                                 "a.scale_inv must be contiguous float32 [2, 16]");
  testing::ExpectErrorContaining([&] { fp8_blockwise_gemm(a, w2d, at::kHalf); },
                                 "out_dtype must be float32 or bfloat16");
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise(at::randn({4}), tiles(Fp8BlockShape::k1x128)); },
      "x must be a non-empty 2-D tensor");
  auto negative = tiles(Fp8BlockShape::k1x128);
  negative.amax_epsilon = -1;
  testing::ExpectErrorContaining([&] { quantize_blockwise(at::randn({4, 4}), negative); },
                                 "amax_epsilon must be finite and >= 0");
}

// cuBLASLt's block-scaled GEMMs against the CPU's product of the same tiles, for the three
// GEMMs of a linear layer's shapes (K not a multiple of 128): 1×128 × 128×128 (forward,
// dgrad) and 1×128 × 1×128 (wgrad), with a bias, in float32 and bfloat16.
TEST_F(BlockwiseTest, CudaGemmMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto x = testing::random_wide({272, 336}, at::kFloat);
  const auto w = at::randn({400, 336});
  const auto bias = at::randn({400});
  const auto a = quantize_blockwise(x, tiles(Fp8BlockShape::k1x128)).data;
  for (const auto block : {Fp8BlockShape::k128x128, Fp8BlockShape::k1x128}) {
    const auto b = quantize_blockwise(w, tiles(block)).data;
    const Fp8BlockwiseTensor a_gpu{a.data.cuda(), a.scale_inv.cuda(), a.format, a.block};
    const Fp8BlockwiseTensor b_gpu{b.data.cuda(), b.scale_inv.cuda(), b.format, b.block};
    Fp8GemmOptions with_bias;
    with_bias.bias = bias;
    Fp8GemmOptions with_bias_gpu;
    with_bias_gpu.bias = bias.cuda();
    const auto expected = fp8_blockwise_gemm(a, b, at::kFloat, with_bias);
    // Hopper's FP8 tensor cores add the products of a 128-element chunk with fewer mantissa
    // bits than float32 before each chunk is scaled into the float32 sum: the bound of
    // fp8_gemm's own CUDA float32 tests.
    EXPECT_LE(relative_error(fp8_blockwise_gemm(a_gpu, b_gpu, at::kFloat, with_bias_gpu), expected),
              2.5e-4);
    // Accumulating into an output on the GPU, as a weight gradient into main_grad.
    Fp8GemmOptions accumulate;
    accumulate.out = at::randn({272, 400}).cuda();
    accumulate.accumulate = true;
    const auto start = accumulate.out.cpu();
    EXPECT_LE(relative_error(fp8_blockwise_gemm(a_gpu, b_gpu, at::kFloat, accumulate),
                             fp8_blockwise_gemm(a, b, at::kFloat) + start),
              2.5e-4);
    // bfloat16 output: one more rounding, 2^-9 relative.
    EXPECT_LE(
        relative_error(fp8_blockwise_gemm(a_gpu, b_gpu, at::kBFloat16, with_bias_gpu), expected),
        4e-3);
  }
}

}  // namespace
}  // namespace amp8
