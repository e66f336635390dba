// ops/rotary.h: rotary embeddings against a complex rotation, bit for bit against LibTorch's
// float32 formulation, its inverse, strided views of a fused QKV output, and the CUDA kernel
// against the CPU reference.

#include "ops/rotary.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <complex>

#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using testing::ExpectErrorContaining;
using testing::relative_error;

class RotaryTest : public testing::SeededTest {};

struct Table {
  at::Tensor cos, sin;
};

// Angles t · θ_i with Llama's θ_i = base^(-2i / head_dim).
Table table(int64_t seq, int64_t head_dim, double base = 500000.0) {
  const auto i = torch::arange(head_dim / 2, at::kDouble);
  const auto theta = torch::pow(base, -2.0 * i / static_cast<double>(head_dim));
  const auto angles = torch::outer(torch::arange(seq, at::kDouble), theta).to(at::kFloat);
  return {angles.cos(), angles.sin()};
}

// (x0 + i·x1) · e^(i·angle), in float64.
at::Tensor complex_reference(const at::Tensor& x, const Table& t) {
  auto xd = x.cpu().to(at::kDouble).contiguous();
  auto out = torch::empty_like(xd);
  auto xa = xd.accessor<double, 4>();
  auto oa = out.accessor<double, 4>();
  auto ca = t.cos.accessor<float, 2>();
  auto sa = t.sin.accessor<float, 2>();
  for (int64_t b = 0; b < xd.size(0); ++b)
    for (int64_t p = 0; p < xd.size(1); ++p)
      for (int64_t h = 0; h < xd.size(2); ++h)
        for (int64_t i = 0; i < xd.size(3) / 2; ++i) {
          const auto z = std::complex<double>(xa[b][p][h][2 * i], xa[b][p][h][2 * i + 1]) *
                         std::complex<double>(ca[p][i], sa[p][i]);
          oa[b][p][h][2 * i] = z.real();
          oa[b][p][h][2 * i + 1] = z.imag();
        }
  return out;
}

// LibTorch's float32 formulation (what recipes/llama computed before this op).
at::Tensor libtorch_formulation(const at::Tensor& x, const Table& t) {
  const auto pairs = x.to(at::kFloat).unflatten(-1, {-1, 2});
  const auto real = pairs.select(-1, 0), imag = pairs.select(-1, 1);
  const auto c = t.cos.unsqueeze(1), s = t.sin.unsqueeze(1);
  return torch::stack({real * c - imag * s, real * s + imag * c}, -1).flatten(-2).to(x.scalar_type());
}

TEST_F(RotaryTest, IsTheComplexRotation) {
  const auto x = at::randn({2, 5, 3, 6});
  const auto t = table(5, 6, 10.0);  // a small base: large angles in 5 positions
  EXPECT_LE(relative_error(rotary_embedding(x, t.cos, t.sin), complex_reference(x, t)), 1e-6);
  // Position 0 is not turned.
  EXPECT_TRUE(BytesEqual(rotary_embedding(x, t.cos, t.sin).select(1, 0), x.select(1, 0)));
}

TEST_F(RotaryTest, BitForBitLibTorchsFloat32Formulation) {
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto x = (at::randn({3, 9, 4, 10}) * 3).to(dtype);
    const auto t = table(9, 10);
    EXPECT_TRUE(BytesEqual(rotary_embedding(x, t.cos, t.sin), libtorch_formulation(x, t)));
  }
}

TEST_F(RotaryTest, InverseUndoesTheRotation) {
  const auto x = at::randn({2, 7, 3, 8});
  const auto t = table(7, 8, 10.0);
  const auto back = rotary_embedding(rotary_embedding(x, t.cos, t.sin), t.cos, t.sin, true);
  EXPECT_LE(relative_error(back, x), 1e-6);
  EXPECT_GT(relative_error(rotary_embedding(x, t.cos, t.sin), x), 0.1);  // it did turn
}

// Q and K as views of one fused QKV output [batch, seq, (heads + 2 kv) · head_dim]: the same
// values as from contiguous copies.
TEST_F(RotaryTest, ViewsOfAFusedQkvOutput) {
  const int64_t b = 2, s = 5, heads = 4, kv = 2, d = 6;
  const auto qkv = at::randn({b, s, (heads + 2 * kv) * d});
  const auto parts = qkv.split({heads * d, kv * d, kv * d}, -1);
  const auto k = parts[1].view({b, s, kv, d});
  ASSERT_FALSE(k.is_contiguous());
  const auto t = table(s, d);
  const auto out = rotary_embedding(k, t.cos, t.sin);
  EXPECT_TRUE(out.is_contiguous());
  EXPECT_TRUE(BytesEqual(out, rotary_embedding(k.contiguous(), t.cos, t.sin)));
}

TEST_F(RotaryTest, BadArgumentsNameTheParameter) {
  const auto t = table(5, 6);
  ExpectErrorContaining([&] { rotary_embedding(at::randn({2, 5, 6}), t.cos, t.sin); },
                        "x must be [batch, seq, heads, head_dim]");
  ExpectErrorContaining([&] { rotary_embedding(at::randn({2, 5, 3, 6}).transpose(2, 3), t.cos, t.sin); },
                        "x must be [batch, seq, heads, head_dim] with an even head_dim");
  ExpectErrorContaining([&] { rotary_embedding(at::randn({2, 5, 6, 6}).transpose(2, 3), t.cos, t.sin); },
                        "x's last dimension must be contiguous");
  ExpectErrorContaining([&] { rotary_embedding(at::randn({2, 4, 3, 6}), t.cos, t.sin); },
                        "cos must have shape [4, 3]");
  ExpectErrorContaining([&] { rotary_embedding(at::randn({2, 5, 3, 6}), t.cos, t.sin.to(at::kDouble)); },
                        "sin must be a float32 tensor");
}

TEST_F(RotaryTest, CudaMatchesCpuBitForBit_CUDA) {
  AMP8_REQUIRE_CUDA();
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    // head_dim 64 in a fused QKV view (16-byte vectors), 6 (one pair per thread), and a
    // stride that is not a multiple of 8 (one pair per thread).
    for (const auto& [d, extra] : {std::pair<int64_t, int64_t>{64, 0}, {6, 0}, {16, 2}}) {
      const int64_t b = 3, s = 11, heads = 5, kv = 1;
      const auto qkv = (at::randn({b, s, (heads + 2 * kv) * d + extra}) * 2).to(dtype);
      const auto q = qkv.narrow(-1, 0, heads * d).view({b, s, heads, d});
      const auto t = table(s, d);
      for (const bool inverse : {false, true}) {
        const auto q_cuda = qkv.cuda().narrow(-1, 0, heads * d).view({b, s, heads, d});
        EXPECT_TRUE(BytesEqual(rotary_embedding(q_cuda, t.cos.cuda(), t.sin.cuda(), inverse),
                               rotary_embedding(q, t.cos, t.sin, inverse)))
            << "head_dim " << d << " extra " << extra << " inverse " << inverse;
      }
    }
  }
}

}  // namespace
}  // namespace amp8
