#include "ops/blockwise.h"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#define AMP8_HAS_CUDA_ALLOCATOR 1
#endif

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
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
  // Without the transpose the kernels differ (no transposed tile or column pass).
  const auto alone = quantize_blockwise(x.cuda(), options, /*transposed=*/false).data;
  EXPECT_TRUE(BytesEqual(alone.data, cpu.data.data)) << label << " (no transpose)";
  EXPECT_TRUE(BytesEqual(alone.scale_inv, cpu.data.scale_inv)) << label << " (no transpose)";
}

// CUDA and CPU give the same bytes: awkward shapes, every input dtype, both formats, both
// tile shapes, with and without power-of-two scales, with NaN, infinities and zero tiles.
TEST_F(BlockwiseTest, CudaMatchesCpuByteForByte_CUDA) {
  AMP8_REQUIRE_CUDA();
  // Shapes for every CUDA path: where cols % 8 == 0 (and with the transpose rows % 16 == 0;
  // partial tiles at both edges: 272 x 1000, 16 x 200, 400 x 136, 128 x 128) the one-read 1×128
  // kernels (the staged one for bf16 and fp16 with the transpose, the tile one otherwise) and
  // the vectorized 128×128 kernel (every dtype); the general kernels for the others.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 130}, {257, 385}, {128, 128}, {300, 1000}, {7, 64}, {272, 1000}, {16, 200}, {400, 136}};
  for (const auto& [rows, cols] : shapes) {
    auto x = testing::random_wide({rows, cols}, at::kFloat);
    if (rows * cols > 200) {
      x.view(-1)[3] = kNaN;
      x.view(-1)[4] = -kNaN;  // keeps its sign in float32 and float16 (bfloat16's cast drops it)
      x.view(-1)[150] = -kInf;
      x.narrow(0, rows - 1, 1).zero_();  // zero row tiles
      x.narrow(1, 1, 1).zero_();         // zero tiles of xᵀ
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

// dbias_out: the column sums (a layer's bias gradient, from the read that quantizes its output
// gradient), summed in float32 and rounded once into the bias's dtype, beside unchanged bytes.
TEST_F(BlockwiseTest, DbiasIsTheColumnSum) {
  const auto x = at::randn({300, 200}).to(at::kBFloat16);
  const auto plain = quantize_blockwise(x, tiles(Fp8BlockShape::k1x128), true);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    auto dbias = at::full({200}, 7.0f, dtype);
    const auto q = quantize_blockwise(x, tiles(Fp8BlockShape::k1x128), true, dbias);
    EXPECT_TRUE(BytesEqual(dbias, x.sum(0, false, at::kFloat).to(dtype))) << dtype;
    EXPECT_TRUE(BytesEqual(q.data.data, plain.data.data));
    EXPECT_TRUE(BytesEqual(q.transposed.data, plain.transposed.data));
  }
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise(x, tiles(Fp8BlockShape::k1x128), true, at::empty({199})); },
      "quantize_blockwise: dbias_out must be a contiguous float32, bfloat16 or float16 [200]");
}

// The CUDA dbias against the CPU's column sum: from the quantizing kernel (per-tile sums, then a
// fixed-order sum over the tiles) where it takes the shape (2-byte x with the transpose, rows %
// 16 == 0, cols % 8 == 0, aligned: 272 × 1000, 400 × 136, 128 × 128, 16 × 200, partial tiles
// included), from LibTorch's sum elsewhere (300 × 1000, float32 x, no transpose, x 2 bytes off
// alignment); the bytes and scales beside it the CPU's. Normal data: a lost or doubled tile of
// 128 rows moves a column sum by ~11, far outside the rounding bound.
TEST_F(BlockwiseTest, CudaDbiasMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  struct Case {
    int64_t rows, cols;
    at::ScalarType dtype;
    bool transposed;
    bool misaligned = false;  // x starts 2 bytes into its storage: LibTorch's sum instead
  };
  const std::vector<Case> cases = {
      {272, 1000, at::kBFloat16, true}, {400, 136, at::kHalf, true},
      {128, 128, at::kBFloat16, true},  {16, 200, at::kHalf, true},
      {300, 1000, at::kBFloat16, true}, {272, 1000, at::kFloat, true},
      {272, 1000, at::kBFloat16, false}, {272, 1000, at::kBFloat16, true, true}};
  for (const auto& c : cases) {
    const std::string label = testing::shape_name(c.rows, c.cols) + " " +
                              c10::toString(c.dtype) + (c.transposed ? " with the transpose" : "") +
                              (c.misaligned ? " misaligned" : "");
    auto x = at::randn({c.rows, c.cols}).to(c.dtype);
    // A NaN, an infinity and a zero column among the values quantized beside the sums: their
    // columns are left out of the sum comparison (NaN and inf there on both sides).
    x[5][3] = -kNaN;
    x[7][11] = kInf;
    x.narrow(1, 1, 1).zero_();
    auto x_gpu = x.cuda();
    if (c.misaligned) {
      x_gpu = at::empty({x.numel() + 1}, x_gpu.options()).narrow(0, 1, x.numel()).view_as(x);
      x_gpu.copy_(x.cuda());
    }
    auto options = tiles(Fp8BlockShape::k1x128);
    options.format = Fp8Format::kE5M2;  // a gradient's format under "hybrid"
    auto dbias_cpu = at::empty({c.cols});
    auto dbias_gpu = at::full({c.cols}, kNaN, at::kCUDA);
    const auto cpu = quantize_blockwise(x, options, c.transposed, dbias_cpu);
    const auto gpu = quantize_blockwise(x_gpu, options, c.transposed, dbias_gpu);
    EXPECT_TRUE(BytesEqual(gpu.data.data, cpu.data.data)) << label;
    EXPECT_TRUE(BytesEqual(gpu.data.scale_inv, cpu.data.scale_inv)) << label;
    if (c.transposed) {
      EXPECT_TRUE(BytesEqual(gpu.transposed.data, cpu.transposed.data)) << label;
      EXPECT_TRUE(BytesEqual(gpu.transposed.scale_inv, cpu.transposed.scale_inv)) << label;
    }
    const auto sums_gpu = dbias_gpu.cpu();
    EXPECT_TRUE(std::isnan(sums_gpu[3].item<float>())) << label;
    EXPECT_EQ(sums_gpu[11].item<float>(), kInf) << label;
    EXPECT_EQ(sums_gpu[1].item<float>(), 0.0f) << label;
    auto finite = at::ones({c.cols}, at::kBool);
    finite[3] = false;
    finite[11] = false;
    const auto bound = x.to(at::kFloat).abs().sum(0) * 1e-5f + 1e-6f;
    const auto error = (sums_gpu - dbias_cpu).abs();
    EXPECT_TRUE((error <= bound).logical_or(finite.logical_not()).all().item<bool>())
        << label << ": largest error " << error.masked_fill(finite.logical_not(), 0).max().item<float>();
    // In the bias's half dtype: the float32 sum rounded once (compared where finite: NaN's
    // encoding differs between conversions).
    auto rounded = at::full({c.cols}, kNaN, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
    quantize_blockwise(x_gpu, options, c.transposed, rounded);
    EXPECT_TRUE(BytesEqual(rounded.cpu().masked_select(finite),
                           dbias_gpu.to(at::kBFloat16).cpu().masked_select(finite)))
        << label;
  }
}

// ---- a gradient in column pieces (quantize_blockwise_columns) ----

// The pieces' tiles are the concatenation's: bytes, scales, the transpose and dbias, for pieces
// of whole tiles and for a piece whose tiles would span the next (the concatenation then); one
// piece is quantize_blockwise itself. Bad pieces are named.
TEST_F(BlockwiseTest, ColumnPiecesQuantizeAsTheirConcatenation) {
  const auto options = tiles(Fp8BlockShape::k1x128);
  for (const auto& widths : std::vector<std::vector<int64_t>>{{256, 128, 72}, {200, 56}, {96}}) {
    std::vector<at::Tensor> pieces;
    for (const auto w : widths) pieces.push_back(at::randn({150, w}).to(at::kBFloat16) * (1 + w % 7));
    const auto whole = at::cat(pieces, 1);
    auto dbias = at::empty({whole.size(1)}), dbias_whole = at::empty({whole.size(1)});
    const auto q = quantize_blockwise_columns(pieces, options, true, dbias);
    const auto expected = quantize_blockwise(whole, options, true, dbias_whole);
    const auto label = testing::shape_name(150, whole.size(1)) + " in " +
                       std::to_string(widths.size()) + " pieces";
    EXPECT_TRUE(BytesEqual(q.data.data, expected.data.data)) << label;
    EXPECT_TRUE(BytesEqual(q.data.scale_inv, expected.data.scale_inv)) << label;
    EXPECT_TRUE(BytesEqual(q.transposed.data, expected.transposed.data)) << label;
    EXPECT_TRUE(BytesEqual(q.transposed.scale_inv, expected.transposed.scale_inv)) << label;
    EXPECT_TRUE(BytesEqual(dbias, dbias_whole)) << label;
  }
  const std::vector<at::Tensor> pieces = {at::randn({8, 128}), at::randn({8, 64})};
  testing::ExpectErrorContaining([&] { quantize_blockwise_columns({}, options); },
                                 "quantize_blockwise_columns: pieces must hold at least one tensor");
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise_columns(pieces, tiles(Fp8BlockShape::k128x128)); },
      "quantize_blockwise_columns: options.block must be 1x128");
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise_columns({pieces[0], at::randn({9, 64})}, options); },
      "quantize_blockwise_columns: pieces[1] must be 2-D with pieces[0]'s rows, dtype and device");
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise_columns({pieces[0], pieces[1].to(at::kDouble)}, options); },
      "pieces[1] must be 2-D with pieces[0]'s rows, dtype and device");
  testing::ExpectErrorContaining(
      [&] {
        quantize_blockwise_columns({pieces[0].to(at::kDouble), pieces[1].to(at::kDouble)},
                                   options);
      },
      "quantize_blockwise_columns: pieces[0] must be float32, bfloat16 or float16");
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise_columns(pieces, options, true, at::empty({128})); },
      "quantize_blockwise_columns: dbias_out must be a contiguous float32, bfloat16 or float16 "
      "[192]");
}

// On the GPU, pieces of whole tiles are quantized by one launch each into the concatenation's
// layouts: the CPU reference's bytes and scales (x and xᵀ), and dbias bit for bit the GPU's
// quantize_blockwise of the concatenation (the same per-tile sums in the same order). Cases for
// each route: the per-piece launches (bfloat16 and float16, both formats, a last piece of a
// partial tile, a QKV projection's three equal pieces, NaN and infinity in a piece), and the
// concatenation where a piece is not whole tiles, float32, not contiguous, or no transpose is
// asked for. A piece written at the wrong columns, with its rows or scales at the wrong stride,
// or a missing piece shows in the bytes. That the per-piece cases take their route (the other
// gives the same bytes) shows in memory: the concatenation allocates a copy of the pieces, the
// per-piece launches only the outputs.
TEST_F(BlockwiseTest, CudaColumnPiecesMatchCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  struct Case {
    int64_t rows;
    std::vector<int64_t> widths;
    at::ScalarType dtype;
    Fp8Format format;
    bool transposed = true;
    bool strided = false;  // piece 1 is a column slice of a wider tensor
    bool per_piece = false;  // the per-piece launches' route, not the concatenation
  };
  const std::vector<Case> cases = {
      {272, {256, 384, 136}, at::kBFloat16, Fp8Format::kE5M2, true, false, true},
      {400, {128, 128, 128}, at::kHalf, Fp8Format::kE4M3, true, false, true},
      {48, {384, 384, 384}, at::kBFloat16, Fp8Format::kE4M3, true, false, true},
      {272, {200, 256}, at::kBFloat16, Fp8Format::kE5M2},          // a piece of a partial tile
      {272, {256, 136}, at::kFloat, Fp8Format::kE5M2},             // float32
      {272, {256, 128}, at::kBFloat16, Fp8Format::kE5M2, false},   // no transpose
      {272, {256, 128, 128}, at::kBFloat16, Fp8Format::kE5M2, true, true}};
  for (const auto& c : cases) {
    std::string label = std::to_string(c.rows) + " rows, widths";
    for (const auto w : c.widths) label += " " + std::to_string(w);
    label += std::string(" ") + c10::toString(c.dtype) + (c.transposed ? "" : " no transpose") +
             (c.strided ? " strided" : "");
    std::vector<at::Tensor> cpu_pieces, gpu_pieces;
    for (size_t i = 0; i < c.widths.size(); ++i) {
      auto piece = (at::randn({c.rows, c.widths[i]}) * (1.0 + 3.0 * i)).to(c.dtype);
      if (i == 0) {
        piece[5][3] = kNaN;
        piece[7][11] = kInf;
      }
      cpu_pieces.push_back(piece);
      auto gpu = piece.cuda();
      if (c.strided && i == 1) {
        gpu = at::zeros({c.rows, c.widths[i] + 64}, gpu.options()).narrow(1, 32, c.widths[i]);
        gpu.copy_(piece.cuda());
      }
      gpu_pieces.push_back(gpu);
    }
    auto options = tiles(Fp8BlockShape::k1x128);
    options.format = c.format;
    const int64_t cols = at::cat(cpu_pieces, 1).size(1);
    auto dbias_gpu = at::full({cols}, kNaN, at::TensorOptions(at::kCUDA).dtype(c.dtype));
    auto dbias_whole = at::full({cols}, kNaN, at::TensorOptions(at::kCUDA).dtype(c.dtype));
    auto dbias_cpu = at::empty({cols}, c.dtype);
#ifdef AMP8_HAS_CUDA_ALLOCATOR
    namespace allocator = c10::cuda::CUDACachingAllocator;
    const auto device = at::cuda::current_device();
    allocator::resetPeakStats(device);
    const auto allocated_before = allocator::getDeviceStats(device).allocated_bytes[0].current;
#endif
    const auto gpu = quantize_blockwise_columns(gpu_pieces, options, c.transposed, dbias_gpu);
#ifdef AMP8_HAS_CUDA_ALLOCATOR
    // The outputs (x and xᵀ in FP8, their scales, the column sums' parts) against a
    // concatenation of the pieces in their own dtype on top of them.
    const int64_t outputs = 2 * c.rows * cols + 4 * 3 * (c.rows / 128 + 1) * cols +
                            4 * (cols / 128 + 1) * c.rows;
    const int64_t concatenation = c.rows * cols * c10::elementSize(c.dtype);
    const auto peak = allocator::getDeviceStats(device).allocated_bytes[0].peak - allocated_before;
    if (c.per_piece) {
      EXPECT_LT(peak, outputs + concatenation / 2) << label << ": the pieces were concatenated";
    } else {
      EXPECT_GE(peak, concatenation) << label << ": the fallback did not concatenate";
    }
#endif
    const auto cpu = quantize_blockwise_columns(cpu_pieces, options, c.transposed, dbias_cpu);
    quantize_blockwise(at::cat(gpu_pieces, 1), options, c.transposed, dbias_whole);
    EXPECT_TRUE(BytesEqual(gpu.data.data, cpu.data.data)) << label;
    EXPECT_TRUE(BytesEqual(gpu.data.scale_inv, cpu.data.scale_inv)) << label;
    if (c.transposed) {
      EXPECT_TRUE(BytesEqual(gpu.transposed.data, cpu.transposed.data)) << label;
      EXPECT_TRUE(BytesEqual(gpu.transposed.scale_inv, cpu.transposed.scale_inv)) << label;
    } else {
      EXPECT_FALSE(gpu.transposed.defined()) << label;
    }
    // Column 3 holds the NaN, 11 the infinity; elsewhere the sums are finite and compared as
    // bytes (NaN's encoding differs between routes).
    auto finite = at::ones({cols}, at::kBool);
    finite[3] = false;
    finite[11] = false;
    EXPECT_TRUE(BytesEqual(dbias_gpu.cpu().masked_select(finite),
                           dbias_whole.cpu().masked_select(finite)))
        << label;
    const auto error = (dbias_gpu.cpu().to(at::kFloat) - dbias_cpu.to(at::kFloat)).abs();
    const auto bound = at::cat(cpu_pieces, 1).to(at::kFloat).abs().sum(0) * 1e-2f + 1e-3f;
    EXPECT_TRUE((error <= bound).logical_or(finite.logical_not()).all().item<bool>()) << label;
  }
}

// ---- GELU and its backward inside the quantization (quantize_blockwise_gelu / _dgelu) ----

// How many bytes of two quantizations with the same tile scales differ, and by how many FP8
// steps at most: the codes' sign-magnitude integers, where neighbouring values differ by one.
struct Fp8Difference {
  int64_t differing = 0;
  int64_t largest_steps = 0;
};
Fp8Difference fp8_difference(const Fp8BlockwiseTensor& a, const Fp8BlockwiseTensor& b) {
  const auto codes = [](const Fp8BlockwiseTensor& t) {
    const auto bytes = t.data.cpu().view(at::kByte).to(at::kInt);
    const auto magnitude = bytes.bitwise_and(0x7F);
    return at::where(bytes.bitwise_and(0x80).ne(0), -magnitude, magnitude);
  };
  const auto steps = (codes(a) - codes(b)).abs();
  return {steps.ne(0).sum().item<int64_t>(), steps.max().item<int64_t>()};
}

// Two quantizations of nearly the same values: the same tile scales, and at most `allowed` bytes
// apart, each by one FP8 step; x's tiles and, with `transposed`, xᵀ's.
void expect_within_one_step(const Fp8BlockwiseCastTranspose& actual,
                            const Fp8BlockwiseCastTranspose& expected, bool transposed,
                            int64_t allowed, const std::string& label) {
  for (const bool t : {false, true}) {
    if (t && !transposed) continue;
    const auto& a = t ? actual.transposed : actual.data;
    const auto& b = t ? expected.transposed : expected.data;
    const std::string where = label + (t ? " (transposed)" : "");
    const auto d = fp8_difference(a, b);
    EXPECT_LE(d.differing, allowed) << where;
    EXPECT_LE(d.largest_steps, 1) << where;
    EXPECT_TRUE(BytesEqual(a.scale_inv, b.scale_inv)) << where << ": scales";
  }
}

// The activation's values as LibTorch computes them in float32, written in x's dtype: what TE's
// blockwise recipe quantizes (the activation in the input's precision, then its tiles).
at::Tensor libtorch_gelu_written(const at::Tensor& x, const at::Tensor& gelu_input = {}) {
  const auto values = gelu_input.defined() ? at::gelu_backward(x.to(at::kFloat),
                                                               gelu_input.to(at::kFloat), "tanh")
                                           : at::gelu(x.to(at::kFloat), "tanh");
  return values.to(x.scalar_type());
}

// The fused quantization against quantize_blockwise of LibTorch's GELU (or its backward) written
// in x's dtype, x and xᵀ, on the CPU: the same tiles but where the two tanh computations (expf
// against LibTorch's tanh) round a value apart in x's dtype (allowed: 2 + numel / 1000, one FP8
// step each). GELU's input stays within ±3: below -3.5 both float32 formulas compute gelu'(x)
// as 1 + tanh(u) ≈ 1e-5 from a tanh near -1, lose most of its digits, and disagree by about 1%
// there (a few percent of those bytes). Quantizing the float32 activation without writing it in
// bfloat16 first moves about 3% of the bytes (double rounding), and a missing activation all of
// them. Awkward shapes: partial tiles at both edges.
TEST_F(BlockwiseTest, GeluTilesAreTheTilesOfTheActivationWrittenInTheInputDtype) {
  for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{300, 200}, {37, 130}}) {
      const std::string label = testing::shape_name(rows, cols) + " " + c10::toString(dtype);
      const auto x = (at::randn({rows, cols}) * 3).clamp(-3, 3).to(dtype);
      const auto grad = (at::randn({rows, cols}) * 0.01).to(dtype);
      auto forward = tiles(Fp8BlockShape::k1x128);
      auto backward = forward;
      backward.format = Fp8Format::kE5M2;
      const auto allowed = 2 + rows * cols / 1000;
      expect_within_one_step(quantize_blockwise_gelu(x, forward, true),
                             quantize_blockwise(libtorch_gelu_written(x), forward, true), true,
                             allowed, "gelu " + label);
      auto dbias = at::empty({cols});
      const auto fused = quantize_blockwise_dgelu(grad, x, backward, true, dbias);
      const auto written = libtorch_gelu_written(grad, x);
      expect_within_one_step(fused, quantize_blockwise(written, backward, true), true, allowed,
                             "dgelu " + label);
      // FC1's bias gradient: the column sums of the values quantized (as written in x's dtype).
      const auto sums = written.to(at::kFloat).sum(0);
      EXPECT_LT(relative_error(dbias, sums), 1e-3) << label;
    }
  }
}

// The one-read CUDA kernels (bfloat16 and float16 with the transpose, rows % 16 == 0, cols % 8
// == 0: 272 × 1000, 400 × 136, 16 × 200) and the unfused path elsewhere (300 × 1000, float32,
// no transpose, a misaligned GELU input) against the CPU: GPU and CPU compute exp in their own
// ways (__expf against expf), so a value may land on the other side of a rounding in x's dtype
// now and then (allowed: 2 + numel / 1000, each at most one FP8 step; GELU's input within ±3,
// as on the CPU); the tile scales agree
// (power-of-two scales: a tile's scale moves only when its amax crosses a power of two). A lost
// activation, a wrong rounding or a misplaced tile moves far more. dbias (FC1's bias gradient)
// from the kernel's per-tile column sums against the CPU's.
TEST_F(BlockwiseTest, CudaGeluTilesMatchCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  struct Case {
    int64_t rows, cols;
    at::ScalarType dtype;
    bool transposed;
    bool misaligned = false;  // the GELU input starts 2 bytes into its storage
  };
  const std::vector<Case> cases = {
      {272, 1000, at::kBFloat16, true}, {400, 136, at::kHalf, true},
      {16, 200, at::kBFloat16, true},   {300, 1000, at::kBFloat16, true},
      {272, 1000, at::kFloat, true},    {272, 1000, at::kBFloat16, false},
      {272, 1000, at::kBFloat16, true, true}};
  for (const auto& c : cases) {
    for (const auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const std::string label = testing::shape_name(c.rows, c.cols) + " " +
                                c10::toString(c.dtype) + (c.transposed ? " with the transpose" : "") +
                                (c.misaligned ? " misaligned" : "") +
                                (format == Fp8Format::kE4M3 ? " e4m3" : " e5m2");
      const auto x = (at::randn({c.rows, c.cols}) * 3).clamp(-3, 3).to(c.dtype);
      const auto grad = (at::randn({c.rows, c.cols}) * 0.01).to(c.dtype);
      auto x_gpu = x.cuda();
      if (c.misaligned) {
        x_gpu = at::empty({x.numel() + 1}, x_gpu.options()).narrow(0, 1, x.numel()).view_as(x);
        x_gpu.copy_(x.cuda());
      }
      auto options = tiles(Fp8BlockShape::k1x128);
      options.format = format;
      const auto allowed = 2 + c.rows * c.cols / 1000;
      expect_within_one_step(quantize_blockwise_gelu(x.cuda(), options, c.transposed),
                             quantize_blockwise_gelu(x, options, c.transposed), c.transposed,
                             allowed, "gelu " + label);
      auto dbias_cpu = at::empty({c.cols});
      auto dbias_gpu = at::full({c.cols}, kNaN, at::kCUDA);
      expect_within_one_step(
          quantize_blockwise_dgelu(grad.cuda(), x_gpu, options, c.transposed, dbias_gpu),
          quantize_blockwise_dgelu(grad, x, options, c.transposed, dbias_cpu), c.transposed,
          allowed, "dgelu " + label);
      const auto bound = libtorch_gelu_written(grad, x).to(at::kFloat).abs().sum(0) * 1e-3f + 1e-6f;
      const auto error = (dbias_gpu.cpu() - dbias_cpu).abs();
      EXPECT_TRUE((error <= bound).all().item<bool>())
          << label << ": largest dbias error " << error.max().item<float>();
    }
  }
}

TEST_F(BlockwiseTest, BadGeluInputsAreNamed) {
  const auto grad = at::randn({16, 256}).to(at::kBFloat16);
  const auto options = tiles(Fp8BlockShape::k1x128);
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise_dgelu(grad, at::randn({16, 256}), options); },
      "quantize_blockwise_dgelu: gelu_input must be a contiguous BFloat16 [16, 256] tensor");
  testing::ExpectErrorContaining([&] { quantize_blockwise_dgelu(grad, {}, options); },
                                 "quantize_blockwise_dgelu: gelu_input must be defined");
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise_gelu(at::randn({4}), options); },
      "quantize_blockwise_gelu: x must be a non-empty 2-D tensor");
  testing::ExpectErrorContaining(
      [&] { quantize_blockwise_dgelu(grad, grad, options, true, at::empty({255})); },
      "quantize_blockwise_dgelu: dbias_out must be a contiguous float32, bfloat16 or float16 [256]");
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
    // A residual added by the GEMM, beside the bias (a block's residual connection).
    Fp8GemmOptions residual = with_bias;
    residual.residual = at::randn({48, 80}) * 4;
    EXPECT_LE(relative_error(fp8_blockwise_gemm(a, b, at::kFloat, residual),
                             expected + residual.residual.to(at::kDouble)),
              1e-6);
  }
  Fp8GemmOptions wrong_residual;
  wrong_residual.residual = at::zeros({48, 80}, at::kBFloat16);
  testing::ExpectErrorContaining(
      [&] { fp8_blockwise_gemm(a, quantize_blockwise(w, tiles(Fp8BlockShape::k1x128)).data, at::kFloat, wrong_residual); },
      "fp8_blockwise_gemm: residual must be a contiguous Float [48, 80] on cpu, got BFloat16");
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
    // A residual added by the GEMM (C at beta = 1), float32 and bfloat16, scaled up so that one
    // left out or added twice shows.
    const auto residual = at::randn({272, 400}) * 4;
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      Fp8GemmOptions with_residual = with_bias_gpu;
      with_residual.residual = residual.to(dtype).cuda();
      EXPECT_LE(relative_error(fp8_blockwise_gemm(a_gpu, b_gpu, dtype, with_residual),
                               expected + residual.to(dtype).to(at::kFloat)),
                dtype == at::kFloat ? 2.5e-4 : 4e-3)
          << dtype;
    }
  }
}

// ---- a weight's 128×128 blocks from shards of it (blockwise fp8_params) ----

// `weight` [rows, cols] cut at `cuts` (flat offsets, increasing) into shards, as data-parallel
// ranks hold it; each "rank" takes its block amaxes alone, the max over ranks stands in for the
// all-reduce, and each quantizes its shard. Returns the bytes put back together and the
// scale_inv grid (rank 0's; every rank writes the whole grid, checked equal).
std::pair<at::Tensor, at::Tensor> quantize_in_shards(const at::Tensor& weight,
                                                     const std::vector<int64_t>& cuts,
                                                     const BlockwiseQuantizeOptions& options) {
  const int64_t rows = weight.size(0), cols = weight.size(1), n = weight.numel();
  const auto flat = weight.contiguous().view(-1);
  std::vector<int64_t> bounds{0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(n);
  const std::vector<int64_t> grid{(rows + 127) / 128, (cols + 127) / 128};
  const auto float_options = weight.options().dtype(at::kFloat);
  std::vector<Fp8WeightShard> shards;
  std::vector<at::Tensor> rank_amaxes;
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    shards.push_back({flat.narrow(0, bounds[r], bounds[r + 1] - bounds[r]), rows, cols, bounds[r]});
    rank_amaxes.push_back(at::zeros(grid, float_options));
    blockwise_shard_amax({shards.back()}, {rank_amaxes.back()});
  }
  const auto amax = at::stack(rank_amaxes).amax(0);
  auto bytes = at::empty({n}, weight.options().dtype(fp8_dtype(options.format)));
  at::Tensor scale_inv;
  for (size_t r = 0; r < shards.size(); ++r) {
    auto rank_scale_inv = at::zeros(blockwise_scale_shape(rows, cols, Fp8BlockShape::k128x128), float_options);
    quantize_shards_blockwise({shards[r]}, {amax.clone()}, options,
                              {bytes.narrow(0, shards[r].offset, shards[r].values.numel())},
                              {rank_scale_inv});
    if (r == 0) {
      scale_inv = rank_scale_inv;
    } else {
      EXPECT_TRUE(BytesEqual(rank_scale_inv, scale_inv)) << "rank " << r << "'s scale_inv";
    }
  }
  return {bytes.view({rows, cols}), scale_inv};
}

// However a weight is cut (inside a row, inside a block, on a block edge, one element), the
// shards' blocks give the bytes and scales of quantizing the whole weight at once; a block with a
// NaN ignores it (the NaN stays NaN), an outlier scales only its block, an all-zero block has
// scale 1.
TEST_F(BlockwiseTest, ShardsOfAWeightQuantizeAsTheWholeWeight) {
  const std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>>> cases = {
      {200, 176, {1}},                       // a shard of one element
      {200, 176, {176 * 128, 176 * 128 + 5}},  // on a block row's edge, then inside a row
      {257, 385, {1000, 50000, 50001, 98000}},
      {128, 128, {64 * 128 + 64}},
      {7, 130, {500}},
  };
  for (const auto& [rows, cols, cuts] : cases) {
    SCOPED_TRACE(testing::shape_name(rows, cols) + " in " + std::to_string(cuts.size() + 1) + " shards");
    auto weight = testing::random_wide({rows, cols}, at::kFloat);
    weight[0][1] = 1e5f;  // an outlier in block (0, 0): random_wide stays below ~2^11
    if (rows > 128 && cols > 128) {
      weight.narrow(0, 128, std::min<int64_t>(128, rows - 128)).narrow(1, 128, std::min<int64_t>(128, cols - 128)).zero_();
    }
    weight[rows - 1][cols - 1] = kNaN;
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const auto x = weight.to(dtype);
      const auto options = weight_block_options();
      const auto whole = quantize_blockwise(x, options).data;
      const auto [bytes, scale_inv] = quantize_in_shards(x, cuts, options);
      EXPECT_TRUE(BytesEqual(bytes, whole.data)) << c10::toString(dtype);
      EXPECT_TRUE(BytesEqual(scale_inv, whole.scale_inv)) << c10::toString(dtype);
    }
    // The outlier's block is scaled for it: 448/1e5 = 0.00448 → 2^-8, scale_inv 256.
    const auto [bytes, scale_inv] = quantize_in_shards(weight, cuts, weight_block_options());
    EXPECT_EQ(at2(scale_inv, 0, 0), 256.0f);
    if (rows > 128 && cols > 128) {
      EXPECT_EQ(at2(scale_inv, 1, 1), 1.0f) << "an all-zero block (and a NaN)";
    }
    EXPECT_TRUE(std::isnan(bytes[rows - 1][cols - 1].to(at::kFloat).item<float>()));
  }
}

// Whole weights (one rank holds them all) in one call: quantize_blockwise's bytes and scales of
// each weight, in every input dtype and both formats; a block with an outlier, an all-zero block,
// a NaN, and edges that are not whole blocks.
struct WholeWeights {
  std::vector<Fp8WeightShard> shards;
  std::vector<at::Tensor> outs, scale_invs;
};

WholeWeights whole_weights(const std::vector<at::Tensor>& weights, Fp8Format format) {
  WholeWeights w;
  for (const auto& weight : weights) {
    const int64_t rows = weight.size(0), cols = weight.size(1);
    w.shards.push_back({weight.reshape({-1}), rows, cols, 0});
    w.outs.push_back(at::empty({rows * cols}, weight.options().dtype(fp8_dtype(format))));
    w.scale_invs.push_back(at::zeros(blockwise_scale_shape(rows, cols, Fp8BlockShape::k128x128),
                                     weight.options().dtype(at::kFloat)));
  }
  return w;
}

std::vector<at::Tensor> awkward_weights(at::ScalarType dtype) {
  std::vector<at::Tensor> weights;
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {200, 176}, {257, 385}, {128, 128}, {7, 130}, {1, 1}, {384, 256}}) {
    auto w = testing::random_wide({rows, cols}, at::kFloat);
    w[0][cols > 1 ? 1 : 0] = 1e5f;  // an outlier in block (0, 0)
    if (rows > 128 && cols > 128) w.narrow(0, 128, 72).narrow(1, 128, 48).zero_();
    if (rows * cols > 1) w[rows - 1][cols - 1] = kNaN;
    weights.push_back(w.to(dtype));
  }
  return weights;
}

TEST_F(BlockwiseTest, WholeWeightsQuantizeAsQuantizeBlockwise) {
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (format == Fp8Format::kE4M3 ? " e4m3" : " e5m2"));
      const auto weights = awkward_weights(dtype);
      auto w = whole_weights(weights, format);
      const auto options = weight_block_options(format);
      quantize_whole_weights_blockwise(w.shards, options, w.outs, w.scale_invs);
      for (size_t k = 0; k < weights.size(); ++k) {
        const auto expected = quantize_blockwise(weights[k], options).data;
        EXPECT_TRUE(BytesEqual(w.outs[k].view(weights[k].sizes()), expected.data)) << "weight " << k;
        EXPECT_TRUE(BytesEqual(w.scale_invs[k], expected.scale_inv)) << "weight " << k;
      }
    }
  }
}

TEST_F(BlockwiseTest, APartOfAWeightIsNotWhole) {
  const auto values = at::randn({100});
  auto w = whole_weights({values.view({10, 10})}, Fp8Format::kE4M3);
  w.shards[0] = {values.narrow(0, 1, 99), 10, 10, 1};
  w.outs[0] = at::empty({99}, at::kFloat8_e4m3fn);
  testing::ExpectErrorContaining(
      [&] { quantize_whole_weights_blockwise(w.shards, weight_block_options(), w.outs, w.scale_invs); },
      "quantize_whole_weights_blockwise: shards[0] holds elements [1, 100) of a 10 x 10 weight; it "
      "must hold all of it");
  w.shards[0] = {values.narrow(0, 0, 99), 10, 10, 0};
  testing::ExpectErrorContaining(
      [&] { quantize_whole_weights_blockwise(w.shards, weight_block_options(), w.outs, w.scale_invs); },
      "shards[0] holds elements [0, 99) of a 10 x 10 weight");
  w = whole_weights({values.view({10, 10})}, Fp8Format::kE4M3);
  w.outs[0] = at::empty({100}, at::kFloat8_e5m2);
  testing::ExpectErrorContaining(
      [&] { quantize_whole_weights_blockwise(w.shards, weight_block_options(), w.outs, w.scale_invs); },
      "quantize_whole_weights_blockwise: outs[0] must be contiguous Float8_e4m3fn with 100 elements");
}

// A weight in blocks transposed is the transpose quantize_blockwise makes from the values.
TEST_F(BlockwiseTest, TransposedBlocksAreTheTransposeOfTheValues) {
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{200, 176}, {130, 7}, {128, 384}}) {
    const auto x = testing::random_wide({rows, cols}, at::kFloat);
    const auto q = quantize_blockwise(x, weight_block_options(), /*transposed=*/true);
    const auto t = transpose_blocks(q.data);
    EXPECT_TRUE(BytesEqual(t.data, q.transposed.data)) << testing::shape_name(rows, cols);
    EXPECT_TRUE(BytesEqual(t.scale_inv, q.transposed.scale_inv)) << testing::shape_name(rows, cols);
  }
}

TEST_F(BlockwiseTest, BadShardsAreNamed) {
  const auto values = at::randn({100});
  const auto grid = at::zeros({1, 1});
  testing::ExpectErrorContaining([&] { blockwise_shard_amax({{values, 10, 10, 1}}, {grid}); },
                                 "blockwise_shard_amax: shards[0]: elements [1, 101) run past its weight's 100");
  testing::ExpectErrorContaining([&] { blockwise_shard_amax({{values, 10, 10, 0}}, {at::zeros({2, 1})}); },
                                 "amaxes[0] must be contiguous float32 [1, 1]");
  testing::ExpectErrorContaining(
      [&] { blockwise_shard_amax({{values.to(at::kInt), 10, 10, 0}}, {grid}); },
      "shards[0].values must be float32, bfloat16 or float16");
  testing::ExpectErrorContaining(
      [&] {
        quantize_shards_blockwise({{values, 10, 10, 0}}, {grid}, tiles(Fp8BlockShape::k1x128),
                                  {at::empty({100}, at::kFloat8_e4m3fn)}, {at::zeros({1, 4})});
      },
      "options.block must be 128x128");
  testing::ExpectErrorContaining(
      [&] {
        quantize_shards_blockwise({{values, 10, 10, 0}}, {grid}, weight_block_options(),
                                  {at::empty({99}, at::kFloat8_e4m3fn)}, {at::zeros({1, 4})});
      },
      "outs[0] must be contiguous Float8_e4m3fn with 100 elements");
  testing::ExpectErrorContaining(
      [&] {
        quantize_shards_blockwise({{values, 10, 10, 0}}, {grid}, weight_block_options(),
                                  {at::empty({100}, at::kFloat8_e4m3fn)}, {at::zeros({1, 1})});
      },
      "scale_invs[0] must be contiguous float32 [1, 4]");
  // Shards on two devices are refused before any is read (a CPU loop must not read another
  // device's memory).
  testing::ExpectErrorContaining(
      [&] { blockwise_shard_amax({{values, 10, 10, 0}, {at::empty({100}, at::kMeta), 10, 10, 0}}, {grid, grid}); },
      "blockwise_shard_amax: shards[1].values is on meta, shards[0]'s on cpu; every shard must be on one device");
  testing::ExpectErrorContaining(
      [&] {
        quantize_whole_weights_blockwise({{values, 10, 10, 0}, {at::empty({100}, at::kMeta), 10, 10, 0}},
                                         weight_block_options(),
                                         {at::empty({100}, at::kFloat8_e4m3fn), at::empty({100}, at::kFloat8_e4m3fn)},
                                         {at::zeros({1, 4}), at::zeros({1, 4})});
      },
      "quantize_whole_weights_blockwise: shards[1].values is on meta");
}

// The kernels against the CPU reference: many shards of several weights in one call (more than
// one launch's 64), every input dtype, both formats, amaxes max-merged into non-zero grids.
TEST_F(BlockwiseTest, ShardKernelsMatchCpuByteForByte_CUDA) {
  AMP8_REQUIRE_CUDA();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{257, 385}, {200, 176}, {16, 1000}, {130, 130}};
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (format == Fp8Format::kE4M3 ? " e4m3" : " e5m2"));
      std::vector<at::Tensor> weights;
      std::vector<Fp8WeightShard> shards;
      std::vector<at::Tensor> amaxes_cpu;
      for (int k = 0; k < 80; ++k) {
        const auto [rows, cols] = shapes[static_cast<size_t>(k) % shapes.size()];
        weights.push_back(testing::random_wide({rows, cols}, at::kFloat).to(dtype).view(-1));
        const int64_t n = rows * cols, begin = (k * 7919) % (n - 1), end = std::min(n, begin + 1 + (k * 104729) % n);
        shards.push_back({weights.back().narrow(0, begin, end - begin), rows, cols, begin});
        // A grid that already holds values (another shard's): the max is kept.
        amaxes_cpu.push_back(at::rand({(rows + 127) / 128, (cols + 127) / 128}) * (k % 3 == 0 ? 8.0 : 0.0));
      }
      std::vector<Fp8WeightShard> gpu_shards = shards;
      std::vector<at::Tensor> amaxes_gpu;
      for (size_t k = 0; k < shards.size(); ++k) {
        gpu_shards[k].values = shards[k].values.cuda();
        amaxes_gpu.push_back(amaxes_cpu[k].cuda());
      }
      blockwise_shard_amax(shards, amaxes_cpu);
      blockwise_shard_amax(gpu_shards, amaxes_gpu);
      auto options = weight_block_options(format);
      std::vector<at::Tensor> outs_cpu, outs_gpu, scale_cpu, scale_gpu;
      for (size_t k = 0; k < shards.size(); ++k) {
        EXPECT_TRUE(BytesEqual(amaxes_gpu[k].cpu(), amaxes_cpu[k])) << "amaxes of shard " << k;
        outs_cpu.push_back(at::empty({shards[k].values.numel()}, at::TensorOptions().dtype(fp8_dtype(format))));
        outs_gpu.push_back(outs_cpu.back().cuda());
        const auto shape = blockwise_scale_shape(shards[k].rows, shards[k].cols, Fp8BlockShape::k128x128);
        scale_cpu.push_back(at::zeros(shape));
        scale_gpu.push_back(at::zeros(shape).cuda());
      }
      quantize_shards_blockwise(shards, amaxes_cpu, options, outs_cpu, scale_cpu);
      quantize_shards_blockwise(gpu_shards, amaxes_gpu, options, outs_gpu, scale_gpu);
      for (size_t k = 0; k < shards.size(); ++k) {
        EXPECT_TRUE(BytesEqual(outs_gpu[k].cpu(), outs_cpu[k])) << "bytes of shard " << k;
        EXPECT_TRUE(BytesEqual(scale_gpu[k].cpu(), scale_cpu[k])) << "scale_inv of shard " << k;
      }
    }
  }
}

// The one-read CUDA path against the CPU's two passes: every input dtype and format; 16-byte
// loads where cols % 8 == 0 and the data are aligned (384 × 256, 200 × 176, 128 × 128, FP32
// masters included), the element-wise kernel elsewhere (odd widths; values two elements off
// alignment; an output one byte off).
TEST_F(BlockwiseTest, WholeWeightKernelsMatchCpuByteForByte_CUDA) {
  AMP8_REQUIRE_CUDA();
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (format == Fp8Format::kE4M3 ? " e4m3" : " e5m2"));
      auto weights = awkward_weights(dtype);
      std::vector<at::Tensor> gpu_weights;
      for (const auto& w : weights) gpu_weights.push_back(w.cuda());
      // Values and an output off their alignment: views into larger buffers (on the GPU: a copy
      // of a view would be aligned again).
      const auto buffer = at::randn({384 * 256 + 2}).to(dtype);
      weights.push_back(buffer.narrow(0, 2, 384 * 256).view({384, 256}));
      gpu_weights.push_back(buffer.cuda().narrow(0, 2, 384 * 256).view({384, 256}));
      ASSERT_NE(reinterpret_cast<uintptr_t>(gpu_weights.back().const_data_ptr()) % 16, 0u);
      auto cpu = whole_weights(weights, format);
      auto gpu = whole_weights(gpu_weights, format);
      gpu.outs.back() = at::empty({384 * 256 + 1}, gpu.outs.back().options()).narrow(0, 1, 384 * 256);
      const auto options = weight_block_options(format);
      quantize_whole_weights_blockwise(cpu.shards, options, cpu.outs, cpu.scale_invs);
      quantize_whole_weights_blockwise(gpu.shards, options, gpu.outs, gpu.scale_invs);
      for (size_t k = 0; k < weights.size(); ++k) {
        EXPECT_TRUE(BytesEqual(gpu.outs[k].cpu(), cpu.outs[k])) << "bytes of weight " << k;
        EXPECT_TRUE(BytesEqual(gpu.scale_invs[k].cpu(), cpu.scale_invs[k])) << "scale_inv of weight " << k;
      }
    }
  }
}

}  // namespace
}  // namespace amp8
