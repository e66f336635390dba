// CUDA graphs in the Trainer (TrainerOptions::cuda_graph): static gradients (the CPU can check
// them), the split training step run eagerly, runs captured and replayed against the same runs
// eager (bit for bit in bf16; FP8 with its scale updates inside the graph), and the errors.
#include "plugin/training/cuda_graph.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "ops/fp8_gemm.h"
#include "ops/quantize.h"
#include "plugin/training/trainer.h"
#include "recipes/precision.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using testing::ExpectErrorContaining;
using testing::MlpData;

constexpr int64_t kRows = 48;  // not a multiple of the FP8 GEMM tiles

struct Run {
  std::vector<double> losses;
  std::vector<torch::Tensor> params, buffers;
};

// The MLP trained `steps` steps of `micro_batches` micro-batches by a Trainer, the step split
// into batch and loss (cuda_graph as `graphed` says), or not split at all (`split` false).
Run train(const MixedPrecisionOptions& precision, torch::Device device, bool graphed, int64_t steps,
          int64_t micro_batches, bool split = true) {
  torch::manual_seed(5);
  auto model = testing::make_mlp();
  model->to(device);
  MlpData data(11);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.05));
  auto options = TrainerOptions()
                     .max_steps(steps)
                     .accumulate_grad_batches(micro_batches)
                     .gradient_clip_val(1.0)
                     .log_every_n_steps(0);
  if (graphed) options.cuda_graph(true).cuda_graph_warmup_steps(2);
  Trainer trainer(options, precision);
  GraphableStep step;
  step.batch = [&](const TrainStepInput& in) {
    auto [x, y] = data.batch(in.step, in.micro_batch, kRows);
    return std::vector<torch::Tensor>{x.to(device), y.to(device)};
  };
  step.loss = [&](const std::vector<torch::Tensor>& batch, PrecisionPlugin& plugin) {
    return torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(batch[0]))), batch[1]);
  };
  if (split) {
    trainer.fit(*model, optimizer, step);
  } else {
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) { return step.loss(step.batch(in), in.precision); });
  }
  Run run;
  for (const auto& metrics : trainer.history()) run.losses.push_back(metrics.loss);
  for (const auto& param : model->parameters()) run.params.push_back(param.detach().cpu().clone());
  for (const auto& buffer : model->buffers()) run.buffers.push_back(buffer.detach().cpu().clone());
  return run;
}

void expect_identical(const Run& a, const Run& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(BytesEqual(a.params[i], b.params[i])) << "param " << i;
  ASSERT_EQ(a.buffers.size(), b.buffers.size());
  for (size_t i = 0; i < a.buffers.size(); ++i) EXPECT_TRUE(BytesEqual(a.buffers[i], b.buffers[i])) << "buffer " << i;
}

MixedPrecisionOptions fp8_precision() {
  return recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0);  // the MLP's GEMMs are small
}

// ---- static gradients: the same training, every gradient at one address ----

// Steps the MLP by hand through the plugin, with static gradients or not; returns the losses and
// checks that static gradients stay where they are and are zero after each step.
Run train_by_hand(const MixedPrecisionOptions& options, bool static_gradients) {
  torch::manual_seed(5);
  auto model = testing::make_mlp();
  MlpData data(11);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.05));
  MixedPrecisionPlugin plugin(options);
  plugin.connect(*model, optimizer);
  if (static_gradients) plugin.use_static_gradients();
  std::vector<const void*> addresses;
  Run run;
  for (int64_t step = 0; step < 4; ++step) {
    double loss_sum = 0;
    for (int64_t micro = 0; micro < 2; ++micro) {
      plugin.set_gradient_sync(micro == 1);
      auto [x, y] = data.batch(step, micro, kRows);
      torch::Tensor loss;
      {
        auto context = plugin.forward_context();
        loss = torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y);
        context.close();
      }
      plugin.backward(loss / 2.0);
      loss_sum += loss.item<double>();
    }
    if (static_gradients) {
      std::vector<const void*> now;
      for (const auto& param : model->parameters()) {
        if (param.grad().defined()) {
          now.push_back(param.grad().const_data_ptr());
        }
      }
      if (addresses.empty()) addresses = now;
      EXPECT_EQ(now, addresses) << "step " << step << ": a gradient moved";
    }
    plugin.optimizer_step(optimizer);
    if (static_gradients) {
      for (const auto& param : model->parameters()) {
        if (param.grad().defined()) {
          EXPECT_EQ(param.grad().abs().max().item<float>(), 0.0f) << "not zeroed";
        }
      }
    }
    run.losses.push_back(loss_sum / 2);
  }
  for (const auto& param : model->parameters()) run.params.push_back(param.detach().clone());
  return run;
}

TEST(StaticGradientsTest, TrainExactlyAsReleasedOnes) {
  for (const auto& options : {MixedPrecisionOptions("bf16-mixed"), MixedPrecisionOptions("32"),
                              fp8_precision()}) {
    SCOPED_TRACE(MixedPrecisionPlugin(options).name());
    const auto released = train_by_hand(options, false);
    const auto fixed = train_by_hand(options, true);
    expect_identical(released, fixed);
  }
}

TEST(StaticGradientsTest, FixTheAddressesOfEveryGradient) {
  torch::manual_seed(5);
  auto model = testing::make_mlp();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  MixedPrecisionPlugin plugin(fp8_precision());
  plugin.connect(*model, optimizer);
  plugin.use_static_gradients();
  // Before any backward pass: the non-FP8 parameters (the biases; fp8_params stores the weights
  // in FP8, with main_grad bound instead) have zero gradients in place.
  int with_grad = 0;
  for (const auto& param : model->parameters()) {
    if (param.grad().defined()) {
      ++with_grad;
      EXPECT_EQ(param.grad().abs().max().item<float>(), 0.0f);
    }
  }
  EXPECT_EQ(with_grad, 3);  // the three biases
  ExpectErrorContaining([&] { MixedPrecisionPlugin(fp8_precision()).use_static_gradients(); },
                        "not connected");
}

// ---- the split step, eager ----

TEST(CudaGraphTest, SplitStepTrainsAsTheUnsplitOne) {
  for (const auto& options : {MixedPrecisionOptions("bf16-mixed"), fp8_precision()}) {
    SCOPED_TRACE(MixedPrecisionPlugin(options).name());
    expect_identical(train(options, torch::kCPU, false, 4, 2, /*split=*/false),
                     train(options, torch::kCPU, false, 4, 2, /*split=*/true));
  }
}

// ---- errors ----

TEST(CudaGraphTest, WhatCannotBeCapturedIsNamed) {
  ExpectErrorContaining([] { train(MixedPrecisionOptions("bf16-mixed"), torch::kCPU, true, 4, 1, /*split=*/false); },
                        "cuda_graph needs the training step split");
  ExpectErrorContaining([] { train(MixedPrecisionOptions("16-mixed"), torch::kCPU, true, 4, 1); },
                        "precision 16-mixed scales the loss");
  ExpectErrorContaining([] { train(MixedPrecisionOptions("bf16-mixed"), torch::kCPU, true, 4, 1); },
                        "CUDA GPU");
  ExpectErrorContaining(
      [] {
        auto model = testing::make_mlp();
        torch::optim::SGD optimizer(model->parameters(), 0.1);
        Trainer trainer(TrainerOptions().max_steps(1).log_every_n_steps(0).cuda_graph(true));  // the default plugin
        GraphableStep step;
        step.batch = [](const TrainStepInput&) { return std::vector<torch::Tensor>{torch::randn({4, 32})}; };
        step.loss = [&](const std::vector<torch::Tensor>& batch, PrecisionPlugin&) { return model->forward(batch[0]).sum(); };
        trainer.fit(*model, optimizer, step);
      },
      "keeps no gradients at fixed addresses");
  ExpectErrorContaining(
      [] {
        auto model = testing::make_mlp();
        torch::optim::SGD optimizer(model->parameters(), 0.1);
        Trainer trainer(TrainerOptions().cuda_graph(true).cuda_graph_warmup_steps(0));
        trainer.fit(*model, optimizer, GraphableStep{[](const TrainStepInput&) { return std::vector<torch::Tensor>{}; },
                                                     [](const std::vector<torch::Tensor>&, PrecisionPlugin&) { return torch::zeros({}); }});
      },
      "cuda_graph_warmup_steps must be >= 1, got 0");
}

// ---- captured and replayed ----

TEST(CudaGraphTest, ReplaysTrainExactlyAsEagerSteps_CUDA) {
  AMP8_REQUIRE_CUDA();
  for (const int64_t micro_batches : {1, 3}) {
    SCOPED_TRACE(micro_batches);
    const auto eager = train(MixedPrecisionOptions("bf16-mixed"), torch::kCUDA, false, 8, micro_batches);
    const auto graphed = train(MixedPrecisionOptions("bf16-mixed"), torch::kCUDA, true, 8, micro_batches);
    expect_identical(eager, graphed);
  }
}

TEST(CudaGraphTest, Fp8ScaleUpdatesRunInsideTheGraph_CUDA) {
  AMP8_REQUIRE_CUDA();
  const auto eager = train(fp8_precision(), torch::kCUDA, false, 10, 2);
  const auto graphed = train(fp8_precision(), torch::kCUDA, true, 10, 2);
  ASSERT_EQ(eager.losses.size(), graphed.losses.size());
  // The weight-gradient GEMMs accumulate into zeroed main_grads where the eager run writes fresh
  // ones (cuBLASLt may pick another kernel for beta = 1): close, not bit for bit.
  for (size_t i = 0; i < eager.losses.size(); ++i) {
    EXPECT_NEAR(graphed.losses[i], eager.losses[i], 2e-3 * std::abs(eager.losses[i])) << "step " << i + 1;
  }
  // The amax histories: one row per forward / backward pass, rolled by the scale updates.
  // Updates left out of the graph would leave the replayed steps' rows empty.
  int histories = 0;
  for (size_t i = 0; i < eager.buffers.size(); ++i) {
    if (eager.buffers[i].dim() != 2 || eager.buffers[i].size(0) < 16) continue;
    ++histories;
    const auto rows = eager.buffers[i].narrow(0, 0, 20 * 2 + 2);  // every pass of the run, and two empty rows
    EXPECT_TRUE(torch::allclose(graphed.buffers[i].narrow(0, 0, rows.size(0)), rows, 0.05, 0))
        << "amax history " << i << "\neager:\n" << rows << "\ngraphed:\n" << graphed.buffers[i].narrow(0, 0, rows.size(0));
  }
  EXPECT_EQ(histories, 6);  // forward and backward of three layers
}

// The FP8 GEMMs' measured algorithm choice times nothing inside a capture (its events and
// synchronization would break it): a configuration first seen there takes the heuristic's
// algorithm, and the replays compute the GEMM on new operands.
TEST(CudaGraphTest, AnFp8GemmFirstSeenInACaptureIsNotTimed_CUDA) {
  AMP8_REQUIRE_CUDA();
  torch::manual_seed(3);
  const Fp8GemmAlgoSelectionGuard measured(Fp8GemmAlgoSelection::kFastestMeasured);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto operands = [&](int64_t n) {
    const auto a = quantize_current_scaling(torch::randn({1040, 704}, cuda), Fp8Format::kE4M3);
    const auto b = quantize_current_scaling(torch::randn({n, 704}, cuda), Fp8Format::kE4M3);
    return std::vector<torch::Tensor>{a.data, a.scale_inv, b.data, b.scale_inv};
  };
  auto expected = [](const std::vector<torch::Tensor>& in) {
    const auto a = in[0].cpu().to(torch::kDouble) * in[1].cpu().to(torch::kDouble);
    const auto b = in[2].cpu().to(torch::kDouble) * in[3].cpu().to(torch::kDouble);
    return torch::matmul(a, b.t());
  };
  torch::nn::Linear anchor(1, 1);  // the graph's device
  anchor->to(torch::kCUDA);
  CudaGraphedMicroBatch graph(*anchor);
  torch::Tensor y;
  const auto gemm = [&](const std::vector<torch::Tensor>& in) {
    y = fp8_gemm(Fp8Tensor(in[0], in[1], Fp8Format::kE4M3), Fp8Tensor(in[2], in[3], Fp8Format::kE4M3), at::kFloat);
    return y.sum();
  };
  // The graph's stream meets cuBLASLt eagerly first, at another N (another configuration).
  const auto warm = operands(1024);
  const auto before = fp8_gemm_candidates_timed();
  graph.run_eager(warm, gemm);
  const auto timed = fp8_gemm_candidates_timed();
  EXPECT_GE(timed, before + 2) << "the eager call timed no candidates: the capture's check below proves nothing";
  const auto first = operands(1536);
  graph.capture_and_run(first, gemm);
  EXPECT_EQ(fp8_gemm_candidates_timed(), timed);
  EXPECT_LE(testing::relative_error(y, expected(first)), 2.5e-4);
  const auto second = operands(1536);
  graph.replay(second);
  EXPECT_LE(testing::relative_error(y, expected(second)), 2.5e-4);
}

TEST(CudaGraphTest, InputsOfAnotherShapeAreAnError_CUDA) {
  AMP8_REQUIRE_CUDA();
  auto model = testing::make_mlp();
  model->to(torch::kCUDA);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  Trainer trainer(TrainerOptions().max_steps(6).log_every_n_steps(0).cuda_graph(true).cuda_graph_warmup_steps(1),
                  MixedPrecisionOptions("bf16-mixed"));
  GraphableStep step;
  step.batch = [](const TrainStepInput& in) {
    return std::vector<torch::Tensor>{torch::randn({in.step < 3 ? 8 : 4, 32}, torch::kCUDA)};
  };
  step.loss = [&](const std::vector<torch::Tensor>& batch, PrecisionPlugin& plugin) {
    return plugin.convert_output(model->forward(plugin.convert_input(batch[0]))).square().mean();
  };
  ExpectErrorContaining([&] { trainer.fit(*model, optimizer, step); },
                        "the micro-batch's input 0 is Float [4, 32]; the captured graph was made for Float [8, 32]");
  EXPECT_EQ(trainer.global_step(), 3);
}

}  // namespace
}  // namespace amp8
