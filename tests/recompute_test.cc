// Activation recomputation (plugin/modules/recompute.h): a recomputed forward pass keeps only its
// input, and training with it is training without it, value for value, in every precision: the
// second run draws the same dropout masks, runs under the same autocast and FP8 region, and
// quantizes with the scales the first run used, recording no amax of its own.

#include "plugin/modules/recompute.h"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define AMP8_HAS_CUDA_ALLOCATOR 1
#endif
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "plugin/fp8/fp8_autocast.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/precision/autocast_guard.h"
#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/trainer.h"
#include "recipes/gpt/gpt_model.h"
#include "recipes/llama/llama_model.h"
#include "recipes/precision.h"
#include "tests/in_process_group.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::ExpectErrorContaining;

class RecomputeTest : public testing::SeededTest {};

// Linear → GELU → dropout → Linear, counting its calls.
struct SmallNet {
  torch::nn::Linear first{torch::nn::LinearOptions(24, 40)},
      second{torch::nn::LinearOptions(40, 24)};
  int calls = 0;
  torch::Tensor operator()(const torch::Tensor& x) {
    ++calls;
    auto h = torch::dropout(torch::gelu(first->forward(x)), 0.3, /*train=*/true);
    return second->forward(h);
  }
  std::vector<torch::Tensor> grads() const {
    std::vector<torch::Tensor> all;
    for (const auto& module : {first.ptr(), second.ptr()}) {
      for (const auto& p : module->parameters()) all.push_back(p.grad().clone());
    }
    return all;
  }
  void zero_grad() {
    first->zero_grad();
    second->zero_grad();
  }
};

// The gradients of x and of net's parameters from y = net(x), computed as `forward` says
// (`recompute`: through recompute_activations), seeded alike, then y.backward(grad_output); for
// recompute false then true.
std::vector<std::vector<torch::Tensor>> gradients_kept_and_recomputed(
    SmallNet& net, const torch::Tensor& x, const torch::Tensor& grad_output,
    const std::function<torch::Tensor(bool recompute)>& forward) {
  std::vector<std::vector<torch::Tensor>> grads;
  for (const bool recompute : {false, true}) {
    torch::manual_seed(8);
    forward(recompute).backward(grad_output);
    grads.push_back(net.grads());
    grads.back().push_back(x.grad().clone());
    net.zero_grad();
    x.mutable_grad().reset();
  }
  return grads;
}

// The same gradients, bit for bit, from the kept activations and from the recomputed ones:
// the dropout masks of the second run are the first run's. The function runs twice.
TEST_F(RecomputeTest, GradientsAreTheKeptActivationsGradients) {
  SmallNet net;
  const auto x = torch::randn({7, 5, 24}).requires_grad_(true);
  const auto grad_output = torch::randn({7, 5, 24});

  const auto seed = 4242;
  torch::manual_seed(seed);
  const auto kept = net(x);
  kept.backward(grad_output);
  const auto kept_grads = net.grads();
  const auto kept_input_grad = x.grad().clone();
  net.zero_grad();
  x.mutable_grad().reset();

  torch::manual_seed(seed);
  net.calls = 0;
  const auto recomputed =
      recompute_activations([&](const torch::Tensor& input) { return net(input); }, x);
  EXPECT_EQ(net.calls, 1);
  torch::randn({100});  // the generator moves on before the backward pass, as training's does
  recomputed.backward(grad_output);
  EXPECT_EQ(net.calls, 2) << "the backward pass ran the function again";
  EXPECT_TRUE(recomputed.equal(kept));
  EXPECT_TRUE(x.grad().equal(kept_input_grad));
  const auto grads = net.grads();
  ASSERT_EQ(grads.size(), kept_grads.size());
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_TRUE(grads[i].equal(kept_grads[i])) << "parameter " << i;
}

// The second run is under the first run's autocast (here bf16 on the CPU, closed before the
// backward pass, as a training step closes it): the same bf16 GEMMs, the same gradients.
TEST_F(RecomputeTest, AutocastIsReplayed) {
  SmallNet net;
  const auto x = torch::randn({9, 24}).requires_grad_(true);
  const auto grad_output = torch::randn({9, 24}).to(at::kBFloat16);
  const auto grads = gradients_kept_and_recomputed(net, x, grad_output, [&](bool recompute) {
    torch::Tensor y;
    {
      AutocastGuard autocast(at::kBFloat16, {c10::DeviceType::CPU});
      y = recompute
              ? recompute_activations([&](const torch::Tensor& input) { return net(input); }, x)
              : net(x);
    }
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    return y;
  });
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_TRUE(grads[1][i].equal(grads[0][i])) << "gradient " << i;
}

// A function that opens its own FP8 region (delayed scaling): its end updates the scales after
// the first run, so the second run must quantize with the scales from before that update, and
// its own end must not update them (nor roll the histories) a second time. Three steps, the same
// outputs, gradients and FP8 metadata as without recomputation.
TEST_F(RecomputeTest, AFunctionsOwnFp8RegionIsReplayedWithoutAnUpdate) {
  std::vector<Fp8Linear> linears;
  for (int k = 0; k < 2; ++k) {
    torch::manual_seed(21);
    linears.push_back(
        Fp8Linear(Fp8LinearOptions(32, 48).fp8_min_gemm_size(0).fp8_amax_history_len(3)));
  }
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto x = (torch::randn({19, 32}) * (1 + step)).requires_grad_(true);
    const auto grad_output = torch::randn({19, 48});
    std::vector<torch::Tensor> outputs, input_grads;
    for (int k = 0; k < 2; ++k) {
      auto function = [linear = linears[k]](const torch::Tensor& input) mutable {
        Fp8Autocast fp8;
        auto y = linear->forward(input);
        fp8.close();
        return y;
      };
      const auto y = k == 0 ? function(x) : recompute_activations(function, x);
      y.backward(grad_output);
      outputs.push_back(y.detach());
      input_grads.push_back(x.grad().clone());
      x.mutable_grad().reset();
    }
    EXPECT_TRUE(outputs[1].equal(outputs[0]));
    EXPECT_TRUE(input_grads[1].equal(input_grads[0]));
    EXPECT_TRUE(linears[1]->weight.grad().equal(linears[0]->weight.grad()));
    const auto kept = linears[0]->named_buffers();
    for (const auto& buffer : linears[1]->named_buffers()) {
      EXPECT_TRUE(buffer.value().equal(kept[buffer.key()])) << buffer.key();
    }
    for (auto& linear : linears) linear->zero_grad();
  }
}

// Gradients reach the parameters through .backward(); autograd::grad, which reads only what it
// returns, and a double backward are refused instead of silently missing the recomputed part.
TEST_F(RecomputeTest, OnlyBackwardReachesTheParameters) {
  SmallNet net;
  const auto x = torch::randn({4, 24}).requires_grad_(true);
  auto run = [&] {
    return recompute_activations([&](const torch::Tensor& input) { return net(input); }, x).sum();
  };
  ExpectErrorContaining([&] { torch::autograd::grad({run()}, {x}); },
                        "its gradients reach the parameters only through .backward()");
  ExpectErrorContaining([&] { run().backward({}, /*retain_graph=*/true, /*create_graph=*/true); },
                        "no double backward");
}

// What the autograd graph holds of a recomputed forward pass: one node, no node of its insides.
TEST_F(RecomputeTest, TheGraphKeepsOnlyTheInput) {
  SmallNet net;
  const auto x = torch::randn({3, 24}).requires_grad_(true);
  const auto y = recompute_activations([&](const torch::Tensor& input) { return net(input); }, x);
  std::vector<std::string> names;
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{y.grad_fn().get()};
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    names.push_back(node->name());
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
  ASSERT_FALSE(names.empty());
  EXPECT_NE(names.front().find("RecomputeFunction"), std::string::npos) << names.front();
  for (const auto& name : names) {
    EXPECT_EQ(name.find("Gelu"), std::string::npos) << name;
    EXPECT_EQ(name.find("Addmm"), std::string::npos) << name;
  }
}

// An input that needs no gradient (a frozen embedding's output) still gives the parameters
// inside theirs.
TEST_F(RecomputeTest, ParametersGetGradientsWhenTheInputNeedsNone) {
  SmallNet net;
  const auto x = torch::randn({6, 24});
  torch::manual_seed(7);
  net(x).sum().backward();
  const auto kept_grads = net.grads();
  net.zero_grad();
  torch::manual_seed(7);
  recompute_activations([&](const torch::Tensor& input) { return net(input); }, x).sum().backward();
  const auto grads = net.grads();
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_TRUE(grads[i].equal(kept_grads[i])) << "parameter " << i;
}

// Without grad mode (evaluation) nothing is kept for a backward pass: the function runs once.
TEST_F(RecomputeTest, WithoutGradModeItIsTheFunction) {
  SmallNet net;
  const auto x = torch::randn({4, 24});
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  const auto direct = net(x);
  torch::manual_seed(3);
  const auto y = recompute_activations([&](const torch::Tensor& input) { return net(input); }, x);
  EXPECT_EQ(net.calls, 2);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(y.equal(direct));
}

TEST_F(RecomputeTest, BadSettingsAreNamed) {
  ExpectErrorContaining(
      [] { recompute_method_from_string("full"); },
      "recompute method must be \"none\", \"uniform\" or \"block\", got \"full\"");
  const auto uniform = RecomputeOptions().method(RecomputeMethod::kUniform);
  ExpectErrorContaining(
      [&] {
        recipes::GptModel(
            recipes::GptConfig().layers(2).recompute(RecomputeOptions(uniform).num_layers(0)));
      },
      "recompute num_layers must be in [1, 2] (the model's layers) with recompute method "
      "\"uniform\", got 0");
  ExpectErrorContaining(
      [&] {
        recipes::LlamaModel(recipes::LlamaConfig().layers(3).recompute(
            RecomputeOptions().method(RecomputeMethod::kBlock).num_layers(4)));
      },
      "recompute num_layers must be in [1, 3] (the model's layers) with recompute method "
      "\"block\", got 4");
  // Without a method, num_layers would not be read: an error (it was accepted and dropped).
  ExpectErrorContaining(
      [] { recipes::GptModel(recipes::GptConfig().layers(2).recompute(RecomputeOptions().num_layers(9))); },
      "recompute num_layers (9) applies with recompute method \"uniform\" or \"block\"; the method is \"none\"");
  ExpectErrorContaining([] { recompute_activations({}, torch::ones({1})); },
                        "function must not be empty");
}

// forward_layers runs the layers in order and recomputes the ones the method names.
TEST_F(RecomputeTest, MethodsChooseTheRecomputedLayers) {
  for (const auto& [method, num_layers, expected] :
       std::vector<std::tuple<RecomputeMethod, int64_t, std::vector<int>>>{
           {RecomputeMethod::kNone, 1, {1, 1, 1, 1, 1}},
           {RecomputeMethod::kUniform, 1, {2, 2, 2, 2, 2}},
           {RecomputeMethod::kUniform, 2, {2, 2, 2, 2, 2}},
           {RecomputeMethod::kBlock, 2, {2, 2, 1, 1, 1}},
           {RecomputeMethod::kBlock, 5, {2, 2, 2, 2, 2}}}) {
    SCOPED_TRACE(std::string(to_string(method)) + " " + std::to_string(num_layers));
    std::vector<int> calls(5, 0);
    std::vector<torch::Tensor> weights;
    for (int i = 0; i < 5; ++i) weights.push_back(torch::randn({8, 8}).requires_grad_(true));
    const auto x = torch::randn({3, 8}).requires_grad_(true);
    auto y = forward_layers(
        5, RecomputeOptions().method(method).num_layers(num_layers),
        [&](int64_t i, const torch::Tensor& input) {
          ++calls[i];
          return torch::tanh(input.matmul(weights[i])) + input;
        },
        x);
    auto expected_y = x;
    for (int i = 0; i < 5; ++i)
      expected_y = torch::tanh(expected_y.matmul(weights[i])) + expected_y;
    EXPECT_TRUE(y.equal(expected_y.detach()));
    const auto expected_grads = torch::autograd::grad({expected_y.sum()}, weights);
    y.sum().backward();
    EXPECT_EQ(calls, expected);
    for (int i = 0; i < 5; ++i)
      EXPECT_TRUE(weights[i].grad().equal(expected_grads[i])) << "layer " << i;
  }
}

// ---- the recipes' models, trained through the Trainer and the precision plugin ----

struct Trained {
  std::vector<double> losses;
  std::vector<std::pair<std::string, torch::Tensor>> state;  // parameters and buffers
};

template <typename Model>
Trained train(const std::function<Model()>& make_model, int64_t vocab,
              const MixedPrecisionOptions& options, const torch::Device& device,
              int64_t steps = 3) {
  torch::manual_seed(11);
  std::optional<Fp8ModelInit> init;
  if (options.fp8_params()) init.emplace();
  Model model = make_model();
  init.reset();
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  Trainer trainer(TrainerOptions()
                      .max_steps(steps)
                      .log_every_n_steps(0)
                      .accumulate_grad_batches(2)
                      .gradient_clip_val(1.0),
                  std::make_shared<MixedPrecisionPlugin>(options));
  trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
    auto gen = testing::batch_generator(5, in.step, in.micro_batch);
    const auto tokens = torch::randint(vocab, {2, 33}, gen).to(device);
    const auto logits = in.precision.convert_output(model->forward(tokens.narrow(1, 0, 32)));
    return torch::cross_entropy_loss(logits.reshape({-1, vocab}).to(at::kFloat),
                                     tokens.narrow(1, 1, 32).reshape(-1));
  });
  Trained trained;
  for (const auto& m : trainer.history()) trained.losses.push_back(m.loss);
  for (const auto& p : model->named_parameters())
    trained.state.emplace_back(p.key(), p.value().detach().cpu().clone());
  for (const auto& b : model->named_buffers())
    trained.state.emplace_back(b.key(), b.value().detach().cpu().clone());
  return trained;
}

void expect_identical(const Trained& recomputed, const Trained& kept, const std::string& what) {
  ASSERT_EQ(recomputed.losses.size(), kept.losses.size()) << what;
  for (size_t i = 0; i < kept.losses.size(); ++i)
    EXPECT_EQ(recomputed.losses[i], kept.losses[i]) << what << ", step " << i + 1;
  ASSERT_EQ(recomputed.state.size(), kept.state.size()) << what;
  for (size_t i = 0; i < kept.state.size(); ++i) {
    EXPECT_TRUE(testing::BytesEqual(recomputed.state[i].second, kept.state[i].second))
        << what << ": " << kept.state[i].first;
  }
}

std::vector<std::pair<std::string, MixedPrecisionOptions>> every_precision() {
  return {
      {"32", MixedPrecisionOptions("32")},
      {"bf16-mixed", recipes::bf16_mixed()},
      {"FP8 delayed, fp8_params",
       recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_amax_history_len(4)},
      {"FP8 delayed, bf16 params",
       recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0)},
      {"FP8 tensorwise",
       recipes::bf16_with_fp8_current_scaling_mixed().fp8_params(false).fp8_min_gemm_size(0)},
      {"FP8 blockwise", recipes::bf16_with_fp8_subchannel_scaling_mixed().fp8_min_gemm_size(0)},
  };
}

std::vector<RecomputeOptions> every_method() {
  return {RecomputeOptions().method(RecomputeMethod::kUniform).num_layers(1),
          RecomputeOptions().method(RecomputeMethod::kUniform).num_layers(2),
          RecomputeOptions().method(RecomputeMethod::kBlock).num_layers(2)};
}

// A GPT with dropout (the second run must draw the first run's masks), every precision and
// method: losses, parameters and FP8 metadata (scales, amax histories) bit for bit those of the
// run that keeps its activations.
TEST_F(RecomputeTest, GptTrainsAsWithoutRecompute) {
  const auto config =
      recipes::GptConfig().layers(3).hidden(64).heads(4).dropout(0.1).max_seq_len(32);
  for (const auto& [name, precision] : every_precision()) {
    const auto kept = train<recipes::GptModel>([&] { return recipes::GptModel(config); },
                                               config.vocab_size(), precision, torch::kCPU);
    for (const auto& recompute : every_method()) {
      const auto recomputed = train<recipes::GptModel>(
          [&] { return recipes::GptModel(recipes::GptConfig(config).recompute(recompute)); },
          config.vocab_size(), precision, torch::kCPU);
      expect_identical(recomputed, kept,
                       name + ", " + to_string(recompute.method()) + " " +
                           std::to_string(recompute.num_layers()));
    }
  }
}

TEST_F(RecomputeTest, LlamaTrainsAsWithoutRecompute) {
  const auto config = recipes::LlamaConfig().layers(3).vocab_size(64).max_seq_len(32);
  for (const auto& [name, precision] : every_precision()) {
    const auto kept = train<recipes::LlamaModel>([&] { return recipes::LlamaModel(config); },
                                                 config.vocab_size(), precision, torch::kCPU);
    const auto recompute = RecomputeOptions().method(RecomputeMethod::kUniform).num_layers(1);
    const auto recomputed = train<recipes::LlamaModel>(
        [&] { return recipes::LlamaModel(recipes::LlamaConfig(config).recompute(recompute)); },
        config.vocab_size(), precision, torch::kCPU);
    expect_identical(recomputed, kept, name);
  }
}

// Data-parallel (the DistributedOptimizer's buckets, two ranks in one process, small buckets so
// that each block's gradients are reduced while the backward pass runs; with and without
// overlap_param_gather): the gradients arrive from the recomputed blocks' own backward passes,
// and training is the same as without.
TEST_F(RecomputeTest, DataParallelTrainsAsWithoutRecompute) {
  constexpr int kRanks = 2;
  const auto config = recipes::GptConfig().layers(3).max_seq_len(32);
  auto train_ranks = [&](const MixedPrecisionOptions& options, const RecomputeOptions& recompute,
                         bool overlap_param_gather) {
    std::vector<recipes::GptModel> models;
    for (int r = 0; r < kRanks; ++r) {
      torch::manual_seed(3 + r);
      std::optional<Fp8ModelInit> init;
      if (options.fp8_params()) init.emplace();
      models.push_back(recipes::GptModel(recipes::GptConfig(config).recompute(recompute)));
    }
    std::vector<std::vector<torch::Tensor>> params(kRanks);
    const auto errors =
        testing::run_ranks(kRanks, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
          auto& model = models[rank];
          torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
          // With overlap_param_gather, an all-gather runs only when waited for: a block that
          // computed before its wait (in either run of a recomputed block) would differ.
          if (overlap_param_gather) testing::defer_allgathers(*group);
          auto plugin = std::make_shared<MixedPrecisionPlugin>(options);
          plugin->set_process_group(
              group, DistributedOptimizerOptions().bucket_size(20'000).overlap_param_gather(
                         overlap_param_gather));
          Trainer trainer(TrainerOptions().max_steps(3).log_every_n_steps(0), plugin);
          trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
            auto gen = testing::batch_generator(13, in.step, 0);
            const auto tokens = torch::randint(256, {2 * kRanks, 33}, gen).narrow(0, 2 * rank, 2);
            const auto logits =
                in.precision.convert_output(model->forward(tokens.narrow(1, 0, 32)));
            return torch::cross_entropy_loss(logits.reshape({-1, 256}).to(at::kFloat),
                                             tokens.narrow(1, 1, 32).reshape(-1));
          });
          for (const auto& p : model->parameters())
            params[rank].push_back(p.detach().to(at::kFloat).clone());
          for (const auto& b : model->buffers()) params[rank].push_back(b.detach().clone());
        });
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
    return params;
  };
  for (const auto& [name, options] : std::vector<std::pair<std::string, MixedPrecisionOptions>>{
           {"bf16-mixed", recipes::bf16_mixed()},
           {"FP8 delayed, fp8_params", recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0)}}) {
    const auto kept = train_ranks(options, {}, false);
    for (const bool overlap : {false, true}) {
      const auto recomputed =
          train_ranks(options, RecomputeOptions().method(RecomputeMethod::kUniform), overlap);
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_EQ(recomputed[r].size(), kept[r].size()) << name;
        ASSERT_FALSE(kept[r].empty()) << name;
        for (size_t i = 0; i < kept[r].size(); ++i) {
          EXPECT_TRUE(testing::BytesEqual(recomputed[r][i], kept[r][i]))
              << name << (overlap ? ", overlap_param_gather" : "") << ": rank " << r << ", tensor "
              << i;
        }
      }
    }
  }
}

// PyTorch's deterministic settings for the life of the guard (use_deterministic_algorithms), the
// previous ones back after it, so that the other tests of the binary run as they would alone.
class DeterministicAlgorithms {
 public:
  DeterministicAlgorithms()
      : algorithms_(context().deterministicAlgorithms()),
        warn_only_(context().deterministicAlgorithmsWarnOnly()),
        cudnn_(context().deterministicCuDNN()),
        benchmark_(context().benchmarkCuDNN()) {
    use_deterministic_algorithms();
  }
  ~DeterministicAlgorithms() {
    context().setDeterministicAlgorithms(algorithms_, warn_only_);
    context().setDeterministicCuDNN(cudnn_);
    context().setBenchmarkCuDNN(benchmark_);
  }

 private:
  static at::Context& context() { return at::globalContext(); }
  bool algorithms_, warn_only_, cudnn_, benchmark_;
};

// The CUDA generator's state is replayed on the autograd engine's device thread: dropout on the
// GPU draws the same mask twice.
TEST_F(RecomputeTest, GradientsAreTheKeptActivationsGradients_CUDA) {
  if (!testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  SmallNet net;
  net.first->to(torch::kCUDA);
  net.second->to(torch::kCUDA);
  const auto x = torch::randn({33, 24}, torch::kCUDA).requires_grad_(true);
  const auto grad_output = torch::randn({33, 24}, torch::kCUDA);
  const auto grads = gradients_kept_and_recomputed(net, x, grad_output, [&](bool recompute) {
    auto y = recompute
                 ? recompute_activations([&](const torch::Tensor& input) { return net(input); }, x)
                 : net(x);
    torch::randn({1000}, torch::kCUDA);  // the generator moves on before the backward pass
    return y;
  });
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_TRUE(grads[1][i].equal(grads[0][i])) << "gradient " << i;
}

// On a GPU, with deterministic algorithms (the same kernels give the same bits), the same
// training in bf16-mixed and FP8; and a step's peak memory falls: the blocks' activations are not
// kept (float32, hidden 512, 8 blocks, 8 × 512 tokens: ~120 MB of activations per block against
// 8 MB of its input).
TEST_F(RecomputeTest, GptTrainsAsWithoutRecompute_CUDA) {
  if (!testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  DeterministicAlgorithms deterministic;
  const auto config = recipes::GptConfig().layers(3).hidden(128).heads(4).max_seq_len(32);
  for (const auto& [name, precision] : std::vector<std::pair<std::string, MixedPrecisionOptions>>{
           {"bf16-mixed", recipes::bf16_mixed()},
           {"FP8 delayed, fp8_params",
            recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_amax_history_len(4)}}) {
    const auto kept = train<recipes::GptModel>([&] { return recipes::GptModel(config); },
                                               config.vocab_size(), precision, torch::kCUDA);
    const auto recomputed = train<recipes::GptModel>(
        [&] {
          return recipes::GptModel(recipes::GptConfig(config).recompute(
              RecomputeOptions().method(RecomputeMethod::kUniform)));
        },
        config.vocab_size(), precision, torch::kCUDA);
    expect_identical(recomputed, kept, name);
  }

#ifdef AMP8_HAS_CUDA_ALLOCATOR
  auto peak_step_bytes = [](RecomputeMethod method) {
    torch::manual_seed(2);
    recipes::GptModel model(
        recipes::GptConfig().layers(8).hidden(512).heads(8).max_seq_len(512).recompute(
            RecomputeOptions().method(method)));
    model->to(torch::kCUDA);
    const auto tokens = torch::randint(256, {8, 512}, torch::dtype(torch::kLong).device(torch::kCUDA));
    torch::cuda::synchronize();
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    const auto before =
        c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
    model->forward(tokens).to(at::kFloat).logsumexp(-1).mean().backward();
    torch::cuda::synchronize();
    return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak - before;
  };
  const auto kept_bytes = peak_step_bytes(RecomputeMethod::kNone);
  const auto recomputed_bytes = peak_step_bytes(RecomputeMethod::kUniform);
  EXPECT_LT(recomputed_bytes, kept_bytes / 2)
      << "kept " << kept_bytes << " B, recomputed " << recomputed_bytes << " B";
#endif
}

}  // namespace
}  // namespace amp8
