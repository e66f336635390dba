#include "plugin/fp8/fp8_autocast.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "plugin/modules/fp8_linear.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

class DoneWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
};

// Stands in for the other ranks of a data-parallel group: its all-reduce MAX merges what the
// peers contribute (`peer_amax` in every slot) and counts calls and elements. The real
// collective (ProcessGroupNCCL under torchrun) is the distributed issue's to run.
class PeerMaxBackend : public c10d::Backend {
 public:
  explicit PeerMaxBackend(float peer_amax) : c10d::Backend(0, 2), peer_amax_(peer_amax) {}
  const std::string getBackendName() const override { return "amp8_test_peer_max"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& options) override {
    TORCH_CHECK(options.reduceOp == c10d::ReduceOp::MAX, "expected an all-reduce MAX");
    TORCH_CHECK(tensors.size() == 1, "expected one packed buffer");
    ++calls;
    elements = tensors[0].numel();
    tensors[0].clamp_min_(peer_amax_);
    return c10::make_intrusive<DoneWork>();
  }
  int calls = 0;
  int64_t elements = 0;

 private:
  float peer_amax_;
};

c10::intrusive_ptr<c10d::ProcessGroup> make_group(const c10::intrusive_ptr<PeerMaxBackend>& b) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(0, 2);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, b);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return group;
}

TEST(Fp8AutocastTest, AmaxesAreReducedOverTheGroupInOneCallPerUpdate) {
  torch::manual_seed(2);
  auto options = [](int64_t in, int64_t out) {
    return Fp8LinearOptions(in, out).fp8_amax_history_len(4).fp8_min_gemm_size(0);
  };
  auto model = torch::nn::Sequential(Fp8Linear(options(32, 64)), Fp8Linear(options(64, 16)));
  auto backend = c10::make_intrusive<PeerMaxBackend>(1000.0f);
  auto group = make_group(backend);
  const auto recipe = Fp8RecipeOptions().fp8_amax_history_len(4);
  torch::Tensor y;
  {
    Fp8Autocast region(recipe, true, group);
    EXPECT_EQ(Fp8Autocast::current_group().get(), group.get());
    y = model->forward(torch::randn({16, 32}));
  }
  EXPECT_EQ(backend->calls, 1) << "one all-reduce for all forward amaxes";
  EXPECT_EQ(backend->elements, 4) << "2 layers x (input, weight)";
  for (const auto& child : model->children()) {
    auto* layer = child->as<Fp8LinearImpl>();
    EXPECT_EQ(layer->fp8_fwd_scale[0].item<float>(), 448.0f / 1000.0f);
    EXPECT_EQ(layer->fp8_fwd_scale[1].item<float>(), 448.0f / 1000.0f);
  }
  y.sum().backward();
  EXPECT_EQ(backend->calls, 2) << "one all-reduce for all gradient amaxes";
  EXPECT_EQ(backend->elements, 2);
  for (const auto& child : model->children()) {
    EXPECT_EQ(child->as<Fp8LinearImpl>()->fp8_bwd_scale[0].item<float>(), 57344.0f / 1000.0f);
  }

  // Without a group each rank keeps its own amaxes.
  Fp8Linear alone(options(32, 64));
  {
    Fp8Autocast region(recipe);
    EXPECT_FALSE(Fp8Autocast::current_group());
    alone->forward(torch::randn({16, 32}));
  }
  EXPECT_GT(alone->fp8_fwd_scale[0].item<float>(), 10.0f);
}

// A group whose peers are gone: every all-reduce fails, as NCCL's would after its timeout.
class FailingBackend : public c10d::Backend {
 public:
  FailingBackend() : c10d::Backend(0, 2) {}
  const std::string getBackendName() const override { return "amp8_test_failing"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& options) override {
    ++calls;
    TORCH_CHECK(false, "all-reduce failed: rank 1 is gone");
  }
  int calls = 0;
};

template <typename Backend>
c10::intrusive_ptr<c10d::ProcessGroup> group_of(const c10::intrusive_ptr<Backend>& backend) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(0, 2);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return group;
}

Fp8Linear small_fp8_linear() {
  return Fp8Linear(Fp8LinearOptions(32, 32).fp8_amax_history_len(4).fp8_min_gemm_size(0));
}

TEST(Fp8AutocastTest, CloseRunsTheUpdateAndReportsAFailedReduction) {
  auto layer = small_fp8_linear();
  auto backend = c10::make_intrusive<FailingBackend>();
  const auto recipe = Fp8RecipeOptions().fp8_amax_history_len(4);
  Fp8Autocast region(recipe, true, group_of(backend));
  layer->forward(torch::randn({16, 32}));
  testing::ExpectErrorContaining([&] { region.close(); }, "rank 1 is gone");
  EXPECT_FALSE(Fp8Autocast::is_enabled()) << "closed even though the update failed";
  region.close();
  EXPECT_EQ(backend->calls, 1) << "closing twice runs one update";

  // A working close updates the scales before returning.
  auto peers = c10::make_intrusive<PeerMaxBackend>(1000.0f);
  Fp8Autocast ok(recipe, true, group_of(peers));
  layer->forward(torch::randn({16, 32}));
  ok.close();
  EXPECT_EQ(peers->calls, 1);
  EXPECT_EQ(layer->fp8_fwd_scale[0].item<float>(), 448.0f / 1000.0f);
}

// A rank unwinding from an exception must not enter a collective its peers may never join
// (the destructor used to all-reduce and update on the way out).
TEST(Fp8AutocastTest, NoCollectiveWhileAnExceptionUnwinds) {
  auto layer = small_fp8_linear();
  auto peers = c10::make_intrusive<PeerMaxBackend>(1000.0f);
  const auto scale_before = layer->fp8_fwd_scale.clone();
  try {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(4), true, group_of(peers));
    layer->forward(torch::randn({16, 32}));
    throw std::runtime_error("the training step failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(peers->calls, 0);
  EXPECT_TRUE(layer->fp8_fwd_scale.equal(scale_before)) << "no scale update while unwinding";
  EXPECT_FALSE(Fp8Autocast::is_enabled());
}

// A failure at a normal scope exit cannot leave a destructor (std::terminate): it is warned
// about and rethrown by the next region opened on the thread.
TEST(Fp8AutocastTest, AFailureAtScopeExitIsRethrownByTheNextRegion) {
  auto layer = small_fp8_linear();
  auto backend = c10::make_intrusive<FailingBackend>();
  {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(4), true, group_of(backend));
    layer->forward(torch::randn({16, 32}));
  }
  EXPECT_EQ(backend->calls, 1);
  EXPECT_FALSE(Fp8Autocast::is_enabled());
  testing::ExpectErrorContaining([] { Fp8Autocast next; }, "rank 1 is gone");
  Fp8Autocast after;  // reported once
  EXPECT_TRUE(Fp8Autocast::is_enabled());
}

// The recipe's strings are read once, by resolve(); every knob reaches its enum or field.
TEST(Fp8AutocastTest, RecipeOptionsResolveToEnumsOnce) {
  const auto defaults = Fp8RecipeOptions().resolve();
  EXPECT_EQ(defaults.forward_format, Fp8Format::kE4M3);
  EXPECT_EQ(defaults.backward_format, Fp8Format::kE5M2);
  EXPECT_EQ(defaults.margin, 0);
  EXPECT_EQ(defaults.amax_history_len, 1024);
  EXPECT_EQ(defaults.amax_compute_algo, AmaxComputeAlgo::kMax);
  EXPECT_TRUE(defaults.delayed());

  const auto custom = Fp8RecipeOptions()
                          .fp8("e4m3")
                          .fp8_margin(3)
                          .fp8_amax_history_len(16)
                          .fp8_amax_compute_algo("most_recent")
                          .resolve();
  EXPECT_EQ(custom.forward_format, Fp8Format::kE4M3);
  EXPECT_EQ(custom.backward_format, Fp8Format::kE4M3);
  EXPECT_EQ(custom.margin, 3);
  EXPECT_EQ(custom.amax_history_len, 16);
  EXPECT_EQ(custom.amax_compute_algo, AmaxComputeAlgo::kMostRecent);
  EXPECT_TRUE(custom.delayed());
  const auto tensorwise = Fp8RecipeOptions().fp8_margin(3).fp8_recipe("tensorwise").resolve();
  EXPECT_EQ(tensorwise.margin, 3);
  EXPECT_EQ(tensorwise.scaling, Fp8Scaling::kTensorwise);
  EXPECT_FALSE(tensorwise.delayed());
  EXPECT_EQ(Fp8RecipeOptions().fp8_recipe("blockwise").resolve().scaling, Fp8Scaling::kBlockwise);

  // A region opened from options runs the recipe they resolve to.
  {
    Fp8Autocast region(Fp8RecipeOptions().fp8("e4m3").fp8_recipe("tensorwise"));
    EXPECT_EQ(Fp8Autocast::current_recipe(),
              Fp8RecipeOptions().fp8("e4m3").fp8_recipe("tensorwise").resolve());
  }
  EXPECT_THROW(Fp8RecipeOptions().fp8_recipe("scaled").resolve(), c10::Error);
  EXPECT_THROW(Fp8RecipeOptions().fp8_amax_compute_algo("mean").resolve(), c10::Error);
}

}  // namespace
}  // namespace amp8
