// ops/swiglu.h: the fused SwiGLU and its gradient against float64 autograd of LibTorch's
// silu(gate) * up, and the CUDA kernels against the CPU reference on awkward shapes.

#include "ops/swiglu.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::ExpectErrorContaining;
using testing::relative_error;

class SwiGluTest : public testing::SeededTest {};

// gate_up of moderate range (half holds the products), every element non-zero.
at::Tensor random_gate_up(at::IntArrayRef shape, at::ScalarType dtype) {
  auto x = at::randn(shape, at::kFloat) * 4;
  return at::where(x == 0, at::full_like(x, 0.25f), x).to(dtype);
}

struct Fp64Swiglu {
  at::Tensor out, grad_gate_up;
};

// LibTorch's unfused formulation, differentiated by autograd, in float64.
Fp64Swiglu fp64_reference(const at::Tensor& gate_up, const at::Tensor& grad) {
  auto x = gate_up.detach().cpu().to(at::kDouble).requires_grad_(true);
  const auto halves = x.chunk(2, -1);
  auto out = torch::silu(halves[0]) * halves[1];
  out.backward(grad.cpu().to(at::kDouble));
  return {out.detach(), x.grad()};
}

// Rounding the float32 result once to the dtype: half a spacing, 2^-(mantissa bits + 1).
double rounding_bound(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return 1.0 / 256;
    case at::kHalf:
      return 1.0 / 2048;
    default:
      return 2e-6;  // a few float32 roundings and expf's last place
  }
}

TEST_F(SwiGluTest, MatchesFp64AutogradOfSiluTimesUp) {
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto gate_up = random_gate_up({3, 7, 2 * 45}, dtype);
    const auto grad = random_gate_up({3, 7, 45}, dtype);
    const auto reference = fp64_reference(gate_up, grad);
    const auto out = swiglu(gate_up);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3, 7, 45}));
    EXPECT_EQ(out.scalar_type(), dtype);
    EXPECT_LE(relative_error(out, reference.out), rounding_bound(dtype));
    const auto grad_gate_up = swiglu_backward(grad, gate_up);
    EXPECT_EQ(grad_gate_up.sizes(), gate_up.sizes());
    // Both halves: the gate's (the derivative of silu) and the up's (silu itself).
    for (int half = 0; half < 2; ++half) {
      SCOPED_TRACE(half == 0 ? "d gate" : "d up");
      EXPECT_LE(relative_error(grad_gate_up.chunk(2, -1)[half], reference.grad_gate_up.chunk(2, -1)[half]),
                2 * rounding_bound(dtype));
    }
  }
}

// Large |gate|: e^-g overflows to inf for very negative g (silu = -0, its derivative 0), as
// LibTorch's silu does; nothing becomes NaN.
TEST_F(SwiGluTest, SaturatedGatesStayFinite) {
  const auto gate_up = torch::tensor({-200.0f, -90.0f, 90.0f, 200.0f, 3.0f, 3.0f, 3.0f, 3.0f}).view({1, 8});
  const auto out = swiglu(gate_up);
  const auto grad = swiglu_backward(torch::ones({1, 4}), gate_up);
  EXPECT_TRUE(out.isfinite().all().item<bool>()) << out;
  EXPECT_TRUE(grad.isfinite().all().item<bool>()) << grad;
  const auto reference = fp64_reference(gate_up, torch::ones({1, 4}));
  EXPECT_TRUE(torch::allclose(out.to(at::kDouble), reference.out, 1e-6, 1e-30)) << out;
  EXPECT_TRUE(torch::allclose(grad.to(at::kDouble), reference.grad_gate_up, 1e-6, 1e-30)) << grad;
}

TEST_F(SwiGluTest, BadArgumentsNameTheParameter) {
  ExpectErrorContaining([] { swiglu(torch::ones({2, 5})); }, "gate_up's last dimension must be even");
  ExpectErrorContaining([] { swiglu(torch::ones({2, 4}, at::kInt)); }, "gate_up must be float32");
  ExpectErrorContaining([] { swiglu(torch::ones({4, 2}).t()); }, "gate_up must be contiguous");
  ExpectErrorContaining([] { swiglu_backward(torch::ones({2, 3}), torch::ones({2, 4})); },
                        "grad must have shape [2, 2]");
  ExpectErrorContaining(
      [] { swiglu_backward(torch::ones({2, 2}, at::kBFloat16), torch::ones({2, 4})); },
      "grad must have gate_up's dtype");
}

// CUDA against the CPU reference: the same formulas, so equal but for expf's last place (the
// device's expf and glibc's differ there for about one input in ten). In float32 that shows
// directly (a few float32 spacings); rounded to bfloat16 / float16 it moves a result by one
// spacing, rarely.
::testing::AssertionResult MatchesCpu(const at::Tensor& cuda, const at::Tensor& cpu) {
  const auto a = cuda.cpu().to(at::kDouble), e = cpu.to(at::kDouble);
  const bool fp32 = cpu.scalar_type() == at::kFloat;
  const double spacing = fp32 ? 2e-6 : (cpu.scalar_type() == at::kHalf ? 1.0 / 512 : 1.0 / 64);
  const auto beyond = ((a - e).abs() > e.abs() * spacing).sum().item<int64_t>();
  const auto differing = (a != e).sum().item<int64_t>();
  if (beyond == 0 && (fp32 || differing * 100 <= e.numel())) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << differing << " of " << e.numel() << " elements differ, "
                                       << beyond << " by more than one spacing";
}

TEST_F(SwiGluTest, CudaMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  // ffn 48: 16-byte vectors; 13: one element per thread; an offset view: unaligned pointers.
  for (const int64_t ffn : {48, 13, 1}) {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(std::to_string(ffn) + " " + c10::toString(dtype));
      const auto gate_up = random_gate_up({37, 2 * ffn}, dtype);
      const auto grad = random_gate_up({37, ffn}, dtype);
      EXPECT_TRUE(MatchesCpu(swiglu(gate_up.cuda()), swiglu(gate_up)));
      EXPECT_TRUE(MatchesCpu(swiglu_backward(grad.cuda(), gate_up.cuda()), swiglu_backward(grad, gate_up)));
    }
  }
  const auto storage = random_gate_up({1 + 5 * 96}, at::kBFloat16);
  const auto unaligned = storage.narrow(0, 1, 5 * 96).view({5, 96});
  EXPECT_TRUE(MatchesCpu(swiglu(unaligned.cuda()), swiglu(unaligned)));
  auto unaligned_cuda = storage.cuda().narrow(0, 1, 5 * 96).view({5, 96});
  EXPECT_TRUE(MatchesCpu(swiglu(unaligned_cuda), swiglu(unaligned)));
}

}  // namespace
}  // namespace amp8
