// overlap_param_gather with the recipes' models: GptModel and LlamaModel wait for each block's
// parameters (amp8::wait_for_params), so data-parallel training whose all-gathers stay in flight
// after the step trains exactly as the all-gather at the step. Two ranks in one process
// (tests/in_process_group.h) whose all-gathers run only when waited for: a parameter read before
// its wait would be the previous step's.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "plugin/modules/fp8_linear.h"
#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/trainer.h"
#include "recipes/gpt/gpt_model.h"
#include "recipes/llama/llama_model.h"
#include "recipes/precision.h"
#include "tests/in_process_group.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

namespace amp8::recipes {
namespace {

constexpr int kRanks = 2;
constexpr int64_t kSteps = 4, kRowsPerRank = 2, kSeq = 32;

// Every rank's parameters (float32) after kSteps steps of next-token prediction on random
// tokens, rank r taking rows [r, r + 1) / kRanks of each step's batch. models[r] is rank r's
// (built before the threads: torch's global generator is not for threads).
template <typename Model>
std::vector<std::vector<torch::Tensor>> train_two_ranks(std::vector<Model> models, const MixedPrecisionOptions& options,
                                                        bool overlap_param_gather, int64_t vocab) {
  std::vector<std::vector<torch::Tensor>> params(kRanks);
  const auto errors = testing::run_ranks(kRanks, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    testing::defer_allgathers(*group);
    auto& model = models[rank];
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    // Small buckets: a block's parameters sit in buckets of their own.
    plugin->set_process_group(
        group, DistributedOptimizerOptions().bucket_size(20'000).overlap_param_gather(overlap_param_gather));
    Trainer trainer(TrainerOptions().max_steps(kSteps).log_every_n_steps(0), plugin);
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      auto gen = testing::batch_generator(11, in.step, 0);
      const auto tokens = torch::randint(vocab, {kRowsPerRank * kRanks, kSeq + 1}, gen)
                              .narrow(0, rank * kRowsPerRank, kRowsPerRank);
      const auto logits = model->forward(tokens.narrow(1, 0, kSeq));
      return torch::cross_entropy_loss(logits.reshape({-1, vocab}).to(at::kFloat),
                                       tokens.narrow(1, 1, kSeq).reshape(-1));
    });
    for (const auto& p : model->parameters()) params[rank].push_back(p.detach().to(at::kFloat).clone());
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return params;
}

void expect_equal(const std::vector<std::vector<torch::Tensor>>& a, const std::vector<std::vector<torch::Tensor>>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].size(), b[r].size()) << what;
    ASSERT_FALSE(a[r].empty()) << what << ": rank " << r << " returned no parameters";
    for (size_t i = 0; i < a[r].size(); ++i) {
      EXPECT_TRUE(torch::equal(a[r][i], b[r][i])) << what << ": rank " << r << ", parameter " << i;
    }
  }
}

template <typename Model, typename MakeModel>
void expect_overlap_changes_nothing(const MakeModel& make_model, int64_t vocab) {
  const auto fp8 = bf16_with_fp8_mixed().fp8_min_gemm_size(0);
  for (const auto& options : {MixedPrecisionOptions("bf16-mixed"), fp8}) {
    SCOPED_TRACE(options.precision() + (options.fp8_enabled() ? " + fp8 fp8_params" : ""));
    const auto models = [&] {
      std::vector<Model> built;
      for (int r = 0; r < kRanks; ++r) {
        torch::manual_seed(3 + r);  // different on each rank: rank 0's reach every rank
        std::optional<Fp8ModelInit> init;
        if (options.fp8_params()) init.emplace();
        built.push_back(make_model());
      }
      return built;
    };
    const auto at_step = train_two_ranks(models(), options, /*overlap_param_gather=*/false, vocab);
    const auto overlapped = train_two_ranks(models(), options, /*overlap_param_gather=*/true, vocab);
    expect_equal(overlapped, at_step, "overlapped vs at the step");
    expect_equal({overlapped[1]}, {overlapped[0]}, "rank 1 vs rank 0");
  }
}

TEST(OverlapParamGatherTest, GptModelWaitsForEachBlock) {
  const auto config = GptConfig().layers(3);
  expect_overlap_changes_nothing<GptModel>([&] { return GptModel(config); }, config.vocab_size());
}

TEST(OverlapParamGatherTest, LlamaModelWaitsForEachBlock) {
  const auto config = LlamaConfig().layers(3);
  expect_overlap_changes_nothing<LlamaModel>([&] { return LlamaModel(config); }, config.vocab_size());
}

}  // namespace
}  // namespace amp8::recipes
