#pragma once
// Two modules built alike and run two ways (fused against unfused, split against whole, with a
// residual against without): their parameters made equal, then their gradients and buffers
// compared byte for byte.

#include <torch/torch.h>

#include <string>

#include "tests/test_util.h"

namespace amp8::testing {

/// Copies `from`'s parameters into `to`'s of the same names.
inline void copy_parameters(const torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  const auto source = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(source[p.key()]);
}

/// Every parameter's gradient of `actual` is `expected`'s, byte for byte; with `buffers`, every
/// buffer too (FP8 scales and amax histories). `label` says where in the test.
inline void expect_same_gradients(const torch::nn::Module& actual, const torch::nn::Module& expected,
                                  const std::string& label = "", bool buffers = false) {
  const auto expected_parameters = expected.named_parameters();
  for (const auto& p : actual.named_parameters()) {
    EXPECT_TRUE(BytesEqual(p.value().grad(), expected_parameters[p.key()].grad()))
        << p.key() << "'s gradient " << label;
  }
  if (!buffers) return;
  const auto expected_buffers = expected.named_buffers();
  for (const auto& b : actual.named_buffers()) {
    EXPECT_TRUE(BytesEqual(b.value(), expected_buffers[b.key()])) << b.key() << " " << label;
  }
}

/// A sum computed by a fused kernel against the same sum of separately rounded parts: where
/// the kernel added it (`fused`), one bfloat16 rounding of the sum against two (within 2^-7 of
/// the largest value, and not the same bytes: the kernel did add it); elsewhere the same bytes.
/// `adder` names the kernel in the message.
inline void expect_sum_rounded_once(const at::Tensor& fused_sum, const at::Tensor& added_after,
                                    bool fused, const std::string& adder) {
  ASSERT_EQ(fused_sum.sizes(), added_after.sizes());
  ASSERT_EQ(fused_sum.scalar_type(), added_after.scalar_type());
  if (fused) {
    EXPECT_LE((fused_sum - added_after).abs().max().item<double>(),
              added_after.abs().max().item<double>() * 2.0 / 256);
    EXPECT_FALSE(BytesEqual(fused_sum, added_after)) << "the sum was not added by " << adder;
  } else {
    EXPECT_TRUE(BytesEqual(fused_sum, added_after));
  }
}

/// forward_with_residual's output against `residual + forward(...)`'s (expect_sum_rounded_once
/// with the GEMM as the adder).
inline void expect_residual_added(const at::Tensor& with_residual, const at::Tensor& added_after,
                                  bool by_gemm) {
  expect_sum_rounded_once(with_residual, added_after, by_gemm, "the GEMM");
}

/// Both outputs' backward passes with one output gradient (random, times 3).
inline void backward_with_one_gradient(const at::Tensor& a, const at::Tensor& b) {
  const auto g = (at::randn(a.sizes()) * 3).to(a.device()).to(a.scalar_type());
  a.backward(g);
  b.backward(g);
}

}  // namespace amp8::testing
