// The PyTorch internals amp8 relies on (plugin/compat/torch_internals.h), each pinned to the
// behaviour amp8 needs: a LibTorch upgrade that changes one fails here first, by name.
#include "plugin/compat/torch_internals.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#ifdef AMP8_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "tests/test_util.h"

namespace amp8::detail {
namespace {

using testing::ExpectErrorContaining;

// Fp8Autocast keys the gradient-scale update on it: the same id for every backward function of
// one pass, a new one for the next pass, -1 outside.
TEST(TorchInternalsTest, BackwardPassIdIsSharedWithinAPassAndNewForTheNext) {
  EXPECT_EQ(current_backward_pass(), -1);
  auto a = torch::randn({3}, torch::requires_grad()), b = torch::randn({3}, torch::requires_grad());
  std::vector<int> seen;
  auto record = [&](const torch::Tensor& grad) {
    seen.push_back(current_backward_pass());
    return grad;
  };
  auto x = a * 2, y = b * 3;
  x.register_hook(record);
  y.register_hook(record);
  (x * y).sum().backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_NE(seen[0], -1);
  EXPECT_EQ(seen[0], seen[1]) << "one id per backward pass";
  auto z = a * 4;
  z.register_hook(record);
  z.sum().backward();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_NE(seen[2], seen[0]) << "the next backward pass has its own id";
  EXPECT_EQ(current_backward_pass(), -1);
}

// Fp8Linear frees the saved FP8 input transpose early only when the graph is not retained.
TEST(TorchInternalsTest, KeepsGraphFollowsRetainGraph) {
  EXPECT_FALSE(current_backward_keeps_graph());
  auto a = torch::randn({3}, torch::requires_grad());
  std::vector<bool> seen;
  auto x = a * 2;
  x.register_hook([&](const torch::Tensor& grad) {
    seen.push_back(current_backward_keeps_graph());
    return grad;
  });
  auto loss = x.sum();
  loss.backward({}, /*retain_graph=*/true);
  loss.backward({}, /*retain_graph=*/false);
  EXPECT_EQ(seen, (std::vector<bool>{true, false}));
}

// The gradient-scale update runs once every gradient of the pass exists, before backward()
// returns.
TEST(TorchInternalsTest, EndOfBackwardCallbackRunsAfterEveryGradientBeforeBackwardReturns) {
  auto a = torch::randn({3}, torch::requires_grad()), b = torch::randn({3}, torch::requires_grad());
  bool ran = false, grads_complete = false;
  auto x = a * 2;
  x.register_hook([&](const torch::Tensor& grad) {
    at_end_of_backward_pass([&] {
      ran = true;
      grads_complete = a.grad().defined() && b.grad().defined();
    });
    return grad;
  });
  (x * b).sum().backward();
  EXPECT_TRUE(ran) << "ran before backward() returned";
  EXPECT_TRUE(grads_complete);
  ExpectErrorContaining([] { at_end_of_backward_pass([] {}); }, "no backward pass is running");
}

// The distributed optimizer copies a gradient into its bucket from this hook: it must see the
// accumulated .grad, once per backward pass, and stop when removed.
TEST(TorchInternalsTest, PostAccumulateGradHookSeesTheAccumulatedGradient) {
  auto w = torch::randn({4}, torch::requires_grad());
  std::vector<torch::Tensor> seen;
  set_post_accumulate_grad_hook(w, [&](const torch::Tensor& param) { seen.push_back(param.grad().clone()); });
  (w * 2).sum().backward();
  (w * 3).sum().backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen[0].equal(torch::full({4}, 2.0f)));
  EXPECT_TRUE(seen[1].equal(torch::full({4}, 5.0f))) << "after accumulation, not before";
  set_post_accumulate_grad_hook(w, nullptr);
  (w * 1).sum().backward();
  EXPECT_EQ(seen.size(), 2u) << "removed";
}

TEST(TorchInternalsTest, CurrentStreamIsTheDevicesCurrentStream) {
  EXPECT_EQ(current_stream(torch::kCPU).device(), c10::Device(torch::kCPU));
}

TEST(TorchInternalsTest, CurrentStreamIsTheDevicesCurrentStream_CUDA) {
  AMP8_REQUIRE_CUDA();
#ifdef AMP8_WITH_CUDA
  const c10::Device device(torch::kCUDA, 0);
  const auto side = c10::cuda::getStreamFromPool(false, 0);
  c10::cuda::CUDAStreamGuard guard(side);
  EXPECT_EQ(current_stream(device), c10::Stream(side)) << "the stream made current, not the default";
#else
  GTEST_SKIP() << "amp8 built without CUDA";
#endif
}

}  // namespace
}  // namespace amp8::detail
