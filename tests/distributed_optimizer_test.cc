// DistributedOptimizer (ZeRO-1 over c10d) through MixedPrecisionPlugin and Trainer, with 1-4
// ranks in one process (tests/in_process_group.h): equivalence with single-rank training on the
// same global batch, 1/N of the optimizer state per rank, what the collectives carry, sharded
// checkpoints, and a rank that dies.

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <filesystem>
#include <fstream>
#include <memory>
#include <iostream>
#include <limits>
#include <sstream>
#include <tuple>

#include "plugin/distributed/process_group.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/trainer.h"
#include "recipes/precision.h"
#include "tests/in_process_group.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using testing::InProcessWorld;

constexpr int64_t kGlobalRows = 48;  // divisible by 1, 2, 3 and 4 ranks
constexpr uint64_t kSeed = 5;

// A learnable regression: y = 3·teacher(x), no noise, so every precision's loss falls well
// below its start within a few steps and differences between runs are not drowned in noise.
// Built once, before any rank thread runs (torch's global generator is not for threads).
struct Data {
  Data() {
    torch::manual_seed(kSeed + 7);
    teacher = testing::make_mlp();
  }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step) const {
    auto gen = testing::batch_generator(kSeed, step, 0);
    auto x = torch::randn({kGlobalRows, 32}, gen);
    torch::NoGradGuard no_grad;
    return {x, 3.0 * teacher->forward(x)};
  }
  mutable torch::nn::Sequential teacher{nullptr};
};

const Data& data() {
  static const Data instance;
  return instance;
}

struct Run {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;  // the model's, as float32, after training
  int64_t state_bytes = 0;            // FP32 masters + optimizer state on this rank
  int64_t skipped = 0;
  // Data-parallel: the per-step communication figures, and the padded buffer's elements.
  std::vector<DistributedOptimizer::StepCommunication> communication;
  int64_t padded_numel = 0;
};

int64_t state_bytes(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& masters) {
  int64_t bytes = 0;
  for (const auto& m : masters) bytes += m.numel() * 4;
  for (const auto& [key, state] : optimizer.state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state);
    bytes += adam.exp_avg().numel() * 4 + adam.exp_avg_sq().numel() * 4;
  }
  return bytes;
}

torch::nn::Sequential initial_model(const MixedPrecisionOptions& options, uint64_t seed = kSeed) {
  torch::manual_seed(seed);
  std::optional<Fp8ModelInit> init;
  if (options.fp8_params()) init.emplace();
  return testing::make_mlp();
}

// How a data-parallel run gets its parameters after each step (overlap_param_gather).
enum class ParamGather {
  kAfterStep,                 // waited for at the step
  kOverlapped,                // in flight until the forward pass waits for each layer's
  kOverlappedWithoutWaiting,  // in flight, and a forward pass that never waits
};

// Trains `steps` steps of the global batch, this rank taking rows [rank, rank + 1) / world of it.
Run train(const MixedPrecisionOptions& options, int steps, c10::intrusive_ptr<c10d::ProcessGroup> group,
          torch::nn::Sequential model, int64_t accumulate = 1, int64_t clip = 0,
          torch::Device device = torch::kCPU, ParamGather gather = ParamGather::kAfterStep) {
  model->to(device);
  const int rank = group ? group->getRank() : 0, world = group ? group->getSize() : 1;
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
  if (group) {
    // On a GPU the ranks' backward passes share autograd's one CUDA device thread: a reduction
    // launched from a gradient hook would wait there for a rank whose backward pass cannot run
    // (see FusedStepOnShardsMatchesTheOptimizersOwnStep_CUDA), so they reduce at the step.
    plugin->set_process_group(group, DistributedOptimizerOptions()
                                         .bucket_size(3000)
                                         .overlap_grad_reduce(device.is_cpu())
                                         .overlap_param_gather(gather != ParamGather::kAfterStep));
  }
  const auto forward = [&](torch::Tensor h) {
    if (gather != ParamGather::kOverlapped) return model->forward(h);
    for (auto& layer : *model) {  // as GptModel's blocks: each waits for its parameters
      wait_for_params(*layer.ptr());
      h = layer.forward(h);
    }
    return h;
  };
  Trainer trainer(TrainerOptions().max_steps(steps).log_every_n_steps(0).accumulate_grad_batches(accumulate)
                      .gradient_clip_val(static_cast<double>(clip)),
                  plugin);
  const int64_t rows = kGlobalRows / world / accumulate;
  trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
    auto [x, y] = data().batch(in.step);
    const int64_t begin = (rank * accumulate + in.micro_batch) * rows;
    x = x.narrow(0, begin, rows).to(device), y = y.narrow(0, begin, rows).to(device);
    return torch::mse_loss(in.precision.convert_output(forward(in.precision.convert_input(x))), y);
  });
  Run run;
  for (const auto& m : trainer.history()) run.losses.push_back(m.loss);
  for (const auto& p : model->parameters()) run.params.push_back(p.detach().to(torch::kCPU, at::kFloat).clone());
  run.state_bytes = state_bytes(optimizer, plugin->master_params());
  run.skipped = plugin->skipped_steps();
  if (auto* distributed = plugin->distributed_optimizer()) {
    run.communication = distributed->take_communication_times();
    run.padded_numel = distributed->padded_numel();
  }
  return run;
}

// One forward (in the plugin's context) and backward of rank `rank`'s share of step `step`'s
// batch split over `world` ranks; returns the loss.
template <typename Model>
torch::Tensor forward_backward(MixedPrecisionPlugin& plugin, Model& model, int step, int rank, int world) {
  auto [x, y] = data().batch(step);
  const int64_t rows = kGlobalRows / world;
  x = x.narrow(0, rank * rows, rows), y = y.narrow(0, rank * rows, rows);
  torch::Tensor loss;
  {
    auto context = plugin.forward_context();
    loss = torch::mse_loss(plugin.convert_output(model.forward(plugin.convert_input(x))), y);
  }
  plugin.backward(loss);
  return loss;
}

// different_inits: rank r initializes its model from seed kSeed + r (rank 0's is the reference's).
std::vector<Run> train_ranks(const MixedPrecisionOptions& options, int world, int steps, int64_t accumulate = 1,
                             int64_t clip = 0, std::shared_ptr<InProcessWorld>* world_out = nullptr,
                             bool different_inits = false) {
  data();
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < world; ++r) models.push_back(initial_model(options, different_inits ? kSeed + r : kSeed));
  std::vector<Run> runs(world);
  const auto errors = testing::run_ranks(
      world,
      [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
        runs[rank] = train(options, steps, group, models[rank], accumulate, clip);
      },
      std::chrono::seconds(60), world_out);
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return runs;
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
  return diff;
}

double max_rel_loss_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) diff = std::max(diff, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return diff;
}

// Every rank ends with the same model, bit for bit (the all-gather gives all of them every shard).
void expect_ranks_agree(const std::vector<Run>& runs) {
  for (size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(max_abs_diff(runs[r].params, runs[0].params), 0.0) << "rank " << r;
    EXPECT_EQ(runs[r].losses, runs[0].losses) << "rank " << r;
  }
}

TEST(DistributedOptimizerTest, Fp32MatchesSingleRankTrainingForAnyWorldSize) {
  const auto options = MixedPrecisionOptions("32");
  const auto reference = train(options, 8, {}, initial_model(options));
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const auto runs = train_ranks(options, world, 8);
    expect_ranks_agree(runs);
    // Only the order of float32 sums differs (per-rank partial gradients averaged): AdamW
    // moves each weight by ~lr per step, so 8 steps of rounding stay far below 1e-5.
    EXPECT_LT(max_abs_diff(runs[0].params, reference.params), 1e-5);
    EXPECT_LT(max_rel_loss_diff(runs[0].losses, reference.losses), 1e-5);
    EXPECT_TRUE(runs[0].communication.empty()) << "communication is timed on CUDA only";
  }
}

TEST(DistributedOptimizerTest, HalfAndFp8PrecisionsMatchSingleRankWithinTheirRounding) {
  struct Case {
    const char* name;
    MixedPrecisionOptions options;
    double loss_bound;
  };
  // Each rank's half-precision gradient is rounded once more than the single-rank one (a sum
  // over fewer rows, then averaged across ranks): ~2^-8 relative per element in bf16, 2^-11 in
  // fp16, which moves an 8-step loss trajectory by ~1e-4..1e-3 relative (measured: bf16 ≤ 4e-4,
  // fp16 ≤ 3e-4). FP8 (every GEMM in FP8: fp8_min_gemm_size 0) quantizes each rank's
  // activations and gradients with the same scales (amaxes all-reduced) but E4M3 keeps 3
  // mantissa bits (2^-4 relative rounding), so different row partitions round differently
  // (measured ≤ 4.4e-3). Bounds, on the loss of every step: ≥ 2× the measured.
  const std::vector<Case> cases = {
      {"bf16-mixed", recipes::bf16_mixed(), 2e-3},
      {"bf16-mixed grads reduced in bf16", recipes::bf16_mixed().grad_reduce_in_fp32(false), 2e-3},
      {"16-mixed", recipes::fp16_mixed().fp16_initial_loss_scale(1 << 20), 1.5e-3},
      {"bf16 + fp8 hybrid", recipes::bf16_mixed().fp8("hybrid").fp8_min_gemm_size(0), 1e-2},
      {"bf16 + fp8 hybrid, fp8_params", recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0), 1e-2},
      // Weights in 128×128 blocks: a shard boundary cuts blocks, whose amaxes are all-reduced.
      {"bf16 + fp8 blockwise, fp8_params",
       recipes::bf16_with_fp8_mixed().fp8_recipe("blockwise").fp8_min_gemm_size(0), 1e-2},
      {"fp16 + fp8 e4m3", recipes::fp16_mixed().fp16_initial_loss_scale(1 << 20).fp8("e4m3").fp8_min_gemm_size(0), 1e-2},
      // Adam's moments in bfloat16: each rank keeps its shard's moments so (the rounding of a
      // moment does not depend on the partition; the gradients differ as in bf16-mixed).
      {"bf16-mixed, bf16 moments", recipes::bf16_mixed().exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16),
       2e-3},
      // The fused step measures each rank's FP8 pieces' amaxes (all-reduced into each weight's).
      {"bf16 + fp8 hybrid, fp8_params, bf16 moments",
       recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16),
       1e-2},
      // FP8 weights written at the last step's scale: every rank writes its pieces at the scale
      // of the all-reduced amax, so the gathered weight has one scale (the unfused step on the
      // CPU with float32 moments, the fused one with bfloat16 moments).
      {"bf16 + fp8 hybrid, fp8_params, delayed weight scaling",
       recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_params_scaling("delayed"), 1e-2},
      {"bf16 + fp8 hybrid, fp8_params, delayed weight scaling, bf16 moments",
       recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_params_scaling("delayed").exp_avg_dtype(at::kBFloat16)
           .exp_avg_sq_dtype(at::kBFloat16),
       1e-2},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto reference = train(c.options, 8, {}, initial_model(c.options));
    for (int world : {2, 3}) {
      SCOPED_TRACE("world " + std::to_string(world));
      const auto runs = train_ranks(c.options, world, 8);
      expect_ranks_agree(runs);
      EXPECT_EQ(runs[0].skipped, reference.skipped);
      const double diff = max_rel_loss_diff(runs[0].losses, reference.losses);
      EXPECT_LT(diff, c.loss_bound);
      EXPECT_LT(runs[0].losses.back(), 0.8 * runs[0].losses.front()) << "it learns";
      std::cout << c.name << ", " << world << " ranks: loss " << runs[0].losses.front() << " -> "
                << runs[0].losses.back() << ", largest relative loss difference to one rank " << diff << "\n";
    }
  }
}

// The all-gather writes the parameters through their views of the buffer; a layer that caches
// its FP8 weight while the weight's version is unchanged (cache_fp8_weight) must still see each
// step's new weights: with the cache, training is the same as without it, bit for bit.
TEST(DistributedOptimizerTest, AnFp8WeightCacheSeesEveryGatheredStep) {
  const auto options = recipes::bf16_mixed().fp8("hybrid").fp8_min_gemm_size(0);
  const auto model = [](bool cache) {
    torch::manual_seed(kSeed);
    const auto layer = [cache](int64_t in, int64_t out) {
      return Fp8Linear(Fp8LinearOptions(in, out).cache_fp8_weight(cache));
    };
    return torch::nn::Sequential(layer(32, 64), torch::nn::ReLU(), layer(64, 64), torch::nn::ReLU(), layer(64, 16));
  };
  for (const std::string recipe : {"delayed", "blockwise"}) {
    SCOPED_TRACE(recipe);
    const auto with_recipe = MixedPrecisionOptions(options).fp8_recipe(recipe);
    std::vector<torch::nn::Sequential> cached = {model(true), model(true)}, plain = {model(false), model(false)};
    std::vector<amp8::Run> cached_runs(2), plain_runs(2);
    const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
      cached_runs[rank] = train(with_recipe, 6, group, cached[rank]);
      plain_runs[rank] = train(with_recipe, 6, group, plain[rank]);
    });
    for (const auto& error : errors) EXPECT_EQ(error, "");
    EXPECT_EQ(cached_runs[0].losses, plain_runs[0].losses);
    EXPECT_EQ(max_abs_diff(cached_runs[0].params, plain_runs[0].params), 0.0);
  }
}

// A model smaller than one bucket's share per rank: rank 1's shard is only padding, so it holds no
// master and its optimizer no parameter. With bfloat16 moments (always the fused step) it steps
// nothing, as rank 0 steps everything, and both end with the same model.
TEST(DistributedOptimizerTest, ARankWhoseShardIsOnlyPaddingStepsWithBfloat16Moments) {
  const auto options = recipes::bf16_mixed().exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16);
  std::vector<std::vector<torch::Tensor>> params(2);
  std::vector<size_t> optimizer_params(2);
  const auto errors = testing::run_ranks(
      2,
      [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
        torch::manual_seed(5);
        torch::nn::Sequential model(torch::nn::Linear(4, 4));
        torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
        MixedPrecisionPlugin plugin(options);
        plugin.set_process_group(group, DistributedOptimizerOptions());
        plugin.connect(*model, optimizer);
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(100 + step);
          const auto x = torch::randn({8, 4}), y = torch::randn({8, 4});
          torch::Tensor loss;
          {
            auto context = plugin.forward_context();
            loss = torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y);
          }
          plugin.backward(loss);
          EXPECT_TRUE(plugin.optimizer_step(optimizer));
        }
        for (const auto& p : model->parameters()) params[rank].push_back(p.detach().to(at::kFloat).clone());
        optimizer_params[rank] = optimizer.param_groups().front().params().size();
      },
      std::chrono::seconds(30));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_EQ(optimizer_params[0], 2u);
  EXPECT_EQ(optimizer_params[1], 0u) << "rank 1 was to hold no master (the model fits rank 0's share)";
  EXPECT_EQ(max_abs_diff(params[1], params[0]), 0.0);
}

// fp32, bf16 and bf16 + FP8 fp8_params (its weights written at the current scale, and at the
// last step's through the fused step) with the loss bounds of the tests above (fp32 to
// rounding; bf16 and FP8 per HalfAndFp8PrecisionsMatchSingleRankWithinTheirRounding).
struct PrecisionCase {
  const char* name;
  MixedPrecisionOptions options;
  double loss_bound;
};
std::vector<PrecisionCase> fp32_bf16_fp8_cases() {
  return {
      {"32", MixedPrecisionOptions("32"), 1e-5},
      {"bf16-mixed", recipes::bf16_mixed(), 2e-3},
      {"bf16 + fp8 hybrid, fp8_params", recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0), 1e-2},
      {"bf16 + fp8 hybrid, fp8_params, delayed weight scaling, bf16 moments",
       recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_params_scaling("delayed").exp_avg_dtype(at::kBFloat16)
           .exp_avg_sq_dtype(at::kBFloat16),
       1e-2},
  };
}

// Each rank initialized its own model (rank r from seed kSeed + r): training starts from rank 0's
// parameters, as DDP broadcasts them, so it is single-rank training from rank 0's model; FP8
// weights (fp8_params) included, whose masters start from rank 0's high-precision values.
TEST(DistributedOptimizerTest, EveryRankStartsFromRankZerosParameters) {
  for (const auto& c : fp32_bf16_fp8_cases()) {
    SCOPED_TRACE(c.name);
    {
      auto a = initial_model(c.options), b = initial_model(c.options, kSeed + 1);
      ASSERT_FALSE(a->parameters()[0].equal(b->parameters()[0])) << "the ranks' inits must differ";
    }
    const auto reference = train(c.options, 8, {}, initial_model(c.options));
    const auto runs = train_ranks(c.options, 3, 8, 1, 0, nullptr, /*different_inits=*/true);
    expect_ranks_agree(runs);
    EXPECT_LT(max_rel_loss_diff(runs[0].losses, reference.losses), c.loss_bound);
  }
}

// FP8 weights (fp8_params) included: their micro-batches' gradients accumulate in their bucket
// slice (main_grad) with gradient sync off for the first, and the second's hook launches it.
TEST(DistributedOptimizerTest, GradientAccumulationAndClippingMatchSingleRank) {
  for (const auto& c : fp32_bf16_fp8_cases()) {
    SCOPED_TRACE(c.name);
    // Single rank: 4 micro-batches of 12 rows; 2 ranks: 2 micro-batches of 12 rows each.
    const auto reference = train(c.options, 6, {}, initial_model(c.options), /*accumulate=*/4, /*clip=*/1);
    const auto runs = train_ranks(c.options, 2, 6, /*accumulate=*/2, /*clip=*/1);
    expect_ranks_agree(runs);
    EXPECT_LT(max_rel_loss_diff(runs[0].losses, reference.losses), c.loss_bound);
    if (std::string(c.name) == "32") {
      EXPECT_LT(max_abs_diff(runs[0].params, reference.params), 1e-5);
    }
  }
}

TEST(DistributedOptimizerTest, EachRankHoldsOneNthOfTheMastersAndOptimizerState) {
  const auto options = recipes::bf16_mixed();
  const auto single = train(options, 2, {}, initial_model(options));
  int64_t params = 0;
  for (const auto& p : single.params) params += p.numel();
  EXPECT_EQ(single.state_bytes, params * 12) << "float32 master + exp_avg + exp_avg_sq";
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const auto runs = train_ranks(options, world, 2);
    int64_t total = 0;
    for (const auto& run : runs) {
      // Each bucket (2 here) is padded to a multiple of world × 64 elements and the padding
      // sits in the last shards: a rank holds an even share ± one bucket's padding per bucket.
      EXPECT_NEAR(static_cast<double>(run.state_bytes), static_cast<double>(single.state_bytes) / world,
                  2.0 * world * 64 * 12);
      total += run.state_bytes;
    }
    EXPECT_EQ(total, single.state_bytes) << "the shards cover every element exactly once";
  }
}

int64_t bytes_of(const std::vector<InProcessWorld::Record>& log, const std::string& op, c10::ScalarType dtype) {
  int64_t bytes = 0;
  for (const auto& r : log) {
    if (r.op == op && r.dtype == dtype) bytes += r.bytes;
  }
  return bytes;
}

int64_t bytes_of(const std::vector<InProcessWorld::Record>& log, const std::string& op) {
  int64_t bytes = 0;
  for (const auto& r : log) {
    if (r.op == op) bytes += r.bytes;
  }
  return bytes;
}

TEST(DistributedOptimizerTest, ReduceScatterDtypeFollowsGradReduceInFp32) {
  for (bool in_fp32 : {true, false}) {
    SCOPED_TRACE(in_fp32 ? "grad_reduce_in_fp32" : "grads reduced in bf16");
    std::shared_ptr<InProcessWorld> world;
    train_ranks(recipes::bf16_mixed().grad_reduce_in_fp32(in_fp32), 2, 3, 1, 0, &world);
    const auto log = world->log(0);
    const auto dtype = in_fp32 ? at::kFloat : at::kBFloat16;
    const int64_t all = bytes_of(log, "reduce_scatter");
    EXPECT_GT(all, 0);
    EXPECT_EQ(bytes_of(log, "reduce_scatter", dtype), all) << "every reduce-scatter in " << dtype;
  }
}

TEST(DistributedOptimizerTest, Fp8ParamsAllGatherWeightsAsOneBytePerElement) {
  std::shared_ptr<InProcessWorld> bf16_world, fp8_world;
  train_ranks(recipes::bf16_mixed().fp8("hybrid").fp8_min_gemm_size(0), 2, 2, 1, 0, &bf16_world);
  train_ranks(recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0), 2, 2, 1, 0, &fp8_world);
  const int64_t weights = 32 * 64 + 64 * 64 + 64 * 16;  // the MLP's Linear weights (FP8 eligible)
  const int64_t steps = 2, world = 2;
  // Per step, the all-gather's input is this rank's shard: bf16 params → 2 bytes per element.
  // fp8_params gathers once more, at connect (FP8 weights quantized from rank 0's masters).
  const int64_t bf16_gathered = bytes_of(bf16_world->log(0), "allgather") * world / steps;
  const int64_t fp8_gathered = bytes_of(fp8_world->log(0), "allgather") * world / (steps + 1);
  EXPECT_EQ(bytes_of(fp8_world->log(0), "allgather", at::kByte) * world / (steps + 1), weights)
      << "the FP8 weights travel as bytes, one per element";
  EXPECT_EQ(bf16_gathered - fp8_gathered, weights) << "the weights' share of the all-gather halves";
}

// FP8 weights accumulate their gradient in their bucket slices (main_grad); each module reports
// when it has, so their buckets are reduce-scattered during the backward pass like the others
// and nothing is left for the step. (Before, they waited for the step: 8 ms per step of
// exposed communication for a 1b GPT on two H200s.)
TEST(DistributedOptimizerTest, Fp8WeightGradientsAreReducedDuringTheBackwardPass) {
  const auto options = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0);
  data();
  std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
  std::shared_ptr<InProcessWorld> world;
  std::vector<int64_t> after_backward(2, -1), after_step(2, -1);
  const auto errors = testing::run_ranks(
      2,
      [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
        auto& model = models[rank];
        torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
        MixedPrecisionPlugin plugin(options);
        // Three buckets: the 4096 + 1024 FP8 weights of layers 2-3, layer 1's 2048, the rest.
        plugin.set_process_group(group, DistributedOptimizerOptions().bucket_size(3000));
        plugin.connect(*model, optimizer);
        forward_backward(plugin, *model, /*step=*/0, rank, /*world=*/2);
        after_backward[rank] = bytes_of(world->log(rank), "reduce_scatter");
        EXPECT_TRUE(plugin.optimizer_step(optimizer));
        after_step[rank] = bytes_of(world->log(rank), "reduce_scatter");
      },
      std::chrono::seconds(60), &world);
  const int64_t fp8_weights = 32 * 64 + 64 * 64 + 64 * 16;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_GE(after_step[r], fp8_weights * 4) << "rank " << r << ": the FP8 weights' FP32 gradients";
    EXPECT_EQ(after_backward[r], after_step[r]) << "rank " << r << ": reduced during the backward pass";
  }
}

// `world` ranks training 5 steps whose all-gathers run only when waited for (so a parameter read
// before its wait is the previous step's); each rank's run and error ("" for none).
std::pair<std::vector<Run>, std::vector<std::string>> train_deferred(const MixedPrecisionOptions& options, int world,
                                                                     ParamGather gather,
                                                                     torch::Device device = torch::kCPU) {
  data();
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < world; ++r) models.push_back(initial_model(options));
  std::vector<Run> runs(world);
  const auto errors = testing::run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    testing::defer_allgathers(*group);
    runs[rank] = train(options, 5, group, models[rank], 1, 0, device, gather);
  });
  return {runs, errors};
}

// overlap_param_gather: the all-gathers stay in flight after the step; a forward pass that waits
// for each layer trains exactly as the gather at the step does, and fit returns the model with
// every bucket in. One that never waits is an error at its first gradient.
TEST(DistributedOptimizerTest, OverlappedParamGatherTrainsExactlyAsTheGatherAtTheStep) {
  const auto fp8 = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0);
  for (const auto& options : {MixedPrecisionOptions("32"), MixedPrecisionOptions("bf16-mixed"), fp8}) {
    SCOPED_TRACE(options.precision() + (options.fp8_enabled() ? " + fp8 fp8_params" : ""));
    const auto run = [&](int world, ParamGather gather) { return train_deferred(options, world, gather); };
    for (int world : {2, 3}) {
      SCOPED_TRACE("world " + std::to_string(world));
      const auto [at_step, at_step_errors] = run(world, ParamGather::kAfterStep);
      const auto [overlapped, overlapped_errors] = run(world, ParamGather::kOverlapped);
      for (int r = 0; r < world; ++r) {  // every rank's error, not only the first one's
        EXPECT_EQ(at_step_errors[r], "") << "rank " << r;
        EXPECT_EQ(overlapped_errors[r], "") << "rank " << r;
      }
      if (::testing::Test::HasFailure()) return;
      expect_ranks_agree(overlapped);
      EXPECT_EQ(overlapped[0].losses, at_step[0].losses);
      EXPECT_EQ(max_abs_diff(overlapped[0].params, at_step[0].params), 0.0);

      const auto [unwaited, unwaited_errors] = run(world, ParamGather::kOverlappedWithoutWaiting);
      for (int r = 0; r < world; ++r) {
        EXPECT_NE(unwaited_errors[r].find("before its all-gather was waited for"), std::string::npos)
            << "rank " << r << ": " << unwaited_errors[r];
        EXPECT_NE(unwaited_errors[r].find("amp8::wait_for_params(block)"), std::string::npos)
            << unwaited_errors[r];
      }
    }
  }
}

// FP8 weights (fp8_params) have no autograd gradient: their missing wait is caught where their
// main_grad reports in. A model of FP8 weights only, whose forward pass never waits.
TEST(DistributedOptimizerTest, AnFp8WeightReadBeforeItsAllGatherIsNamed) {
  data();
  const auto options = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0);
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(kSeed);
    Fp8ModelInit init;
    models.push_back(torch::nn::Sequential(torch::nn::Linear(torch::nn::LinearOptions(32, 64).bias(false)),
                                           torch::nn::ReLU(),
                                           torch::nn::Linear(torch::nn::LinearOptions(64, 16).bias(false))));
  }
  const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    testing::defer_allgathers(*group);
    auto& model = models[rank];
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    plugin->set_process_group(group, DistributedOptimizerOptions().overlap_param_gather(true));
    Trainer trainer(TrainerOptions().max_steps(2).log_every_n_steps(0), plugin);
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      auto [x, y] = data().batch(in.step);
      x = x.narrow(0, rank * kGlobalRows / 2, kGlobalRows / 2), y = y.narrow(0, rank * kGlobalRows / 2, kGlobalRows / 2);
      return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
    });
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("before its all-gather was waited for"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// On the GPU the waits are the compute stream's and are timed: every step reports the all-gather
// (the last one's finished by fit), with the bytes of the gather at the step.
// bf16-mixed, not FP8: the in-process ranks share autograd's one CUDA device thread, and delayed
// scaling reduces the backward pass's amaxes across ranks at the end of each backward pass, on
// that thread, where rank 0's reduction would wait for a rank whose backward pass cannot run.
// (OverlappedParamGatherTrainsExactlyAsTheGatherAtTheStep covers FP8 on the CPU.)
TEST(DistributedOptimizerTest, OverlappedParamGatherIsTimedByItsWaits_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a GPU";
  const auto options = recipes::bf16_mixed();
  const auto [at_step, at_step_errors] = train_deferred(options, 2, ParamGather::kAfterStep, torch::kCUDA);
  const auto [overlapped, overlapped_errors] = train_deferred(options, 2, ParamGather::kOverlapped, torch::kCUDA);
  for (int r = 0; r < 2; ++r) {  // every rank's error, not only the first one's
    EXPECT_EQ(at_step_errors[r], "") << "rank " << r;
    EXPECT_EQ(overlapped_errors[r], "") << "rank " << r;
  }
  if (::testing::Test::HasFailure()) return;
  EXPECT_EQ(max_abs_diff(overlapped[0].params, at_step[0].params), 0.0);
  ASSERT_EQ(overlapped[0].communication.size(), 5u);
  ASSERT_EQ(at_step[0].communication.size(), 5u);
  double gather_ms = 0;
  for (size_t s = 0; s < 5; ++s) {
    const auto& step = overlapped[0].communication[s];
    EXPECT_GT(step.gather_bytes, 0) << "step " << s;
    EXPECT_EQ(step.gather_bytes, at_step[0].communication[s].gather_bytes) << "step " << s;
    EXPECT_GE(step.gather_ms, 0.0) << "step " << s;
    EXPECT_TRUE(std::isfinite(step.gather_ms)) << "step " << s;
    gather_ms += step.gather_ms;
  }
  // The in-process all-gather runs its copies on the compute stream inside the timed wait.
  EXPECT_GT(gather_ms, 0.0);
}

// The buckets' all-gathers launch in the order the forward pass uses them and each wait runs
// only the buckets of its module; a checkpoint, and a fit that ends in an error, finish them.
TEST(DistributedOptimizerTest, OverlappedParamGatherWaitsBucketByBucket) {
  data();
  const auto options = MixedPrecisionOptions("32");
  std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
  std::shared_ptr<InProcessWorld> world;
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "overlap");
  std::filesystem::create_directories(dir);
  const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    testing::defer_allgathers(*group);
    auto& model = models[rank];
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    // Buckets of 3000 elements, laid out from the last parameter: {fc1.weight, fc1.bias} alone,
    // the other four together (5200 elements); each padded to 2 x 64, each rank gathering half.
    plugin->set_process_group(group, DistributedOptimizerOptions().bucket_size(3000).overlap_param_gather(true));
    const auto logged = [&](const std::string& op) {
      std::vector<int64_t> bytes;
      for (const auto& record : world->log(rank)) {
        if (record.op == op) bytes.push_back(record.bytes);
      }
      return bytes;
    };
    const std::vector<int64_t> shard_bytes{2176 / 2 * 4, 5248 / 2 * 4};  // in the forward pass's order
    // One step through fit (which connects the plugin and leaves with every bucket gathered).
    Trainer trainer(TrainerOptions().max_steps(1).log_every_n_steps(0), plugin);
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      auto [x, y] = data().batch(in.step);
      x = x.narrow(0, rank * kGlobalRows / 2, kGlobalRows / 2), y = y.narrow(0, rank * kGlobalRows / 2, kGlobalRows / 2);
      return torch::mse_loss(model->forward(x), y);
    });
    EXPECT_EQ(logged("allgather launched"), shard_bytes) << "the first layer's bucket first";
    EXPECT_EQ(logged("allgather"), shard_bytes);

    forward_backward(*plugin, *model, 1, rank, 2);
    plugin->optimizer_step(optimizer);
    EXPECT_EQ(logged("allgather launched").size(), 4u);
    EXPECT_EQ(logged("allgather").size(), 2u) << "nothing waited for yet";
    wait_for_params(*model[0]);
    EXPECT_EQ(logged("allgather"), (std::vector<int64_t>{shard_bytes[0], shard_bytes[1], shard_bytes[0]}))
        << "only the first layer's bucket";
    wait_for_params(*model[0]);
    EXPECT_EQ(logged("allgather").size(), 3u) << "a bucket is gathered once";
    trainer.save_checkpoint((dir / ("rank" + std::to_string(rank))).string(), *model, optimizer);
    EXPECT_EQ(logged("allgather").size(), 4u) << "the checkpoint reads every parameter after its gather";

    forward_backward(*plugin, *model, 2, rank, 2);
    plugin->optimizer_step(optimizer);
    EXPECT_EQ(logged("allgather").size(), 4u);
    trainer.options.max_steps(3);
    const auto error = testing::error_of([&] {
      trainer.fit(*model, optimizer, [](const TrainStepInput&) -> torch::Tensor {
        TORCH_CHECK(false, "the training step's own error");
      });
    });
    EXPECT_NE(error.find("the training step's own error"), std::string::npos) << error;
    EXPECT_EQ(logged("allgather").size(), 6u) << "fit leaves with the parameters final, even on an error";
  }, std::chrono::seconds(60), &world);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// An FP8 weight's main_grad is its slice of the gradient buffer (Megatron's param.main_grad),
// in the buffer's dtype: no FP32 tensor of the module's own beside the bucket, and no copy.
TEST(DistributedOptimizerTest, Fp8MainGradsAreSlicesOfTheGradientBuffer) {
  for (const bool in_fp32 : {true, false}) {
    SCOPED_TRACE(in_fp32 ? "grad_reduce_in_fp32" : "grads reduced in bf16");
    const auto options = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).grad_reduce_in_fp32(in_fp32);
    data();
    std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
    const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
      auto& model = models[rank];
      torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
      MixedPrecisionPlugin plugin(options);
      plugin.set_process_group(group);
      plugin.connect(*model, optimizer);
      std::vector<std::shared_ptr<Fp8LinearImpl>> layers;
      for (const auto& module : model->modules(/*include_self=*/false)) {
        if (auto linear = std::dynamic_pointer_cast<Fp8LinearImpl>(module)) layers.push_back(linear);
      }
      ASSERT_EQ(layers.size(), 3u);
      for (const auto& layer : layers) {
        ASSERT_TRUE(layer->main_grad().defined());
        EXPECT_EQ(layer->main_grad().scalar_type(), in_fp32 ? at::kFloat : at::kBFloat16);
        EXPECT_TRUE(layer->main_grad().is_alias_of(layers[0]->main_grad()))
            << "every FP8 weight's main_grad lies in the one FP8 gradient buffer";
      }
      forward_backward(plugin, *model, /*step=*/0, rank, /*world=*/2);
      EXPECT_TRUE(plugin.optimizer_step(optimizer));
      for (const auto& layer : layers) {
        ASSERT_TRUE(layer->main_grad().defined()) << "still bound after the step";
        EXPECT_TRUE(layer->main_grad().is_alias_of(layers[0]->main_grad()));
        EXPECT_EQ(layer->main_grad().abs().max().item<float>(), 0.0f) << "zeroed with the buffer";
      }
      // Binding over a binding is refused; a weight unbound behind the optimizer's back fails
      // the next step (before any collective) instead of training on zero gradients.
      testing::ExpectErrorContaining(
          [&] { layers[1]->set_main_grad_buffer(torch::zeros_like(layers[1]->main_grad())); },
          "already bound");
      layers[1]->set_main_grad_buffer({});
      testing::ExpectErrorContaining([&] { plugin.optimizer_step(optimizer); },
                                     "no longer its slice of the gradient buffer");
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  }
}

// An FP8 layer used twice in one forward pass: its main_grad is complete only after the second
// backward through it, so its bucket must not be reduced after the first. With one parameter
// per bucket and no bias on the shared layer, nothing else holds its bucket back.
struct SharedLayerNet : torch::nn::Module {
  SharedLayerNet() {
    Fp8ModelInit init;
    shared = register_module("shared", Fp8Linear(Fp8LinearOptions(32, 32).bias(false)));
    head = register_module("head", Fp8Linear(Fp8LinearOptions(32, 16)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::relu(shared(torch::relu(shared(x)))));
  }
  Fp8Linear shared{nullptr}, head{nullptr};
};

TEST(DistributedOptimizerTest, AnFp8LayerUsedTwicePerForwardPassIsReducedWhenComplete) {
  const auto options = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0);
  data();
  constexpr int kSteps = 4;
  // Every model from the same seed, built before any rank thread runs.
  std::vector<std::shared_ptr<SharedLayerNet>> nets;
  for (int i = 0; i < 3; ++i) {
    torch::manual_seed(kSeed);
    nets.push_back(std::make_shared<SharedLayerNet>());
  }
  auto train_net = [&](SharedLayerNet& net, int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    torch::optim::AdamW optimizer(net.parameters(), torch::optim::AdamWOptions(3e-3));
    MixedPrecisionPlugin plugin(options);
    if (group) plugin.set_process_group(group, DistributedOptimizerOptions().bucket_size(1));
    plugin.connect(net, optimizer);
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      const auto loss = forward_backward(plugin, net, step, rank, world);
      EXPECT_TRUE(plugin.optimizer_step(optimizer));
      losses.push_back(loss.item<double>());
    }
    return losses;
  };
  const auto reference = train_net(*nets[2], 0, 1, {});
  std::vector<std::vector<double>> losses(2);
  const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    losses[rank] = train_net(*nets[rank], rank, 2, group);
  });
  for (int r = 0; r < 2; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  std::vector<double> global(kSteps);  // the two halves' mean: the full batch's loss
  for (int s = 0; s < kSteps; ++s) global[s] = (losses[0][s] + losses[1][s]) / 2;
  EXPECT_LT(max_rel_loss_diff(global, reference), 1e-2);
}

TEST(DistributedOptimizerTest, ShardedCheckpointResumesExactlyAndARenamedShardIsNamed) {
  const auto options = recipes::fp16_mixed().fp16_initial_loss_scale(1 << 24);
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "sharded");
  data();
  auto step_fn = [&](torch::nn::Sequential& model, int rank) {
    return [&model, rank](const TrainStepInput& in) {
      auto [x, y] = data().batch(in.step);
      x = x.narrow(0, rank * 24, 24), y = y.narrow(0, rank * 24, 24);
      return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
    };
  };
  auto fit = [&](int steps, const std::string& resume, bool save, std::vector<std::vector<double>>* losses,
                 std::vector<std::vector<torch::Tensor>>* params) {
    std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
    return testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
      auto& model = models[rank];
      torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
      auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
      plugin->set_process_group(group, DistributedOptimizerOptions().bucket_size(3000));
      Trainer trainer(TrainerOptions().max_steps(steps).log_every_n_steps(0).checkpoint_dir(dir.string())
                          .every_n_train_steps(save ? 4 : 0).save_last(save),
                      plugin);
      trainer.fit(*model, optimizer, step_fn(model, rank), resume);
      if (losses) {
        for (const auto& m : trainer.history()) (*losses)[rank].push_back(m.loss);
      }
      if (params) {
        for (const auto& p : model->parameters()) (*params)[rank].push_back(p.detach().clone());
      }
    });
  };
  std::vector<std::vector<double>> straight(2), resumed(2);
  std::vector<std::vector<torch::Tensor>> straight_params(2), resumed_params(2);
  for (const auto& e : fit(8, "", false, &straight, &straight_params)) ASSERT_EQ(e, "");
  for (const auto& e : fit(4, "", true, nullptr, nullptr)) ASSERT_EQ(e, "");
  EXPECT_TRUE(std::filesystem::exists(dir / "step_00000004-rank0-of-2.ckpt"));
  EXPECT_TRUE(std::filesystem::exists(dir / "step_00000004-rank1-of-2.ckpt"));
  for (const auto& e : fit(8, dir.string(), false, &resumed, &resumed_params)) ASSERT_EQ(e, "");
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<double> tail(straight[rank].begin() + 4, straight[rank].end());
    EXPECT_EQ(resumed[rank], tail) << "rank " << rank;
    EXPECT_EQ(max_abs_diff(resumed_params[rank], straight_params[rank]), 0.0) << "rank " << rank;
  }

  // A shard under a name of its own cannot be loaded into another world size: the other ranks'
  // files are found by the Trainer's names.
  std::filesystem::copy_file(dir / "step_00000004-rank0-of-2.ckpt", dir / "mine.ckpt");
  auto model = initial_model(options);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto errors = testing::run_ranks(1, [&](int, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    plugin->set_process_group(group);
    Trainer trainer(TrainerOptions().max_steps(8).log_every_n_steps(0), plugin);
    trainer.load_checkpoint((dir / "mine.ckpt").string(), *model, optimizer);
  });
  EXPECT_NE(errors[0].find("was written by 2 data-parallel rank(s), this run has 1; its other ranks' files are "
                           "found by the names the Trainer gives them (step_00000004-rank0-of-2.ckpt"),
            std::string::npos)
      << errors[0];
  testing::remove_tree(dir);
}

// Elastic world sizes: N ranks write a checkpoint, M ranks load it.
struct WorldRun {
  std::vector<double> losses;         // the steps this run trained (the global loss)
  std::vector<torch::Tensor> params;  // rank 0's model after training, as float32
};

// `world` ranks train to step `steps` from `resume` ("" none; a folder or a file), AdamW with two
// param groups (weights with decay, biases without), saving every rank's file every
// `save_every` steps into `save_dir`. With `reshard_to`, they only load `resume` and write it
// again, as their own files at its step, into `reshard_to`.
// `errors`: each rank's error, for a test that expects some; without it every rank must succeed.
WorldRun fit_world(const MixedPrecisionOptions& options, int world, int steps, const std::string& resume,
                   const std::string& save_dir = "", int save_every = 0, const std::string& reshard_to = "",
                   torch::Device device = torch::kCPU, std::vector<std::string>* errors = nullptr) {
  data();
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < world; ++r) models.push_back(initial_model(options));
  std::vector<WorldRun> runs(world);
  const auto rank_errors = testing::run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto& model = models[rank];
    model->to(device);
    std::vector<torch::Tensor> weights, biases;
    for (const auto& item : model->named_parameters()) {
      (item.key().find("bias") == std::string::npos ? weights : biases).push_back(item.value());
    }
    torch::optim::AdamW optimizer(
        {torch::optim::OptimizerParamGroup(weights, std::make_unique<torch::optim::AdamWOptions>(
                                                        torch::optim::AdamWOptions(3e-3).weight_decay(0.01))),
         torch::optim::OptimizerParamGroup(biases, std::make_unique<torch::optim::AdamWOptions>(
                                                       torch::optim::AdamWOptions(3e-3).weight_decay(0.0)))},
        torch::optim::AdamWOptions(3e-3));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    plugin->set_process_group(group, DistributedOptimizerOptions().bucket_size(3000).overlap_grad_reduce(
                                         !device.is_cuda()));  // the in-process group has no CUDA streams
    Trainer trainer(TrainerOptions().max_steps(steps).log_every_n_steps(0).checkpoint_dir(save_dir)
                        .every_n_train_steps(save_every).save_last(false),
                    plugin);
    if (!reshard_to.empty()) {
      trainer.load_checkpoint(resume, *model, optimizer);
      trainer.save_checkpoint(
          (std::filesystem::path(reshard_to) / Trainer::checkpoint_name(trainer.global_step(), rank, world)).string(),
          *model, optimizer);
      return;
    }
    const int64_t rows = kGlobalRows / world;
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      auto [x, y] = data().batch(in.step);
      x = x.narrow(0, rank * rows, rows).to(device), y = y.narrow(0, rank * rows, rows).to(device);
      return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
    }, resume);
    for (const auto& m : trainer.history()) runs[rank].losses.push_back(m.loss);
    for (const auto& p : model->parameters()) runs[rank].params.push_back(p.detach().to(torch::kCPU, at::kFloat).clone());
  });
  if (errors != nullptr) {
    *errors = rank_errors;
    return runs[0];
  }
  for (int r = 0; r < world; ++r) EXPECT_EQ(rank_errors[r], "") << "rank " << r;
  for (int r = 1; r < world; ++r) EXPECT_EQ(runs[r].losses, runs[0].losses) << "rank " << r;
  return runs[0];
}

// A checkpoint of N ranks loads into M (1 -> 3, 4 -> 2, 2 -> 1), in fp32, bf16 and FP8 with
// fp8_params: the masters and AdamW's moments are put together from the N files and cut again.
// Exact: N ranks resuming from the M ranks' re-save of it (N -> M -> N) train on bit for bit as
// if it had never been resharded. Within rounding: M ranks resuming from it match the N ranks'
// own continuation within the bounds of different rank counts on one global batch
// (fp32_bf16_fp8_cases).
TEST(DistributedOptimizerTest, ACheckpointOfNRanksLoadsIntoMRanks) {
  for (const auto& c : fp32_bf16_fp8_cases()) {
    for (const auto& [n, m] : std::vector<std::pair<int, int>>{{1, 3}, {4, 2}, {2, 1}}) {
      SCOPED_TRACE(std::string(c.name) + ", " + std::to_string(n) + " -> " + std::to_string(m) + " ranks");
      const auto written = testing::scratch_path("DistributedOptimizerTest", "written");
      const auto resharded = testing::scratch_path("DistributedOptimizerTest", "resharded");
      std::filesystem::create_directories(resharded);
      const auto straight = fit_world(c.options, n, 8, "", written.string(), 4);
      ASSERT_EQ(straight.losses.size(), 8u);
      const std::vector<double> tail(straight.losses.begin() + 4, straight.losses.end());
      const auto checkpoint = (written / Trainer::checkpoint_name(4, 0, n)).string();

      const auto on_m = fit_world(c.options, m, 8, checkpoint);
      EXPECT_LT(max_rel_loss_diff(on_m.losses, tail), c.loss_bound);

      fit_world(c.options, m, 4, checkpoint, "", 0, resharded.string());
      for (int r = 0; r < m; ++r) EXPECT_TRUE(std::filesystem::exists(resharded / Trainer::checkpoint_name(4, r, m)));
      const auto back = fit_world(c.options, n, 8, resharded.string());  // the folder: latest_checkpoint finds it
      EXPECT_EQ(back.losses, tail);
      EXPECT_EQ(max_abs_diff(back.params, straight.params), 0.0);
      testing::remove_tree(written.string());
      testing::remove_tree(resharded.string());
    }
  }
}

// The same on the GPU, where the plugin steps with the fused multi-tensor kernels that read the
// optimizer state the load rebuilt (on the masters' device): bf16, 2 -> 1 and 1 -> 2 ranks.
TEST(DistributedOptimizerTest, ACheckpointOfNRanksLoadsIntoMRanksOnTheGpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA);
  for (const auto& [n, m] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}}) {
    SCOPED_TRACE(std::to_string(n) + " -> " + std::to_string(m) + " ranks");
    const auto written = testing::scratch_path("DistributedOptimizerTest", "written_cuda");
    const auto resharded = testing::scratch_path("DistributedOptimizerTest", "resharded_cuda");
    std::filesystem::create_directories(resharded);
    const auto options = recipes::bf16_mixed();
    const auto straight = fit_world(options, n, 8, "", written.string(), 4, "", cuda);
    ASSERT_EQ(straight.losses.size(), 8u);
    const std::vector<double> tail(straight.losses.begin() + 4, straight.losses.end());
    const auto checkpoint = (written / Trainer::checkpoint_name(4, 0, n)).string();
    const auto on_m = fit_world(options, m, 8, checkpoint, "", 0, "", cuda);
    EXPECT_LT(max_rel_loss_diff(on_m.losses, tail), 2e-3);  // fp32_bf16_fp8_cases' bf16 bound
    fit_world(options, m, 4, checkpoint, "", 0, resharded.string(), cuda);
    const auto back = fit_world(options, n, 8, resharded.string(), "", 0, "", cuda);
    EXPECT_EQ(back.losses, tail);
    EXPECT_EQ(max_abs_diff(back.params, straight.params), 0.0);
    testing::remove_tree(written.string());
    testing::remove_tree(resharded.string());
  }
}

// The names checkpoint_name gives read back as what they say; no other name does.
TEST(DistributedOptimizerTest, CheckpointNamesReadBack) {
  for (const auto& [step, rank, world] : std::vector<std::tuple<int64_t, int, int>>{
           {0, 0, 1}, {4, 0, 1}, {123456789012, 0, 1}, {4, 1, 2}, {7, 2146, 2147483647}}) {
    const auto parsed = Trainer::parse_checkpoint_name(Trainer::checkpoint_name(step, rank, world));
    ASSERT_TRUE(parsed.has_value()) << Trainer::checkpoint_name(step, rank, world);
    EXPECT_EQ(parsed->step, step);
    EXPECT_EQ(parsed->rank, rank);
    EXPECT_EQ(parsed->world_size, world);
  }
  for (const char* name : {"step_99999999999999999999.ckpt", "step_00000009-rank99999999999-of-2.ckpt",
                           "step_00000009-rank0-of-1.ckpt", "step_00000009-rank2-of-2.ckpt",
                           "step_00000009-rank0-of-0.ckpt", "step_00000009-rank0-of-2147483648.ckpt", "step_.ckpt", "step_00000009.ckpt.tmp",
                           "renamed.ckpt"}) {
    EXPECT_FALSE(Trainer::parse_checkpoint_name(name).has_value()) << name;
  }
}

// A run stopped between its ranks' saves leaves the newest step with only some ranks' files:
// every rank passes over that step alike (a rank that has its file would otherwise resume from
// a step the others cannot, and the resume fails for all of them).
TEST(DistributedOptimizerTest, EveryRankSkipsAStepSomeRankDidNotSave) {
  const auto options = recipes::bf16_mixed();
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "save_cut_between_ranks");
  fit_world(options, 2, 4, "", dir.string(), 2);
  std::filesystem::remove(dir / Trainer::checkpoint_name(4, 1, 2));
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<std::string> skipped;
    EXPECT_EQ(Trainer::latest_checkpoint(dir.string(), rank, 2, &skipped),
              (dir / Trainer::checkpoint_name(2, rank, 2)).string());
    ASSERT_EQ(skipped.size(), 1u) << "rank " << rank;
    EXPECT_NE(skipped[0].find(Trainer::checkpoint_name(4, 1, 2) + " is missing"), std::string::npos) << skipped[0];
  }
  // With every file there, each rank takes its own file of the newest step.
  fit_world(options, 2, 4, "", dir.string(), 2);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(Trainer::latest_checkpoint(dir.string(), rank, 2), (dir / Trainer::checkpoint_name(4, rank, 2)).string());
  }
}

// A rank whose own newest file is corrupt would resume alone from an older step (every rank
// then stopped: "resumed from different steps"). Given the folder, fit has the ranks agree: all
// go back to the newest step every rank can load, and train on exactly as the run did.
TEST(DistributedOptimizerTest, RanksAgreeOnAStepWhenOneRanksNewestFileIsCorrupt) {
  const auto options = recipes::bf16_mixed();
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "corrupt_newest_of_one_rank");
  const auto straight = fit_world(options, 2, 6, "", dir.string(), 2);  // saves steps 2, 4 and 6
  {
    std::fstream file(dir / Trainer::checkpoint_name(6, 1, 2), std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    file.put('\x7f');  // one byte of the archive: the checksum catches it
  }
  EXPECT_EQ(Trainer::latest_checkpoint(dir.string(), 0, 2), (dir / Trainer::checkpoint_name(6, 0, 2)).string());
  EXPECT_EQ(Trainer::latest_checkpoint(dir.string(), 1, 2), (dir / Trainer::checkpoint_name(4, 1, 2)).string());
  const auto resumed = fit_world(options, 2, 6, dir.string());  // both ranks from step 4
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[0], straight.losses[4]);
  EXPECT_EQ(resumed.losses[1], straight.losses[5]);
  ASSERT_EQ(resumed.params.size(), straight.params.size());
  for (size_t i = 0; i < resumed.params.size(); ++i) EXPECT_TRUE(torch::equal(resumed.params[i], straight.params[i])) << i;
}

void corrupt(const std::filesystem::path& file) {
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  stream.seekp(100);
  stream.put('\x7f');  // one byte of the archive: the checksum catches it
}

// Agreement over several rounds: rank 1's step 6 and rank 0's step 4 corrupt. Round one: steps
// 6 and 4, rank 0 goes back and finds step 2; round two: 2 and 4, rank 1 goes back to 2.
TEST(DistributedOptimizerTest, RanksAgreeOverSeveralRounds) {
  const auto options = recipes::bf16_mixed();
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "agree_over_rounds");
  const auto straight = fit_world(options, 2, 6, "", dir.string(), 2);
  corrupt(dir / Trainer::checkpoint_name(6, 1, 2));
  corrupt(dir / Trainer::checkpoint_name(4, 0, 2));
  const auto resumed = fit_world(options, 2, 6, dir.string());  // both ranks from step 2
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[2 + i]) << "step " << 3 + i;
}

// One step, two checkpoints of it (written by one rank and by two): a rank whose own file is
// corrupt would take the one-rank checkpoint (resharded) while the other loads its shard. Every
// rank stops instead, saying what to move away.
TEST(DistributedOptimizerTest, OneStepWrittenByTwoWorldSizesIsNotMixed) {
  const auto options = recipes::bf16_mixed();
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "one_step_two_world_sizes");
  fit_world(options, 1, 4, "", dir.string(), 2);
  fit_world(options, 2, 4, "", dir.string(), 2);
  corrupt(dir / Trainer::checkpoint_name(4, 1, 2));
  EXPECT_EQ(Trainer::latest_checkpoint(dir.string(), 1, 2), (dir / Trainer::checkpoint_name(4)).string());
  std::vector<std::string> errors;
  fit_world(options, 2, 6, dir.string(), "", 0, "", torch::kCPU, &errors);
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& error : errors) {
    EXPECT_NE(error.find("at step 4 in " + dir.string() + " the data-parallel ranks would load checkpoints "
                         "written by different numbers of ranks (2, 1)"), std::string::npos) << error;
  }
}

// A rank with no checkpoint it can load stops every rank, naming it (not a hang, not a mix).
TEST(DistributedOptimizerTest, ARankWithNoCheckpointLeftStopsEveryRank) {
  const auto options = recipes::bf16_mixed();
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "rank_without_checkpoint");
  fit_world(options, 2, 4, "", dir.string(), 2);
  corrupt(dir / Trainer::checkpoint_name(4, 1, 2));
  corrupt(dir / Trainer::checkpoint_name(2, 1, 2));
  std::vector<std::string> errors;
  fit_world(options, 2, 6, dir.string(), "", 0, "", torch::kCPU, &errors);
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& error : errors) {
    EXPECT_NE(error.find("data-parallel rank 1 has no complete checkpoint in " + dir.string() +
                         " that it can load (the ranks' picks: steps 4, -1"), std::string::npos) << error;
  }
}

// A checkpoint missing one rank's file cannot be resharded: latest_checkpoint skips its step
// (and passes over names the Trainer never writes), load_checkpoint names the missing file.
TEST(DistributedOptimizerTest, ACheckpointThatCannotBeReshardedIsNamed) {
  const auto options = recipes::bf16_mixed();
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "reshard_missing");
  fit_world(options, 2, 4, "", dir.string(), 2);
  std::filesystem::remove(dir / Trainer::checkpoint_name(4, 1, 2));
  // Names no Trainer writes, with numbers past int64 / int: passed over.
  for (const char* name : {"step_99999999999999999999.ckpt", "step_00000009-rank99999999999-of-2.ckpt",
                           "step_00000009-rank0-of-1.ckpt"}) {
    std::ofstream(dir / name) << "not a checkpoint";
  }
  std::vector<std::string> skipped;
  EXPECT_EQ(Trainer::latest_checkpoint(dir.string(), 0, 3, &skipped), (dir / Trainer::checkpoint_name(2, 0, 2)).string());
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find(Trainer::checkpoint_name(4, 1, 2) + " is missing"), std::string::npos) << skipped[0];

  auto model = initial_model(options);
  const auto missing = testing::run_ranks(1, [&](int, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    plugin->set_process_group(group);
    Trainer trainer(TrainerOptions().max_steps(8).log_every_n_steps(0), plugin);
    trainer.load_checkpoint((dir / Trainer::checkpoint_name(4, 0, 2)).string(), *model, optimizer);
  })[0];
  EXPECT_NE(missing.find(Trainer::checkpoint_name(4, 1, 2)), std::string::npos) << missing;

  // A rank's file under a name the Trainer never gives it: its other ranks' files cannot be found,
  // which the error says at once, however many ranks the file claims (the name is read, not
  // compared with every rank's name: 2^31 - 1 ranks took minutes).
  const auto renamed = dir / "renamed.ckpt";
  std::filesystem::copy_file(dir / Trainer::checkpoint_name(2, 0, 2), renamed);
  struct ClaimsEveryRank : MixedPrecisionPlugin {
    using MixedPrecisionPlugin::MixedPrecisionPlugin;
    int checkpoint_world_size(torch::serialize::InputArchive&) const override {
      return std::numeric_limits<int>::max();
    }
  };
  for (const bool claims_every_rank : {false, true}) {
    SCOPED_TRACE(claims_every_rank ? "2^31 - 1 ranks" : "2 ranks");
    const auto start = std::chrono::steady_clock::now();
    const auto misnamed = testing::run_ranks(1, [&](int, c10::intrusive_ptr<c10d::ProcessGroup> group) {
      torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
      std::shared_ptr<MixedPrecisionPlugin> plugin = claims_every_rank ? std::make_shared<ClaimsEveryRank>(options)
                                      : std::make_shared<MixedPrecisionPlugin>(options);
      plugin->set_process_group(group);
      Trainer trainer(TrainerOptions().max_steps(8).log_every_n_steps(0), plugin);
      trainer.load_checkpoint(renamed.string(), *model, optimizer);
    })[0];
    const std::string ranks = claims_every_rank ? "2147483647" : "2";
    EXPECT_NE(misnamed.find("renamed.ckpt was written by " + ranks + " data-parallel rank(s), this run has 1; its "
                            "other ranks' files are found by the names the Trainer gives them (step_00000002-rank0-of-" +
                            ranks + ".ckpt, ...), and this file is named otherwise"),
              std::string::npos)
        << misnamed;
    // Not a benchmark: comparing with every rank's name took ~270 s here (2^31 names), reading
    // the name takes milliseconds; the bound only tells the two apart.
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  }
  testing::remove_tree(dir.string());
}

// A stop asked of one rank only (its SIGTERM) stops every rank after the same step, each saving
// its shard of that step; without the agreement the other rank would wait in the next step's
// collectives forever.
TEST(DistributedOptimizerTest, AStopAskedOfOneRankStopsEveryRankAfterTheSameStep) {
  const auto options = recipes::bf16_mixed();
  const auto dir = testing::scratch_path("DistributedOptimizerTest", "stop");
  data();
  std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
  std::vector<int64_t> steps(2);
  std::vector<bool> stopped(2);
  const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto& model = models[rank];
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    plugin->set_process_group(group);
    Trainer trainer(TrainerOptions().max_steps(20).log_every_n_steps(0).checkpoint_dir(dir.string()), plugin);
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      if (rank == 1 && in.step == 4) trainer.request_stop();  // during step 5, on rank 1 only
      auto [x, y] = data().batch(in.step);
      x = x.narrow(0, rank * 24, 24), y = y.narrow(0, rank * 24, 24);
      return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
    });
    steps[rank] = trainer.global_step();
    stopped[rank] = trainer.stopped();
  });
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(steps[rank], 5) << "rank " << rank;
    EXPECT_TRUE(stopped[rank]) << "rank " << rank;
    EXPECT_TRUE(std::filesystem::exists(dir / Trainer::checkpoint_name(5, rank, 2))) << "rank " << rank;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / Trainer::checkpoint_name(20, 0, 2)));
  testing::remove_tree(dir);
}

// fp16: a NaN gradient on one rank only. After the averaging reduce-scatter the NaN sits in one
// rank's shard; found_inf is all-reduced (MAX), so every rank skips that step and the loss
// scaler backs off alike (without it the ranks would disagree and their collectives would no
// longer match).
TEST(DistributedOptimizerTest, AnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  const auto options = recipes::fp16_mixed().fp16_initial_loss_scale(1024).fp16_hysteresis(1);
  data();
  std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options), initial_model(options)};
  std::vector<std::vector<StepMetrics>> histories(3);
  const auto errors = testing::run_ranks(3, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto& model = models[rank];
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
    plugin->set_process_group(group, DistributedOptimizerOptions().bucket_size(3000));
    Trainer trainer(TrainerOptions().max_steps(6).log_every_n_steps(0), plugin);
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      auto [x, y] = data().batch(in.step);
      x = x.narrow(0, rank * 16, 16), y = y.narrow(0, rank * 16, 16);
      auto loss = torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
      if (rank == 1 && in.step == 2) {
        // 0 in the forward pass, NaN in the backward pass: d sqrt(u)/du at u = 0, times 0.
        auto bias = model->parameters().back();
        loss = loss + 0.0 * torch::sqrt(bias - bias.detach()).sum().to(at::kFloat);
      }
      return loss;
    });
    histories[rank] = trainer.history();
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    ASSERT_EQ(histories[rank].size(), 6u);
    EXPECT_FALSE(histories[rank][2].stepped);
    EXPECT_EQ(histories[rank][2].loss_scale, 512.0) << "backed off on every rank";
    EXPECT_EQ(histories[rank].back().skipped_steps, 1);
    for (int step : {0, 1, 3, 4, 5}) EXPECT_TRUE(histories[rank][step].stepped) << "step " << step + 1;
  }
  for (int rank = 1; rank < 3; ++rank) {
    std::vector<torch::Tensor> a, b;
    for (const auto& p : models[0]->parameters()) a.push_back(p.detach());
    for (const auto& p : models[rank]->parameters()) b.push_back(p.detach());
    EXPECT_EQ(max_abs_diff(a, b), 0.0) << "rank " << rank << " holds the same model";
  }
}

// An infinite gradient on one rank: the clipping all-reduces an infinite norm and must leave
// every gradient as it is (the step is then stopped or skipped), as the single-rank path does.
// The distributed path once scaled by max_norm / inf = 0, zeroing every finite gradient.
TEST(DistributedOptimizerTest, AnInfiniteNormLeavesTheGradientsUnclipped) {
  const auto options = recipes::bf16_mixed();
  data();
  std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
  std::vector<double> norms(2);
  const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto& model = models[rank];
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    MixedPrecisionPlugin plugin(options);
    plugin.set_process_group(group, DistributedOptimizerOptions().bucket_size(3000));
    plugin.connect(*model, optimizer);
    auto [x, y] = data().batch(0);
    x = x.narrow(0, rank * 24, 24), y = y.narrow(0, rank * 24, 24);
    auto loss = torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y);
    if (rank == 1) {  // d(bias · inf)/d bias = inf: one parameter's gradient is infinite
      loss = loss + (model->parameters().back().to(at::kFloat) * std::numeric_limits<float>::infinity()).sum();
    }
    plugin.backward(loss);
    plugin.unscale_gradients(optimizer);
    std::vector<torch::Tensor> before;
    for (const auto& master : plugin.master_params()) {
      if (master.grad().defined()) before.push_back(master.grad().clone());
    }
    norms[rank] = plugin.clip_gradients(optimizer, 1.0);
    size_t i = 0;
    int64_t finite_nonzero = 0;
    for (const auto& master : plugin.master_params()) {
      if (!master.grad().defined()) continue;
      EXPECT_TRUE(BytesEqual(master.grad(), before[i++])) << "rank " << rank << ": a gradient was clipped";
      finite_nonzero += (master.grad().isfinite() & master.grad().ne(0)).sum().item<int64_t>();
    }
    EXPECT_GT(finite_nonzero, 0) << "rank " << rank << " holds finite, non-zero gradients";
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  EXPECT_TRUE(std::isinf(norms[0]) && std::isinf(norms[1])) << norms[0] << ", " << norms[1];
}

TEST(DistributedOptimizerTest, ARankThatDiesMakesTheOthersFailWithinTheTimeout) {
  const auto options = recipes::bf16_mixed();
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < 3; ++r) models.push_back(initial_model(options));
  const auto start = std::chrono::steady_clock::now();
  const auto errors = testing::run_ranks(
      3,
      [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
        TORCH_CHECK(rank != 1, "rank 1 fails before its first step");
        train(options, 4, group, models[rank]);
      },
      std::chrono::milliseconds(500));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[1].find("rank 1 fails"), std::string::npos);
  for (int rank : {0, 2}) {
    EXPECT_NE(errors[rank].find("timed out after 500 ms: rank(s) 1 never joined"), std::string::npos)
        << "rank " << rank << ": " << errors[rank];
  }
  EXPECT_LT(seconds, 10.0);
}

// Training on one rank is the DistributedOptimizer's world of one: its masters are the whole
// parameters (float32 ones their own), it keeps no gradient buffer (nothing to reduce, so the
// gradients stay where the backward pass left them) and it can export the FP32 masters. The
// same holds for a process group of one rank.
TEST(DistributedOptimizerTest, AWorldOfOneKeepsNoBufferAndExportsItsMasters) {
  const auto options = recipes::bf16_mixed();
  data();
  auto check = [&](c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto model = initial_model(options);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    MixedPrecisionPlugin plugin(options);
    if (group) plugin.set_process_group(group);
    plugin.connect(*model, optimizer);
    const auto* owner = plugin.distributed_optimizer();
    ASSERT_NE(owner, nullptr) << "one master-params path for any world size";
    EXPECT_EQ(owner->world_size(), 1);
    EXPECT_EQ(owner->num_buckets(), 0);
    EXPECT_EQ(owner->padded_numel(), 0);
    forward_backward(plugin, *model, /*step=*/0, /*rank=*/0, /*world=*/1);
    for (const auto& param : model->parameters()) {
      ASSERT_TRUE(param.grad().defined()) << "no hook moved the gradient into a buffer";
      EXPECT_EQ(param.grad().scalar_type(), at::kBFloat16);
    }
    EXPECT_TRUE(plugin.optimizer_step(optimizer));
    const auto params = model->parameters();
    const auto masters = plugin.master_params();
    ASSERT_EQ(masters.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(masters[i].sizes(), params[i].sizes()) << "whole parameters, in their shape";
      const auto exported = plugin.fp32_value(params[i]);
      EXPECT_TRUE(exported.equal(masters[i].detach())) << "parameter " << i;
      EXPECT_FALSE(exported.is_same(masters[i])) << "a copy";
      EXPECT_TRUE(exported.to(at::kBFloat16).equal(params[i].detach())) << "the model holds its rounding";
    }
  };
  check({});
  const auto errors = testing::run_ranks(1, [&](int, c10::intrusive_ptr<c10d::ProcessGroup> group) { check(group); });
  EXPECT_EQ(errors[0], "");
}

// With several ranks the fused step reads each master's gradient shard where the reduce-scatter
// left it (float32, or bf16 / fp16 when grads reduce in the params dtype), unscaling and
// clipping it through its multiplier, and writes the half shard it all-gathers. SGD without
// momentum makes the masters a direct function of that multiplier: they must match the
// optimizer's own step on the float32 gradients it is given.
// The ranks are threads on one GPU, and autograd runs every CUDA backward function of a process
// on one device thread: a collective inside the backward pass would wait there for a rank whose
// backward pass cannot run. So the gradients reduce at the step (overlap_grad_reduce off) and
// there is no FP8 case (its gradient amaxes are all-reduced at the end of the backward pass);
// overlap and FP8 across GPUs are DistributedNcclTest's, under torchrun.
TEST(DistributedOptimizerTest, FusedStepOnShardsMatchesTheOptimizersOwnStep_CUDA) {
  AMP8_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA);
  const std::vector<std::pair<const char*, MixedPrecisionOptions>> cases = {
      {"bf16-mixed", recipes::bf16_mixed()},
      {"bf16-mixed grads reduced in bf16", recipes::bf16_mixed().grad_reduce_in_fp32(false)},
      {"16-mixed grads reduced in fp16", recipes::fp16_mixed().fp16_initial_loss_scale(1024).grad_reduce_in_fp32(false)},
  };
  data();
  for (const auto& [name, options] : cases) {
    SCOPED_TRACE(name);
    std::vector<std::vector<torch::Tensor>> masters[2];  // [fused][rank]
    for (const bool fused : {false, true}) {
      std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
      masters[fused].resize(2);
      const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
        auto& model = models[rank];
        model->to(device);
        torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
        auto run_options = options;
        MixedPrecisionPlugin plugin(run_options.fused_optimizer(fused));
        plugin.set_process_group(group, DistributedOptimizerOptions().bucket_size(3000).overlap_grad_reduce(false));
        plugin.connect(*model, optimizer);
        // One step: from the same masters, they differ only by how the step applied the
        // gradients (a second step would also carry FP8 / bf16 rounding flips of the first).
        auto [x, y] = data().batch(0);
        x = x.narrow(0, rank * kGlobalRows / 2, kGlobalRows / 2).to(device);
        y = y.narrow(0, rank * kGlobalRows / 2, kGlobalRows / 2).to(device);
        {
          auto context = plugin.forward_context();
          plugin.backward(torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y));
        }
        const double norm = plugin.clip_gradients(optimizer, 1e-3);
        EXPECT_GT(norm, 1e-3) << "the clipping coefficient is below 1, so it takes part";
        EXPECT_TRUE(plugin.optimizer_step(optimizer));
        for (const auto& m : plugin.master_params()) masters[fused][rank].push_back(m.detach().cpu());
      }, std::chrono::seconds(20));
      for (const auto& e : errors) ASSERT_EQ(e, "");
    }
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_EQ(masters[1][rank].size(), masters[0][rank].size());
      for (size_t i = 0; i < masters[0][rank].size(); ++i) {
        EXPECT_TRUE(torch::allclose(masters[1][rank][i], masters[0][rank][i], /*rtol=*/1e-5, /*atol=*/1e-6))
            << "rank " << rank << " master " << i << ": largest difference "
            << (masters[1][rank][i] - masters[0][rank][i]).abs().max().item<double>();
      }
    }
  }
}

TEST(DistributedOptimizerTest, BadUseIsAClearError) {
  auto model = testing::make_mlp();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  MixedPrecisionPlugin plugin(recipes::bf16_mixed());
  const auto errors = testing::run_ranks(1, [&](int, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    EXPECT_THROW(
        {
          try {
            plugin.set_process_group(group, DistributedOptimizerOptions().bucket_size(0));
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find("bucket_size must be >= 1"), std::string::npos);
            throw;
          }
        },
        c10::Error);
    plugin.connect(*model, optimizer);
    try {
      plugin.set_process_group(group);
      ADD_FAILURE() << "set_process_group after connect must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("call it before connect"), std::string::npos);
    }
  });
  EXPECT_EQ(errors[0], "");
}

TEST(DistributedOptimizerTest, AccumulationWithoutGradientSyncOffIsAClearError) {
  const auto options = MixedPrecisionOptions("32");
  data();
  std::vector<torch::nn::Sequential> models{initial_model(options), initial_model(options)};
  const auto errors = testing::run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto& model = models[rank];
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    MixedPrecisionPlugin plugin(options);
    plugin.set_process_group(group, DistributedOptimizerOptions().bucket_size(1 << 20));  // one bucket
    plugin.connect(*model, optimizer);
    for (int micro = 0; micro < 2; ++micro) {  // a user loop that forgot set_gradient_sync(false)
      auto [x, y] = data().batch(micro);
      plugin.backward(torch::mse_loss(model->forward(x), y));
    }
  });
  // The plugin names it at the second backward, before any gradient reaches a launched bucket.
  for (const auto& error : errors) {
    EXPECT_NE(error.find("call plugin.set_gradient_sync(false) before every micro-batch's backward but the last"),
              std::string::npos) << error;
  }
}

}  // namespace
}  // namespace amp8

namespace amp8 {
namespace {

using testing::error_of;

// Launched by torchrun on a machine with 2+ GPUs (tools/gpu_check.sh with AMP8_GPT_DP):
//   torchrun --standalone --nproc-per-node=2 --no-python distributed_optimizer_test
//       --gtest_filter='DistributedNcclTest.*'
// Elsewhere (no WORLD_SIZE) it skips.
TEST(DistributedNcclTest, MatchesSingleRankTrainingOverProcessGroupNccl_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto env = DistributedEnvironment::from_env();
  if (!env || env->world_size < 2) GTEST_SKIP() << "needs a torchrun launch with 2+ processes";
  ASSERT_EQ(kGlobalRows % env->world_size, 0);
  auto group = init_process_group(*env, std::chrono::seconds(120));
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(env->local_rank));
  data();
  // The CPU test's bounds; fp32 with TF32 off.
  for (const auto& c : fp32_bf16_fp8_cases()) {
    SCOPED_TRACE(c.name);
    const auto reference = train(c.options, 8, {}, initial_model(c.options), 1, 0, device);
    const auto run = train(c.options, 8, group, initial_model(c.options), 1, 0, device);
    EXPECT_LT(max_rel_loss_diff(run.losses, reference.losses), c.loss_bound);
    EXPECT_LT(run.losses.back(), 0.8 * run.losses.front()) << "it learns";
    // Every rank holds the same model: the elementwise max over ranks equals the min.
    std::vector<torch::Tensor> flat;
    for (const auto& p : run.params) flat.push_back(p.reshape(-1));
    auto high = torch::cat(flat).to(device), low = high.clone();
    std::vector<torch::Tensor> h{high}, l{low};
    group->allreduce(h, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
    group->allreduce(l, c10d::AllreduceOptions{c10d::ReduceOp::MIN})->wait();
    EXPECT_TRUE(h[0].equal(l[0])) << "the ranks' models differ";
    // Every step's communication was timed: the whole float32 gradient buffer reduce-scattered
    // (grad_reduce_in_fp32), the parameter buffer gathered (float32 params under "32").
    ASSERT_EQ(run.communication.size(), 8u);
    for (const auto& step : run.communication) {
      EXPECT_GE(step.reduce_ms, 0.0);
      EXPECT_GT(step.gather_ms, 0.0);
      EXPECT_EQ(step.reduce_bytes, run.padded_numel * 4);
      if (std::string(c.name) == "32") {
        EXPECT_EQ(step.gather_bytes, run.padded_numel * 4);
      }
    }
  }
  group->shutdown();
}

// The Bazel build once compiled distributed.cc without LibTorch's USE_C10D_NCCL (CMake takes it
// from torch's targets), so its gpt_pretrain had no NCCL under torchrun. NCCL must be there
// whenever amp8 has CUDA and the LibTorch it runs on ships NCCL (libnccl loaded with
// libtorch_cuda).
TEST(DistributedEnvironmentTest, NcclIsAvailableWheneverLibTorchHasIt) {
#ifdef AMP8_WITH_CUDA
  const bool libtorch_has_nccl = dlsym(RTLD_DEFAULT, "ncclGetVersion") != nullptr;
#else
  const bool libtorch_has_nccl = false;  // amp8 without its CUDA kernels has no NCCL path
#endif
  EXPECT_EQ(nccl_available(), libtorch_has_nccl)
      << "amp8 and LibTorch disagree on NCCL: the build lost LibTorch's USE_C10D_NCCL";
}

TEST(DistributedEnvironmentTest, ReadsTorchrunVariablesAndNamesABadOne) {
  const auto env = DistributedEnvironment::from_values("1", "2", "1", "10.0.0.7", "29500");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.7");
  EXPECT_EQ(env.master_port, 29500);
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"2", "2", "0", "h", "1"}, "RANK must be an integer in [0, 1], got \"2\""},
      {{"x", "2", "0", "h", "1"}, "RANK must be an integer in [0, 1], got \"x\""},
      {{"0", "0", "0", "h", "1"}, "WORLD_SIZE must be an integer in [1, "},
      {{"0", "2", "-1", "h", "1"}, "LOCAL_RANK must be an integer in [0, 1], got \"-1\""},
      {{"0", "2", "0", "", "1"}, "MASTER_ADDR must be a host name or address"},
      {{"0", "2", "0", "h", "70000"}, "MASTER_PORT must be an integer in [1, 65535], got \"70000\""},
      {{"0", "2", "0", "h", "29500x"}, "MASTER_PORT must be an integer in [1, 65535], got \"29500x\""},
  };
  for (const auto& [values, message] : bad) {
    const auto error = error_of([&] {
      DistributedEnvironment::from_values(values[0], values[1], values[2], values[3], values[4]);
    });
    EXPECT_NE(error.find(message), std::string::npos) << "expected \"" << message << "\" in: " << error;
  }
}

// A TCP port nobody listens on (the kernel's pick for a socket that is then closed).
int unused_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

// The rendezvous over c10d's real TCPStore (what init_process_group uses before NCCL): rank 0
// waits for the others; a rank that never comes, or a server that never starts, is an error
// naming the rank and the address within the timeout, not a hang.
TEST(DistributedEnvironmentTest, RendezvousTimesOutNamingTheMissingRank) {
  using clock = std::chrono::steady_clock;
  const std::chrono::milliseconds timeout(1500);
  for (const char* rank : {"0", "1"}) {
    SCOPED_TRACE(std::string("rank ") + rank);
    const int port = unused_port();
    const auto env = DistributedEnvironment::from_values(rank, "2", rank, "127.0.0.1", std::to_string(port));
    const auto start = clock::now();
    const auto error = error_of([&] { rendezvous(env, timeout); });
    const double seconds = std::chrono::duration<double>(clock::now() - start).count();
    EXPECT_NE(error.find(std::string("init_process_group: rank ") + rank + " of 2: the rendezvous at "
                         "127.0.0.1:" + std::to_string(port) + " failed (timeout 1500 ms"),
              std::string::npos) << error;
    EXPECT_LT(seconds, 30.0) << "bounded by the timeout, not a hang";
  }
  // Both ranks present: each gets a store, and a key one sets the other reads.
  const int port = unused_port();
  std::vector<c10::intrusive_ptr<c10d::Store>> stores(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      errors[r] = error_of([&] {
        stores[r] = rendezvous(DistributedEnvironment::from_values(std::to_string(r), "2", std::to_string(r),
                                                                   "127.0.0.1", std::to_string(port)),
                               std::chrono::seconds(30));
      });
    });
  }
  for (auto& t : ranks) t.join();
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  stores[1]->set("hello", std::vector<uint8_t>{4, 2});
  EXPECT_EQ(stores[0]->get("hello"), (std::vector<uint8_t>{4, 2}));
}

// Two "nodes" on one machine: two torchrun agents (--nnodes=2, one process each) meeting
// through the c10d rendezvous, as on a cluster (docs/guide.md, "Several nodes"). Each agent runs
// this binary's UnderTwoTorchrunAgentsEachRankMeetsTheOther. What a multi-node launch gives a
// process and a single-node one does not: its LOCAL_RANK (0 on both nodes) differs from its
// RANK, which the rendezvous hands out in the order the agents arrive (--node-rank is not
// used by the c10d backend), and the store is the agents' (TORCHELASTIC_USE_AGENT_STORE).
TEST(DistributedEnvironmentTest, TwoTorchrunAgentsMeetLikeTwoNodes) {
  if (std::system("command -v torchrun >/dev/null 2>&1") != 0) GTEST_SKIP() << "torchrun is not on PATH";
  const auto dir = testing::scratch_path("DistributedEnvironmentTest", "two_nodes");
  std::filesystem::create_directories(dir);
  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  const int port = unused_port();
  // The children run one test each, whole: no sharding, no XML report of their own.
  std::ostringstream command;
  command << "cd '" << dir.string() << "' && for node in 0 1; do "
          << "env -u GTEST_SHARD_INDEX -u GTEST_TOTAL_SHARDS -u TEST_SHARD_INDEX -u TEST_TOTAL_SHARDS "
          << "-u GTEST_SHARD_STATUS_FILE -u XML_OUTPUT_FILE -u GTEST_OUTPUT AMP8_TWO_NODE_DIR='" << dir.string()
          << "' timeout 180 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:"
          << port << " --rdzv-id=amp8_two_nodes --node-rank=$node --no-python '" << self
          << "' --gtest_filter=DistributedEnvironmentTest.UnderTwoTorchrunAgentsEachRankMeetsTheOther"
          << " > agent$node.log 2>&1 & agents=\"$agents $!\"; done; s=0; for agent in $agents; do wait $agent || s=1; done; exit $s";
  const int status = std::system(command.str().c_str());
  auto text_of = [&](const std::string& name) {
    std::ifstream in(dir / name);
    std::stringstream contents;
    contents << in.rdbuf();
    return contents.str();
  };
  EXPECT_EQ(status, 0) << "agent 0:\n" << text_of("agent0.log") << "\nagent 1:\n" << text_of("agent1.log");
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(text_of("rank" + std::to_string(rank) + ".txt"),
              "rank " + std::to_string(rank) + " of 2, local_rank 0, agent store, met rank " +
                  std::to_string(1 - rank) + " (local_rank 0)\n")
        << text_of("agent0.log") << text_of("agent1.log");
  }
  testing::remove_tree(dir.parent_path().string());
}

// One rank of TwoTorchrunAgentsMeetLikeTwoNodes: reads torchrun's variables, meets the other
// rank in the store and writes what it saw to AMP8_TWO_NODE_DIR/rank<r>.txt. Skips elsewhere.
TEST(DistributedEnvironmentTest, UnderTwoTorchrunAgentsEachRankMeetsTheOther) {
  const char* out = std::getenv("AMP8_TWO_NODE_DIR");
  if (out == nullptr) GTEST_SKIP() << "run by TwoTorchrunAgentsMeetLikeTwoNodes";
  const auto env = DistributedEnvironment::from_env();
  ASSERT_TRUE(env.has_value()) << "WORLD_SIZE is not set";
  ASSERT_EQ(env->world_size, 2);
  auto store = rendezvous(*env, std::chrono::seconds(60));
  const std::string mine = "local_rank_of_" + std::to_string(env->rank);
  const std::string theirs = "local_rank_of_" + std::to_string(1 - env->rank);
  store->set(mine, std::vector<uint8_t>{static_cast<uint8_t>(env->local_rank)});
  store->wait({theirs}, std::chrono::seconds(60));
  const auto other_local_rank = store->get(theirs);
  ASSERT_EQ(other_local_rank.size(), 1u);
  std::ofstream(std::filesystem::path(out) / ("rank" + std::to_string(env->rank) + ".txt"))
      << "rank " << env->rank << " of " << env->world_size << ", local_rank " << env->local_rank << ", "
      << (env->use_agent_store ? "agent store" : "own store") << ", met rank " << 1 - env->rank
      << " (local_rank " << int{other_local_rank[0]} << ")\n";
  // Neither rank leaves (and its agent closes the store) before both have read.
  store->set("done_" + std::to_string(env->rank), std::vector<uint8_t>{1});
  store->wait({"done_0", "done_1"}, std::chrono::seconds(60));
}

TEST(DistributedEnvironmentTest, AbsentWithoutTorchrunAndAMissingVariableIsNamed) {
  ::unsetenv("WORLD_SIZE");
  EXPECT_FALSE(DistributedEnvironment::from_env().has_value());
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "0", 1);
  ::unsetenv("LOCAL_RANK");
  const auto error = error_of([] { DistributedEnvironment::from_env(); });
  EXPECT_NE(error.find("LOCAL_RANK is not set"), std::string::npos) << error;
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
}

}  // namespace
}  // namespace amp8
