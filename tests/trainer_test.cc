// Trainer: progress lines, gradient accumulation, exact resume in every precision, atomic
// checkpoints that survive a writer killed mid-write, and clear errors for bad checkpoints.
#include "plugin/training/trainer.h"

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <cstdlib>
#include <limits>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "plugin/optim/grad_clip.h"
#include "plugin/training/checkpoint.h"
#include "plugin/training/step_profiler.h"
#include "recipes/precision.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

namespace fs = std::filesystem;
using testing::BytesEqual;
using testing::ExpectErrorContaining;
using testing::SequenceData;
using testing::TinyTransformer;

// A fresh, existing folder under the test's temporary directory.
fs::path scratch_dir(const std::string& name) {
  auto dir = testing::scratch_path("trainer_test", name);
  fs::create_directories(dir);
  return dir;
}

// Everything a run leaves behind that must match bit for bit.
struct RunState {
  std::vector<double> losses;
  std::vector<torch::Tensor> params, buffers, masters;
};

struct RunSetup {
  MixedPrecisionOptions precision;
  torch::Device device = torch::kCPU;
};

// Builds model + optimizer + trainer from the seed, trains up to `max_steps` (resuming from
// `resume` when given) and returns the state.
RunState run(const RunSetup& setup, int64_t max_steps, const fs::path& checkpoint_dir,
             int64_t every_n, const std::string& resume = "") {
  torch::manual_seed(77);
  TinyTransformer model(2, /*dropout=*/0.1);  // dropout: the RNG state must resume too
  model->to(setup.device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(2e-3));
  Trainer trainer(TrainerOptions()
                      .max_steps(max_steps)
                      .accumulate_grad_batches(2)
                      .gradient_clip_val(1.0)
                      .log_every_n_steps(0)
                      .every_n_train_steps(every_n)
                      .checkpoint_dir(checkpoint_dir.string()),
                  setup.precision);
  SequenceData data(31);
  const auto device = setup.device;
  trainer.fit(*model, optimizer,
              [&](const TrainStepInput& in) {
                auto [x, y] = data.batch(in.step, in.micro_batch);
                auto out = model->forward(in.precision.convert_input(x.to(device)));
                return torch::mse_loss(in.precision.convert_output(out), y.to(device));
              },
              resume);
  RunState state;
  for (const auto& m : trainer.history()) state.losses.push_back(m.loss);
  for (const auto& p : model->parameters()) state.params.push_back(p.detach().cpu().clone());
  for (const auto& b : model->buffers()) state.buffers.push_back(b.detach().cpu().clone());
  auto* plugin = dynamic_cast<MixedPrecisionPlugin*>(trainer.plugins.get().get());
  for (const auto& m : plugin->master_params()) state.masters.push_back(m.detach().cpu().clone());
  return state;
}

void expect_identical(const RunState& actual, const RunState& expected, const std::string& what) {
  ASSERT_EQ(actual.losses.size(), expected.losses.size()) << what;
  for (size_t i = 0; i < actual.losses.size(); ++i) {
    EXPECT_EQ(actual.losses[i], expected.losses[i]) << what << ": loss of step " << i + 1;
  }
  ASSERT_EQ(actual.params.size(), expected.params.size());
  for (size_t i = 0; i < actual.params.size(); ++i) {
    EXPECT_TRUE(BytesEqual(actual.params[i], expected.params[i])) << what << ": param " << i;
  }
  ASSERT_EQ(actual.buffers.size(), expected.buffers.size());
  for (size_t i = 0; i < actual.buffers.size(); ++i) {
    EXPECT_TRUE(BytesEqual(actual.buffers[i], expected.buffers[i])) << what << ": buffer " << i;
  }
  ASSERT_EQ(actual.masters.size(), expected.masters.size());
  for (size_t i = 0; i < actual.masters.size(); ++i) {
    EXPECT_TRUE(BytesEqual(actual.masters[i], expected.masters[i])) << what << ": master " << i;
  }
}

struct ResumeCase {
  std::string name;
  MixedPrecisionOptions precision;
};

std::vector<ResumeCase> resume_cases() {
  return {
      {"fp32", MixedPrecisionOptions("32")},
      {"bf16_mixed", recipes::bf16_mixed()},
      // A small loss scale window so the scale grows (and its state matters) within 40 steps.
      {"fp16_mixed", recipes::fp16_mixed().fp16_initial_loss_scale(1024).fp16_loss_scale_window(7)},
      {"bf16_with_fp8_mixed", recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_amax_history_len(16)},
      {"bf16_with_fp8_mixed_no_fp8_params",
       recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0).fp8_amax_history_len(4)},
      {"fp16_with_fp8_mixed", recipes::fp16_with_fp8_mixed().fp8_min_gemm_size(0).fp16_initial_loss_scale(1024)},
      // Adam's moments in bfloat16: the checkpoint holds them as they are.
      {"bf16_with_fp8_mixed_bf16_moments",
       recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16)},
      // FP8 weights written at the last step's scale: the resumed run takes its first scales from
      // the loaded masters, which an uninterrupted run took from the same values. bfloat16
      // moments: through the fused step on the CPU too.
      {"bf16_with_fp8_mixed_delayed_weights", recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_params_scaling("delayed")},
      {"bf16_with_fp8_mixed_delayed_weights_bf16_moments",
       recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_params_scaling("delayed").exp_avg_dtype(at::kBFloat16)
           .exp_avg_sq_dtype(at::kBFloat16)},
  };
}

class TrainerResumeTest : public ::testing::TestWithParam<std::string> {};

// 20 steps, checkpoint, fresh objects, 20 more == 40 uninterrupted steps, bit for bit.
TEST_P(TrainerResumeTest, ResumeIsBitIdenticalInEveryPrecision) {
  const bool cuda = GetParam() == "GPU_CUDA";
  if (cuda) {
    AMP8_REQUIRE_CUDA();
    // Bit-identical on the GPU needs deterministic kernels (attention backward, cuBLAS): the
    // settings TrainerOptions::deterministic makes, so that they are what this test shows to
    // repeat (new tensors not filled with NaN among them).
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 1);
    use_deterministic_algorithms();
  }
  const torch::Device device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  for (const auto& c : resume_cases()) {
    SCOPED_TRACE(c.name);
    const RunSetup setup{c.precision, device};
    const auto dir = scratch_dir("resume_" + c.name + "_" + GetParam());
    const auto uninterrupted = run(setup, 40, dir / "full", 0);
    const auto first = run(setup, 20, dir / "split", 20);
    ASSERT_TRUE(fs::exists(dir / "split" / "step_00000020.ckpt"));
    const auto second = run(setup, 40, dir / "split", 0, (dir / "split").string());
    RunState joined = second;
    joined.losses.insert(joined.losses.begin(), first.losses.begin(), first.losses.end());
    expect_identical(joined, uninterrupted, c.name);
    EXPECT_NE(first.losses.front(), uninterrupted.losses.back()) << "the run trained";
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, TrainerResumeTest, ::testing::Values("CPU", "GPU_CUDA"),
                         [](const auto& info) { return std::string(info.param); });

class TrainerTest : public testing::SeededTest {};

TEST_F(TrainerTest, PrintsProgressLines) {
  auto model = testing::make_mlp();
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  Trainer trainer(TrainerOptions().max_steps(20).log_every_n_steps(10).tokens_per_micro_batch(64));
  trainer.plugins = recipes::fp16_mixed().fp16_initial_loss_scale(4096);
  std::ostringstream log;
  trainer.log = &log;
  testing::MlpData data(3);
  trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
    auto [x, y] = data.batch(in.step, in.micro_batch);
    return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
  });
  const auto text = log.str();
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u) << text;
  EXPECT_EQ(lines[0].rfind("step 10/20 | loss ", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("step 20/20 | loss ", 0), 0u) << lines[1];
  for (const auto& line : lines) {
    EXPECT_NE(line.find(" tok/s"), std::string::npos) << line;
    EXPECT_NE(line.find("| loss scale 4096 | skipped 0"), std::string::npos) << line;
    EXPECT_NE(line.find(" elapsed, ETA "), std::string::npos) << line;
  }
  EXPECT_EQ(trainer.global_step(), 20);
  ASSERT_EQ(trainer.history().size(), 20u);
  EXPECT_LT(trainer.history().back().loss, trainer.history().front().loss);
}

// deterministic: fit turns on PyTorch's deterministic algorithms and cuDNN's and sets
// CUBLAS_WORKSPACE_CONFIG where it is unset; without it, fit leaves them as they are. The
// process-wide settings are restored afterwards.
TEST_F(TrainerTest, DeterministicTurnsOnPyTorchsDeterministicAlgorithms) {
  auto& context = at::globalContext();
  const bool algorithms = context.deterministicAlgorithms(), warn_only = context.deterministicAlgorithmsWarnOnly(),
             cudnn = context.deterministicCuDNN(), benchmark = context.benchmarkCuDNN(),
             fill = context.deterministicFillUninitializedMemory();
  const char* env = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  const std::optional<std::string> saved_env = env ? std::optional<std::string>(env) : std::nullopt;
  const auto fit_once = [](bool deterministic) {
    auto model = testing::make_mlp();
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    Trainer trainer(TrainerOptions().max_steps(1).log_every_n_steps(0).deterministic(deterministic));
    testing::MlpData data(1);
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      auto [x, y] = data.batch(in.step, in.micro_batch);
      return torch::mse_loss(model->forward(x), y);
    });
  };
  context.setDeterministicAlgorithms(false, false);
  context.setDeterministicCuDNN(false);
  context.setBenchmarkCuDNN(true);
  unsetenv("CUBLAS_WORKSPACE_CONFIG");
  fit_once(false);
  EXPECT_FALSE(context.deterministicAlgorithms());
  EXPECT_TRUE(context.benchmarkCuDNN());
  EXPECT_EQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), nullptr);

  context.setDeterministicFillUninitializedMemory(true);  // PyTorch's default
  fit_once(true);
  EXPECT_TRUE(context.deterministicAlgorithms());
  EXPECT_FALSE(context.deterministicFillUninitializedMemory()) << "a fill kernel per new tensor";
  EXPECT_FALSE(context.deterministicAlgorithmsWarnOnly()) << "an op without a deterministic variant must be an error";
  EXPECT_TRUE(context.deterministicCuDNN());
  EXPECT_FALSE(context.benchmarkCuDNN());
  ASSERT_NE(std::getenv("CUBLAS_WORKSPACE_CONFIG"), nullptr);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":4096:8");

  setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8", 1);  // a user's own setting stands
  fit_once(true);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":16:8");

  context.setDeterministicAlgorithms(algorithms, warn_only);
  context.setDeterministicFillUninitializedMemory(fill);
  context.setDeterministicCuDNN(cudnn);
  context.setBenchmarkCuDNN(benchmark);
  if (saved_env) {
    setenv("CUBLAS_WORKSPACE_CONFIG", saved_env->c_str(), 1);
  } else {
    unsetenv("CUBLAS_WORKSPACE_CONFIG");
  }
}

// A NaN loss at step 4: "error" stops before the weights take it; "skip" drops the step.
TEST_F(TrainerTest, NonFiniteLossNeverReachesTheWeights) {
  testing::MlpData data(6);
  for (const std::string policy : {"error", "skip"}) {
    for (const auto& precision : {MixedPrecisionOptions("32"), recipes::bf16_mixed()}) {
      SCOPED_TRACE(policy + " " + precision.precision());
      torch::manual_seed(8);
      auto model = testing::make_mlp();
      torch::optim::Adam optimizer(model->parameters(), 1e-3);
      const auto dir = scratch_dir("nonfinite_" + policy + "_" + precision.precision());
      Trainer trainer(TrainerOptions().max_steps(6).log_every_n_steps(0).nonfinite_loss(policy)
                          .checkpoint_dir(dir.string()).every_n_train_steps(100),
                      precision);
      std::vector<torch::Tensor> after_step_3;
      auto* plugin = dynamic_cast<MixedPrecisionPlugin*>(trainer.plugins.get().get());
      auto step_fn = [&](const TrainStepInput& in) {
        if (in.step == 3) {
          for (const auto& m : plugin->master_params()) after_step_3.push_back(m.detach().clone());
        }
        auto [x, y] = data.batch(in.step, in.micro_batch);
        auto loss = torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
        return in.step == 3 ? loss * std::numeric_limits<float>::quiet_NaN() : loss;
      };
      if (policy == "error") {
        ExpectErrorContaining([&] { trainer.fit(*model, optimizer, step_fn); }, "non-finite loss (nan) at step 4");
        EXPECT_EQ(trainer.global_step(), 3);
        // The state saved at the stop is step 3's, which skipped nothing.
        auto reader_model = testing::make_mlp();
        torch::optim::Adam reader_optimizer(reader_model->parameters(), 1e-3);
        Trainer reader(TrainerOptions().log_every_n_steps(0), precision);
        reader.load_checkpoint((dir / Trainer::checkpoint_name(3)).string(), *reader_model, reader_optimizer);
        EXPECT_EQ(reader.global_step(), 3);
        EXPECT_EQ(reader.plugins->skipped_steps(), 0);
      } else {
        trainer.fit(*model, optimizer, step_fn);
        EXPECT_EQ(trainer.global_step(), 6);
        EXPECT_FALSE(trainer.history()[3].stepped);
        EXPECT_EQ(trainer.history()[3].skipped_steps, 1);
        EXPECT_TRUE(trainer.history()[4].stepped);
      }
      const auto masters = plugin->master_params();
      for (size_t i = 0; i < masters.size(); ++i) {
        EXPECT_TRUE(torch::isfinite(masters[i]).all().item<bool>());
        if (policy == "error") {
          EXPECT_TRUE(masters[i].equal(after_step_3[i])) << "param " << i;
        }
      }
      for (const auto& p : model->parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
    }
  }
}

// A step that fails after the last backward pass (a collective timing out in the optimizer
// step, a module swap that never ran) drops that step's gradients: the same Trainer's next fit
// starts clean instead of failing at its first backward pass as if a step had been skipped over.
TEST_F(TrainerTest, AStepThatThrowsDropsItsGradients) {
  struct FailsOnce : MixedPrecisionPlugin {
    using MixedPrecisionPlugin::MixedPrecisionPlugin;
    bool fail = true;
    bool optimizer_step(torch::optim::Optimizer& optimizer) override {
      if (std::exchange(fail, false)) TORCH_CHECK(false, "the all-gather timed out");
      return MixedPrecisionPlugin::optimizer_step(optimizer);
    }
  };
  testing::MlpData data(6);
  torch::manual_seed(8);
  auto model = testing::make_mlp();
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  auto plugin = std::make_shared<FailsOnce>(recipes::bf16_mixed());
  Trainer trainer(TrainerOptions().max_steps(3).log_every_n_steps(0).gradient_clip_val(1.0), plugin);
  auto step_fn = [&](const TrainStepInput& in) {
    auto [x, y] = data.batch(in.step, in.micro_batch);
    return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
  };
  ExpectErrorContaining([&] { trainer.fit(*model, optimizer, step_fn); }, "the all-gather timed out");
  EXPECT_EQ(trainer.global_step(), 0);
  trainer.fit(*model, optimizer, step_fn);  // would fail: "plugin.backward(loss) ran again ..."
  EXPECT_EQ(trainer.global_step(), 3);
  EXPECT_TRUE(trainer.history().back().stepped);
}

// One host sync per step: the Trainer measures the gradients' norm on the device
// (gradient_norm) before it reads the loss, reads both at once, and clips with that value
// (clip_gradients_to) instead of measuring again as clip_gradients does. The weights are those
// of a loop that calls clip_gradients, bit for bit.
TEST_F(TrainerTest, ClipsWithTheNormReadAlongsideTheLoss) {
  struct Recording : MixedPrecisionPlugin {
    using MixedPrecisionPlugin::MixedPrecisionPlugin;
    int norms_measured = 0;
    std::vector<double> clipped_with;
    torch::Tensor gradient_norm(torch::optim::Optimizer& optimizer) override {
      ++norms_measured;
      return MixedPrecisionPlugin::gradient_norm(optimizer);
    }
    void clip_gradients_to(torch::optim::Optimizer& optimizer, double max_norm, double norm) override {
      clipped_with.push_back(norm);
      MixedPrecisionPlugin::clip_gradients_to(optimizer, max_norm, norm);
    }
  };
  constexpr double kMaxNorm = 1e-2;
  testing::MlpData data(6);
  const auto loss_of = [&](torch::nn::Sequential& model, PrecisionPlugin& precision, int64_t step) {
    auto [x, y] = data.batch(step, 0);
    return torch::mse_loss(precision.convert_output(model->forward(precision.convert_input(x))), y);
  };
  torch::manual_seed(8);
  auto model = testing::make_mlp();
  torch::optim::AdamW optimizer(model->parameters(), 1e-3);
  auto plugin = std::make_shared<Recording>(recipes::bf16_mixed());
  Trainer trainer(TrainerOptions().max_steps(3).log_every_n_steps(0).gradient_clip_val(kMaxNorm), plugin);
  trainer.fit(*model, optimizer, [&](const TrainStepInput& in) { return loss_of(model, in.precision, in.step); });
  EXPECT_EQ(plugin->norms_measured, 3);
  ASSERT_EQ(plugin->clipped_with.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(plugin->clipped_with[i], trainer.history()[i].grad_norm) << "step " << i;
    EXPECT_GT(plugin->clipped_with[i], kMaxNorm) << "step " << i << " was clipped";
  }

  torch::manual_seed(8);
  auto reference = testing::make_mlp();
  torch::optim::AdamW reference_optimizer(reference->parameters(), 1e-3);
  MixedPrecisionPlugin reference_plugin = recipes::bf16_mixed();
  reference_plugin.connect(*reference, reference_optimizer);
  for (int64_t step = 0; step < 3; ++step) {
    torch::Tensor loss;
    {
      auto context = reference_plugin.forward_context();
      loss = loss_of(reference, reference_plugin, step);
    }
    reference_plugin.backward(loss);
    // Independently of gradient_norm: the norm is that of the masters' gradients, and clipping
    // leaves them at max_norm · norm / (norm + 1e-6).
    const auto masters_grad_norm = [&] {
      double sum = 0;
      for (const auto& master : reference_plugin.master_params()) {
        if (master.grad().defined()) sum += master.grad().to(at::kDouble).square().sum().item<double>();
      }
      return std::sqrt(sum);
    };
    reference_plugin.unscale_gradients(reference_optimizer);
    const double before = masters_grad_norm();
    const double norm = reference_plugin.clip_gradients(reference_optimizer, kMaxNorm);
    EXPECT_NEAR(norm, before, 1e-6 * before);
    EXPECT_NEAR(masters_grad_norm(), kMaxNorm * norm / (norm + 1e-6), 1e-6 * kMaxNorm);
    EXPECT_EQ(norm, plugin->clipped_with[step]);
    reference_plugin.optimizer_step(reference_optimizer);
  }
  const auto masters = plugin->master_params(), expected = reference_plugin.master_params();
  ASSERT_EQ(masters.size(), expected.size());
  for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(testing::BytesEqual(masters[i], expected[i])) << "master " << i;
}

TEST_F(TrainerTest, AccumulationAveragesMicroBatches) {
  // Two micro-batches of 16 rows == one batch of the same 32 rows, in fp32.
  testing::MlpData data(4);
  auto batch32 = [&](int64_t step) {
    auto [x0, y0] = data.batch(step, 0, 16);
    auto [x1, y1] = data.batch(step, 1, 16);
    return std::make_pair(torch::cat({x0, x1}), torch::cat({y0, y1}));
  };
  torch::manual_seed(5);
  auto a = testing::make_mlp();
  torch::manual_seed(5);
  auto b = testing::make_mlp();
  torch::optim::SGD opt_a(a->parameters(), 0.1), opt_b(b->parameters(), 0.1);
  Trainer accumulate(TrainerOptions().max_steps(3).accumulate_grad_batches(2).log_every_n_steps(0));
  accumulate.fit(*a, opt_a, [&](const TrainStepInput& in) {
    auto [x, y] = data.batch(in.step, in.micro_batch, 16);
    return torch::mse_loss(a->forward(x), y);
  });
  Trainer whole(TrainerOptions().max_steps(3).log_every_n_steps(0));
  whole.fit(*b, opt_b, [&](const TrainStepInput& in) {
    auto [x, y] = batch32(in.step);
    return torch::mse_loss(b->forward(x), y);
  });
  const auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LE(testing::relative_error(pa[i], pb[i]), 1e-6) << "param " << i;
  }
}

// A writer killed mid-write (SIGKILL of a forked child saving to the same path) leaves the
// previous checkpoint loadable and intact.
TEST_F(TrainerTest, CheckpointSurvivesAWriterKilledMidWrite) {
  const auto dir = scratch_dir("killed");
  const auto path = (dir / "last.ckpt").string();
  // A model big enough that one save takes a while (~16 MB).
  auto model = torch::nn::Sequential(torch::nn::Linear(2048, 2048));
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  Trainer trainer(TrainerOptions().log_every_n_steps(0));
  trainer.save_checkpoint(path, *model, optimizer);
  const auto saved_weight = model->ptr(0)->as<torch::nn::LinearImpl>()->weight.detach().clone();

  // The child's checkpoint (different weights) is built before the fork: the child only writes
  // (a process forked after CUDA was initialised must not use CUDA).
  auto other = torch::nn::Sequential(torch::nn::Linear(2048, 2048));
  {
    torch::NoGradGuard no_grad;
    other->ptr(0)->as<torch::nn::LinearImpl>()->weight.fill_(-1.0f);
  }
  torch::optim::SGD other_optimizer(other->parameters(), 0.1);
  Trainer other_trainer(TrainerOptions().log_every_n_steps(0));
  auto childs_archive = other_trainer.checkpoint_archive(*other, other_optimizer);

  bool killed_mid_write = false;
  for (int attempt = 0; attempt < 50 && !killed_mid_write; ++attempt) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (;;) save_atomically(childs_archive, path);  // until killed
    }
    const auto temporary = path + ".tmp." + std::to_string(child);
    // Wait until the child is writing (its temporary file has bytes), then kill it.
    std::error_code error;
    int status = 0;
    bool child_exited = false;
    for (int i = 0; i < 100000; ++i) {
      if (fs::exists(temporary, error) && fs::file_size(temporary, error) > 0) break;
      if (::waitpid(child, &status, WNOHANG) == child) {
        child_exited = true;
        break;
      }
      ::usleep(50);
    }
    ASSERT_FALSE(child_exited) << "the writer died on its own, status " << status;
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    killed_mid_write = fs::exists(temporary, error);
    fs::remove(temporary, error);

    // Whatever the child got to, the checkpoint at `path` is complete: either the original or
    // one of the child's complete writes.
    auto fresh = torch::nn::Sequential(torch::nn::Linear(2048, 2048));
    torch::optim::SGD fresh_optimizer(fresh->parameters(), 0.1);
    Trainer reader(TrainerOptions().log_every_n_steps(0));
    ASSERT_NO_THROW(reader.load_checkpoint(path, *fresh, fresh_optimizer));
    const auto weight = fresh->ptr(0)->as<torch::nn::LinearImpl>()->weight;
    const bool original = weight.equal(saved_weight);
    const bool childs = weight.eq(-1.0f).all().item<bool>();
    EXPECT_TRUE(original || childs) << "a torn checkpoint was loaded";
    if (childs) trainer.save_checkpoint(path, *model, optimizer);  // restore the original
  }
  EXPECT_TRUE(killed_mid_write) << "no attempt killed the writer mid-write";
}

// Runs `signals` in a forked child that holds a StopOnSignal (window `window_ms`) and reports
// what became of it: the exit code 0 when the stop was requested once and the child lived on,
// or the signal that ended it. The child touches no tensors (fork after the test's set-up).
int child_under_stop_on_signal(int window_ms, const std::function<void()>& signals) {
  Trainer trainer(TrainerOptions().log_every_n_steps(0));
  const pid_t child = ::fork();
  if (child == 0) {
    StopOnSignal stop(trainer, std::chrono::milliseconds(window_ms));
    signals();
    ::_exit(stop.received() == SIGTERM ? 0 : 3);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFSIGNALED(status) ? -WTERMSIG(status) : WEXITSTATUS(status);
}

// timeout(1) sends SIGTERM to its command and then to the command's process group: one request
// arrives twice within microseconds. It must stop the run cleanly, not end the process (before,
// the second copy counted as an operator's second Ctrl-C, and one run in four under timeout died
// without its checkpoint).
TEST(StopOnSignalTest, OneSignalDeliveredTwiceIsOneRequest) {
  EXPECT_EQ(child_under_stop_on_signal(1000, [] {
              ::setpgid(0, 0);  // a process group of its own, as timeout gives its command
              ::kill(::getpid(), SIGTERM);
              ::kill(0, SIGTERM);  // the group: the child alone
            }), 0);
}

// A repeat after the window is the operator insisting: the default action ends the process.
// A signal of the other kind meanwhile changes nothing.
TEST(StopOnSignalTest, ARepeatAfterTheWindowEndsTheProcess) {
  EXPECT_EQ(child_under_stop_on_signal(20, [] {
              ::raise(SIGTERM);
              ::usleep(50 * 1000);
              ::raise(SIGINT);
            }), 0);
  EXPECT_EQ(child_under_stop_on_signal(20, [] {
              ::raise(SIGTERM);
              ::usleep(50 * 1000);
              ::raise(SIGTERM);
            }), -SIGTERM);
}

TEST(StopOnSignalTest, ANegativeWindowIsAnError) {
  Trainer trainer(TrainerOptions().log_every_n_steps(0));
  ExpectErrorContaining([&] { StopOnSignal stop(trainer, std::chrono::milliseconds(-1)); },
                        "StopOnSignal: same_request_window must be >= 0 ms, got -1 ms");
}

// A string literal's bytes, zeros included.
template <size_t N>
std::string raw(const char (&literal)[N]) {
  return std::string(literal, N - 1);
}

// LibTorch's unpickler sizes its memo table by the ids it reads (a corrupt id in an archive with
// a valid trailer, found by fuzz_checkpoint_load, asked for 32 GB) and builds a storage of the
// size the pickle claims over a record of any size. check_pickle_bounds names both before
// LibTorch sees them, and a checkpoint big enough to need LONG_BINPUT ids still loads.
TEST_F(TrainerTest, CorruptPicklesAreNamedBeforeLibTorchReadsThem) {
  auto expect_bad = [](const std::string& pickle, const std::string& message) {
    ExpectErrorContaining([&] {
      check_pickle_bounds(reinterpret_cast<const uint8_t*>(pickle.data()), pickle.size(), "p");
    }, message);
  };
  const std::string good = raw("\x80\x02]q\x00]q\x01h\x00X\x02\x00\x00\x00" "abq\x02.");
  EXPECT_NO_THROW(check_pickle_bounds(reinterpret_cast<const uint8_t*>(good.data()), good.size(), "p"));
  expect_bad(raw("\x80\x02]r\x40\x69\x66\x76."),
             "p: LONG_BINPUT at byte 3 stores memo id 1986423104, but only 0 memo entries precede it");
  expect_bad(raw("\x80\x02]q\x00]q\x02."),
             "p: BINPUT at byte 6 stores memo id 2, but only 1 memo entries precede it");
  expect_bad(raw("\x80\x02X\xff\xff\xff\x7f" "ab."),
             "p: BINUNICODE at byte 2 needs 2147483647 more bytes, the pickle ends after 3");
  expect_bad(raw("\x80\x02" "ctorch\nTensor"), "p: GLOBAL at byte 2 is not ended by a newline");
  expect_bad(raw("\x80\x02J\x01\x02"), "p: BININT at byte 2 needs 4 more bytes");

  // A storage's persistent id as LibTorch writes it: ("storage", torch.FloatStorage, key,
  // location, numel). Its bytes must fit its record.
  const std::string storage_id = raw("\x80\x02(X\x07\x00\x00\x00" "storagectorch\nFloatStorage\n"
                                     "X\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x05tQ.");
  auto record_of = [](int64_t bytes) {
    return [bytes](const std::string& key) -> int64_t { return key == "0" ? bytes : -1; };
  };
  auto check_storage = [&](int64_t record_bytes) {
    check_pickle_bounds(reinterpret_cast<const uint8_t*>(storage_id.data()), storage_id.size(), "p",
                        record_of(record_bytes));
  };
  EXPECT_NO_THROW(check_storage(20));  // 5 floats
  ExpectErrorContaining([&] { check_storage(8); },
                        "p: storage 0 (FloatStorage) claims 5 elements = 20 bytes, but its record "
                        "holds 8 bytes");
  ExpectErrorContaining([&] { check_storage(-1); }, "p: storage 0 (FloatStorage) claims 5 elements = "
                        "20 bytes, but its record is missing");
  // The second storage of a pickle, as LibTorch writes it: "storage", the GLOBAL and the
  // location come from the memo (BINGET), only the key is new.
  const std::string two_storages = raw(
      "\x80\x02(X\x07\x00\x00\x00" "storageq\x00" "ctorch\nFloatStorage\nq\x01"
      "X\x01\x00\x00\x00" "0q\x02X\x03\x00\x00\x00" "cpuq\x03K\x05tQ"
      "(h\x00h\x01X\x01\x00\x00\x00" "1q\x04h\x03K\x09tQ.");
  auto check_two = [&](int64_t second_bytes) {
    check_pickle_bounds(reinterpret_cast<const uint8_t*>(two_storages.data()), two_storages.size(), "p",
                        [second_bytes](const std::string& key) -> int64_t { return key == "0" ? 20 : second_bytes; });
  };
  EXPECT_NO_THROW(check_two(36));  // 9 floats
  ExpectErrorContaining([&] { check_two(16); },
                        "p: storage 1 (FloatStorage) claims 9 elements = 36 bytes, but its record holds 16 bytes");

  // The fuzzer's case end to end: data.pkl's first PUT made a LONG_BINPUT of a huge id, the
  // trailer recomputed so only the pickle check stands between the file and LibTorch.
  const auto dir = scratch_dir("pickle");
  auto model = testing::make_mlp();
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  Trainer trainer(TrainerOptions().log_every_n_steps(0), recipes::bf16_mixed());
  // Connects the plugin (bf16 params, FP32 masters) and fails on the missing file.
  ExpectErrorContaining([&] { trainer.load_checkpoint((dir / "none.ckpt").string(), *model, optimizer); },
                        "does not exist");
  const auto good_path = (dir / "good.ckpt").string();
  trainer.save_checkpoint(good_path, *model, optimizer);
  std::string bytes;
  {
    std::ifstream in(good_path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::string archive = bytes.substr(0, bytes.size() - 28);
  size_t data_pkl = 0, data_pkl_size = 0;
  {
    std::istringstream stream(archive);
    caffe2::serialize::PyTorchStreamReader reader(&stream);
    data_pkl = reader.getRecordOffset("data.pkl");
    data_pkl_size = reader.getRecordSize("data.pkl");
  }
  ASSERT_EQ(archive.substr(data_pkl, 2), raw("\x80\x02"));
  archive.replace(data_pkl, 9, raw("\x80\x02]r\x40\x69\x66\x76."));
  const auto bad_path = (dir / "memo.ckpt").string();
  std::ofstream(bad_path, std::ios::binary) << archive << checkpoint_trailer(archive.data(), archive.size());
  const auto before = model->parameters()[0].detach().clone();
  ExpectErrorContaining([&] { trainer.load_checkpoint(bad_path, *model, optimizer); },
                        "memo.ckpt is not a readable archive: record data.pkl: LONG_BINPUT at byte 3 "
                        "stores memo id 1986423104");
  EXPECT_TRUE(model->parameters()[0].equal(before));
  ASSERT_NO_THROW(trainer.load_checkpoint(good_path, *model, optimizer));

  // The first storage (amp8_checkpoint_version: one int64) made to claim 255 elements: a tensor
  // of 2040 bytes over an 8-byte record, which LibTorch would build and read past.
  archive = bytes.substr(0, bytes.size() - 28);
  const size_t location = archive.find(raw("\x03\x00\x00\x00" "cpu"), data_pkl);
  ASSERT_NE(location, std::string::npos);
  const size_t numel_at = archive.find("K\x01tQ", location);  // BININT1 1, TUPLE, BINPERSID
  ASSERT_LT(numel_at - location, 16u);
  archive[numel_at + 1] = '\xff';
  const auto numel_path = (dir / "numel.ckpt").string();
  std::ofstream(numel_path, std::ios::binary) << archive << checkpoint_trailer(archive.data(), archive.size());
  ExpectErrorContaining([&] { trainer.load_checkpoint(numel_path, *model, optimizer); },
                        "numel.ckpt is not a readable archive: record data.pkl: storage 0 (LongStorage) "
                        "claims 255 elements = 2040 bytes, but its record holds 8 bytes");

  // The last storage of the archive (its persistent id mostly memo references) made to claim
  // the most elements its integer opcode holds.
  archive = bytes.substr(0, bytes.size() - 28);
  const size_t last_id = archive.rfind("tQ", data_pkl + data_pkl_size - 2);  // data.pkl's last id
  ASSERT_NE(last_id, std::string::npos);
  ASSERT_GT(last_id, data_pkl);
  if (archive[last_id - 2] == 'K') {
    archive[last_id - 1] = '\xff';
  } else if (archive[last_id - 3] == 'M') {
    archive[last_id - 2] = archive[last_id - 1] = '\xff';
  } else {
    ASSERT_EQ(archive[last_id - 5], 'J') << "the numel of the last storage is a BININT";
    archive[last_id - 4] = archive[last_id - 3] = archive[last_id - 2] = '\xff';
    archive[last_id - 1] = '\x7f';
  }
  const auto last_path = (dir / "last.ckpt").string();
  std::ofstream(last_path, std::ios::binary) << archive << checkpoint_trailer(archive.data(), archive.size());
  std::string error;
  try {
    trainer.load_checkpoint(last_path, *model, optimizer);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  EXPECT_NE(error.find("last.ckpt is not a readable archive: record data.pkl: storage "), std::string::npos) << error;
  EXPECT_NE(error.find("but its record holds"), std::string::npos) << error;
  EXPECT_EQ(error.find("storage 0 "), std::string::npos) << "a later storage, not the first: " << error;

  // 200 layers: far more than 256 memo entries, so the writer used LONG_BINPUT; it loads.
  torch::nn::Sequential deep;
  for (int i = 0; i < 200; ++i) deep->push_back(torch::nn::Linear(2, 2));
  torch::optim::SGD deep_optimizer(deep->parameters(), 0.1);
  Trainer deep_trainer(TrainerOptions().log_every_n_steps(0));
  const auto deep_path = (dir / "deep.ckpt").string();
  deep_trainer.save_checkpoint(deep_path, *deep, deep_optimizer);
  const auto weight = deep->parameters().back().detach().clone();
  torch::NoGradGuard no_grad;
  deep->parameters().back().fill_(7.0f);
  ASSERT_NO_THROW(deep_trainer.load_checkpoint(deep_path, *deep, deep_optimizer));
  EXPECT_TRUE(deep->parameters().back().equal(weight));
}

TEST_F(TrainerTest, BadCheckpointsAreClearErrors) {
  const auto dir = scratch_dir("bad");
  auto model = testing::make_mlp();
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  Trainer trainer(TrainerOptions().log_every_n_steps(0), recipes::bf16_mixed());
  ExpectErrorContaining([&] { trainer.load_checkpoint((dir / "missing.ckpt").string(), *model, optimizer); },
                        "missing.ckpt does not exist");
  {
    std::ofstream junk(dir / "junk.ckpt");
    junk << "not an archive";
  }
  ExpectErrorContaining([&] { trainer.load_checkpoint((dir / "junk.ckpt").string(), *model, optimizer); },
                        "junk.ckpt is not an amp8 checkpoint");
  ExpectErrorContaining([&] { trainer.save_checkpoint(dir.string(), *model, optimizer); },
                        "is a folder, expected a file path");
  ExpectErrorContaining([&] { trainer.save_checkpoint((dir / "no" / "x.ckpt").string(), *model, optimizer); },
                        "does not exist or is not a folder");

  // A flipped bit, a truncated file, another format version: each named, nothing loaded.
  const auto good = dir / "good.ckpt";
  trainer.save_checkpoint(good.string(), *model, optimizer);
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& name, const std::string& content) {
    std::ofstream(dir / name, std::ios::binary | std::ios::trunc) << content;
    return (dir / name).string();
  };
  auto flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x10;  // inside the archive's tensor data
  const auto before = model->parameters()[0].detach().clone();
  ExpectErrorContaining([&] { trainer.load_checkpoint(write("flipped.ckpt", flipped), *model, optimizer); },
                        "flipped.ckpt is corrupt: checksum mismatch");
  EXPECT_TRUE(model->parameters()[0].equal(before)) << "nothing was loaded";
  ExpectErrorContaining([&] {
    trainer.load_checkpoint(write("cut.ckpt", bytes.substr(0, bytes.size() - 100)), *model, optimizer);
  }, "cut.ckpt is not an amp8 checkpoint or is truncated");
  auto versioned = bytes;
  versioned[versioned.size() - 20] = 2;  // the trailer's format version
  ExpectErrorContaining([&] { trainer.load_checkpoint(write("v2.ckpt", versioned), *model, optimizer); },
                        "v2.ckpt has format version 2, this amp8 reads version 1");
  ASSERT_NO_THROW(trainer.load_checkpoint(good.string(), *model, optimizer));

  // A checkpoint of another model's shape: named, and nothing changes.
  {
    auto wide = torch::nn::Sequential(torch::nn::Linear(32, 48), torch::nn::ReLU(),
                                      torch::nn::Linear(48, 64), torch::nn::ReLU(),
                                      torch::nn::Linear(64, 16));
    torch::optim::Adam wide_optimizer(wide->parameters(), 1e-3);
    Trainer wide_trainer(TrainerOptions().log_every_n_steps(0), recipes::bf16_mixed());
    wide_trainer.save_checkpoint((dir / "wide.ckpt").string(), *wide, wide_optimizer);
    const auto weight = model->parameters()[0].detach().clone();
    ExpectErrorContaining([&] { trainer.load_checkpoint((dir / "wide.ckpt").string(), *model, optimizer); },
                          "wide.ckpt: 0.weight is Float [48, 32], the model's is BFloat16 [64, 32]");
    EXPECT_TRUE(model->parameters()[0].equal(weight));
    EXPECT_EQ(model->parameters()[0].sizes(), weight.sizes());
  }

  // A checkpoint whose optimizer state does not fit (SGD's, loaded into Adam): the model had
  // already been loaded when the optimizer failed; it is put back as it was.
  {
    torch::manual_seed(99);
    auto same_shape = testing::make_mlp();
    torch::optim::SGD sgd(same_shape->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    Trainer sgd_trainer(TrainerOptions().max_steps(1).log_every_n_steps(0), recipes::bf16_mixed());
    testing::MlpData data(2);
    sgd_trainer.fit(*same_shape, sgd, [&](const TrainStepInput& in) {
      auto [x, y] = data.batch(in.step, 0);
      return torch::mse_loss(in.precision.convert_output(same_shape->forward(in.precision.convert_input(x))), y);
    });
    sgd_trainer.save_checkpoint((dir / "sgd.ckpt").string(), *same_shape, sgd);
    std::vector<torch::Tensor> before_params;
    for (const auto& p : model->parameters()) before_params.push_back(p.detach().clone());
    ExpectErrorContaining([&] { trainer.load_checkpoint((dir / "sgd.ckpt").string(), *model, optimizer); },
                          "could not be loaded, nothing was changed");
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(before_params[i])) << i;
    EXPECT_FALSE(params[0].equal(same_shape->parameters()[0])) << "the checkpoint's weights differ";
  }

  // A checkpoint of another precision names both.
  trainer.save_checkpoint((dir / "bf16.ckpt").string(), *model, optimizer);
  auto other = testing::make_mlp();
  torch::optim::Adam other_optimizer(other->parameters(), 1e-3);
  Trainer fp16(TrainerOptions().log_every_n_steps(0), recipes::fp16_mixed());
  ExpectErrorContaining([&] { fp16.load_checkpoint((dir / "bf16.ckpt").string(), *other, other_optimizer); },
                        "the checkpoint was written with precision \"bf16-mixed\", this plugin is "
                        "\"16-mixed\"");
  ExpectErrorContaining([&] { fp16.fit(*other, other_optimizer, Trainer::TrainingStep{}, (dir / "nothing").string()); },
                        "training_step must be callable");
  const auto no_step = [](const TrainStepInput&) { return torch::zeros({1}); };
  Trainer no_dir(TrainerOptions().every_n_train_steps(5));
  ExpectErrorContaining([&] { no_dir.fit(*other, other_optimizer, no_step); },
                        "every_n_train_steps = 5 needs a checkpoint_dir");
  // Settings another one turns on (they were dropped without it).
  for (const auto& [options, message] : std::vector<std::pair<TrainerOptions, std::string>>{
           {TrainerOptions().cuda_graph_warmup_steps(5), "cuda_graph_warmup_steps = 5 applies with cuda_graph = true"},
           {TrainerOptions().flops_per_token(1e9), "flops_per_token (1e+09) needs tokens_per_micro_batch"},
           {TrainerOptions().tokens_per_micro_batch(64).peak_flops_per_device(1e15),
            "peak_flops_per_device (1e+15) needs flops_per_token and tokens_per_micro_batch"}}) {
    // Refused before the checkpoint folder is made.
    const auto refused_dir = dir / "refused";
    Trainer unused_setting(TrainerOptions(options).log_every_n_steps(0).checkpoint_dir(refused_dir.string()));
    ExpectErrorContaining([&] { unused_setting.fit(*other, other_optimizer, no_step); }, message);
    EXPECT_FALSE(fs::exists(refused_dir)) << message;
  }
}

// ---- StepProfiler: device time of a few steps, by category ----

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Kernel names as Kineto reports them on an H200 (cuBLASLt, flash attention, NCCL, ATen, amp8).
TEST(StepProfilerTest, CategorizesKernelsByName) {
  const std::vector<std::pair<std::string, KernelCategory>> cases = {
      {"nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN", KernelCategory::kGemm},
      {"sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_"
       "execute_segment_k_off_kernel__5x_cublas", KernelCategory::kGemm},
      {"void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_"
       "align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)",
       KernelCategory::kGemm},
      {"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
       "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, "
       "false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
       KernelCategory::kAttention},
      {"void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<"
       "64, 128, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>, true, true, false, false, "
       "false, false, false>(pytorch_flash::Flash_bwd_params)", KernelCategory::kAttention},
      {"fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
       "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
       KernelCategory::kAttention},
      {"ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
       KernelCategory::kCommunication},
      {"void amp8::cuda::(anonymous namespace)::layer_norm_fwd_kernel<__nv_bfloat16, 128, 8, 1>("
       "amp8::cuda::(anonymous namespace)::LayerNormFwdParams)", KernelCategory::kNorm},
      {"void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
       "float, false>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 "
       "const*, float*, float*, c10::BFloat16*)", KernelCategory::kNorm},
      {"void amp8::cuda::(anonymous namespace)::cast_transpose_kernel<__nv_bfloat16, "
       "__nv_fp8_e5m2, 128>(amp8::cuda::(anonymous namespace)::CastTransposeParams)",
       KernelCategory::kQuantize},
      {"void amp8::cuda::(anonymous namespace)::delayed_scaling_kernel<8>(amp8::cuda::"
       "ScalingGroupPointers const*, int, long, bool, float, float)", KernelCategory::kQuantize},
      {"void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
       "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
       "{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, "
       "at::native::(anonymous namespace)::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
       "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
       "std::array<char*, 2ul>)", KernelCategory::kQuantize},
      {"void amp8::cuda::(anonymous namespace)::fused_adam_kernel<__nv_bfloat16, "
       "__nv_bfloat16>(amp8::cuda::(anonymous namespace)::FusedAdamChunk)",
       KernelCategory::kOptimizer},
      {"void amp8::cuda::(anonymous namespace)::quantize_many_kernel<float, false>(amp8::cuda::"
       "multi_tensor::Table<amp8::cuda::QuantizeManyTensor>, amp8::cuda::QuantizeManyScalars)",
       KernelCategory::kQuantize},
      {"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
       "(anonymous namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::"
       "LpNormFunctor<float, (at::native::(anonymous namespace)::NormType)1, float, float>, "
       "float*, int>(at::native::(anonymous namespace)::TensorListMetadata<1>, ...)",
       KernelCategory::kOptimizer},
      // The gradient norm and the FP8 weights' amaxes after a step: the optimizer's, as the
      // _foreach_norm kernels they replace.
      {"void amp8::cuda::(anonymous namespace)::sum_of_squares_kernel<__nv_bfloat16>(amp8::cuda::"
       "multi_tensor::Table<amp8::cuda::SumOfSquaresTensor>, amp8::cuda::SumOfSquaresScalars)",
       KernelCategory::kOptimizer},
      {"void amp8::cuda::(anonymous namespace)::amax_many_kernel<float>(amp8::cuda::multi_tensor::"
       "Table<amp8::cuda::AmaxManyTensor>, amp8::cuda::AmaxManyScalars)",
       KernelCategory::kOptimizer},
      {"void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl("
       "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::"
       "{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >"
       "(int, ...)", KernelCategory::kElementwise},
      {"void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
       "at::native::func_wrapper_t<c10::BFloat16, at::native::sum_functor<c10::BFloat16, float, "
       "c10::BFloat16>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned "
       "int, c10::BFloat16, 4, 4> >(...)", KernelCategory::kElementwise},
      {"void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
       "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
       KernelCategory::kElementwise},
      {"Memcpy DtoD (Device -> Device)", KernelCategory::kMemory},
  };
  for (const auto& [name, expected] : cases) {
    EXPECT_STREQ(to_string(categorize_kernel(name)), to_string(expected)) << name;
  }
}

// Two steps in a 10 ms window: overlapping kernels count once in busy, fully in their
// categories; work outside the window is clipped; everything is per step.
TEST(StepProfilerTest, SummarizesTheWindowPerStep) {
  constexpr uint64_t ms = 1000000;
  const std::vector<DeviceActivity> activities = {
      {"nvjet_gemm_a", 1 * ms, 4 * ms},                 // 3 ms
      {"ncclDevKernel_AllReduce", 3 * ms, 7 * ms},      // 4 ms, 1 of them beside the GEMM
      {"nvjet_gemm_a", 7 * ms, 8 * ms},                 // 1 ms
      {"fused_adam_kernel", 9 * ms, 12 * ms},           // clipped to 1 ms
      {"gelu_kernel", 0, 2 * ms},                       // before the window: nothing counts
      {"Memcpy HtoD", 8 * ms + ms / 2, 9 * ms, /*is_memory=*/true},
  };
  const auto p = summarize_steps(activities, 2 * ms, 10 * ms, 2);
  EXPECT_EQ(p.steps, 2);
  EXPECT_DOUBLE_EQ(p.wall_ms, 4.0);
  // Union: [2, 8) + [8.5, 10) = 7.5 ms over 2 steps.
  EXPECT_DOUBLE_EQ(p.busy_ms, 3.75);
  EXPECT_DOUBLE_EQ(p.idle_ms, 0.25);
  // The GEMM before the window starts at 1 ms: 2 of its 3 ms fall inside.
  EXPECT_DOUBLE_EQ(p.category_ms[static_cast<int>(KernelCategory::kGemm)], 1.5);
  EXPECT_DOUBLE_EQ(p.category_ms[static_cast<int>(KernelCategory::kCommunication)], 2.0);
  EXPECT_DOUBLE_EQ(p.category_ms[static_cast<int>(KernelCategory::kOptimizer)], 0.5);
  EXPECT_DOUBLE_EQ(p.category_ms[static_cast<int>(KernelCategory::kMemory)], 0.25);
  EXPECT_DOUBLE_EQ(p.category_ms[static_cast<int>(KernelCategory::kElementwise)], 0.0);
  EXPECT_DOUBLE_EQ(p.kernels, 2.5);  // five activities touch the window
  ASSERT_FALSE(p.top_kernels.empty());
  EXPECT_EQ(p.top_kernels[0].first, "ncclDevKernel_AllReduce");
  EXPECT_NE(p.json().find("\"busy_ms\": 3.75"), std::string::npos) << p.json();
  EXPECT_NE(p.table().find("idle"), std::string::npos);
  ExpectErrorContaining([&] { summarize_steps(activities, 2 * ms, 10 * ms, 0); },
                        "steps must be >= 1, got 0");
  ExpectErrorContaining([&] { summarize_steps(activities, 10 * ms, 10 * ms, 1); },
                        "the window must end after it starts");
}

// Trains a small MLP with the profiler on steps 2..4: the trace holds exactly those steps, the
// summary and the log say so. On a GPU the device time is there too.
void profile_mlp_steps(const torch::Device& device) {
  auto model = testing::make_mlp();
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), 1e-3);
  Trainer trainer(TrainerOptions().max_steps(6).log_every_n_steps(0), recipes::bf16_mixed());
  std::ostringstream log;
  trainer.log = &log;
  const auto dir = testing::scratch_path("trainer_test", "profile_" + device.str());
  auto profiler = std::make_shared<StepProfiler>(dir.string(), 2, 3);
  trainer.callbacks.push_back(profiler);
  testing::MlpData data(3);
  trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
    auto [x, y] = data.batch(in.step, in.micro_batch);
    auto out = model->forward(in.precision.convert_input(x.to(device)));
    return torch::mse_loss(in.precision.convert_output(out), y.to(device));
  });
  ASSERT_TRUE(profiler->profile().has_value());
  const auto& p = *profiler->profile();
  EXPECT_EQ(p.steps, 3);
  EXPECT_GT(p.wall_ms, 0.0);
  EXPECT_GE(p.busy_ms, 0.0);
  EXPECT_LE(p.busy_ms, p.wall_ms);
  EXPECT_NEAR(p.idle_ms, p.wall_ms - p.busy_ms, 1e-9);
  // The host ran the three steps inside the window, and waited for the device at most that long.
  EXPECT_GT(p.host_ms, 0.0);
  EXPECT_LE(p.host_ms, p.wall_ms);
  EXPECT_GE(p.host_wait_ms, 0.0);
  EXPECT_LE(p.host_wait_ms, p.host_ms);
  EXPECT_NE(p.table().find("host (step)"), std::string::npos);
  EXPECT_NE(p.json().find("\"host_ms\": "), std::string::npos);
  const auto trace = read_text(dir / "trace.json");
  for (int step : {2, 3, 4}) {
    EXPECT_NE(trace.find("\"amp8::step " + std::to_string(step) + "\""), std::string::npos)
        << "step " << step;
  }
  EXPECT_EQ(trace.find("\"amp8::step 1\""), std::string::npos);
  EXPECT_EQ(trace.find("\"amp8::step 5\""), std::string::npos);
  EXPECT_NE(trace.find("aten::addmm"), std::string::npos);  // the CPU ops are recorded
  EXPECT_EQ(read_text(dir / "step_profile.json"), p.json() + "\n");
  EXPECT_EQ(read_text(dir / "step_profile.txt"), p.table());
  EXPECT_NE(log.str().find("profile of steps 2..4 (0-based) in " + dir.string()), std::string::npos)
      << log.str();
  if (device.is_cuda()) {
    EXPECT_GT(p.busy_ms, 0.0);
    EXPECT_GT(p.category_ms[static_cast<int>(KernelCategory::kGemm)], 0.0);
    EXPECT_GT(p.category_ms[static_cast<int>(KernelCategory::kOptimizer)], 0.0);
    // One stream: nothing overlaps, so the categories add up to the busy time.
    double sum = 0;
    for (double ms : p.category_ms) sum += ms;
    EXPECT_NEAR(sum, p.busy_ms, 0.01 * p.busy_ms);
  } else {
    EXPECT_EQ(p.kernels, 0.0);
    EXPECT_EQ(p.busy_ms, 0.0);
  }
}

TEST(StepProfilerTest, ProfilesTrainerSteps) { profile_mlp_steps(torch::kCPU); }

TEST(StepProfilerTest, ProfilesTrainerSteps_CUDA) {
  AMP8_REQUIRE_CUDA();
  profile_mlp_steps(torch::kCUDA);
}

// A list of FP32 and bf16 gradients of awkward sizes (a mixed-precision step's main grads
// beside half ones): the norm is the float32 norm of all of them, clipping scales each.
std::vector<at::Tensor> mixed_gradients(const torch::Device& device) {
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 30; ++i) {
    grads.push_back(torch::randn({7 + 13 * i}, device));
    grads.push_back(torch::randn({5 + 11 * i, 3}, device).to(torch::kBFloat16));
  }
  return grads;
}

void expect_mixed_norm_and_clip(const torch::Device& device) {
  torch::manual_seed(3);
  auto grads = mixed_gradients(device);
  double expected_sq = 0;
  for (const auto& g : grads) expected_sq += g.to(torch::kDouble).pow(2).sum().item<double>();
  const double expected = std::sqrt(expected_sq);
  EXPECT_NEAR(global_grad_norm(grads), expected, 1e-5 * expected);
  std::vector<at::Tensor> before;
  for (const auto& g : grads) before.push_back(g.clone());
  const double norm = clip_grad_norm_(grads, expected / 4);
  EXPECT_NEAR(norm, expected, 1e-5 * expected);
  const double coef = clip_coefficient(norm, expected / 4);
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(torch::allclose(grads[i].to(torch::kFloat), (before[i] * coef).to(torch::kFloat), 1e-2, 1e-6))
        << "gradient " << i << " (" << grads[i].scalar_type() << ")";
  }
}

TEST(GradClipTest, MixedDtypeNormAndClip) { expect_mixed_norm_and_clip(torch::kCPU); }

// On the GPU the mixed list takes amp8's multi-tensor sum of squares (a launch per dtype and
// ATen's sum of the chunks), not one norm per tensor: counted and named with the profiler.
TEST(GradClipTest, MixedDtypeNormAndClip_CUDA) {
  AMP8_REQUIRE_CUDA();
  expect_mixed_norm_and_clip(torch::kCUDA);
  auto grads = mixed_gradients(torch::kCUDA);
  global_grad_norm(grads);  // warm-up
  StepRecorder recorder;
  recorder.start();
  recorder.begin_step(0);
  global_grad_norm(grads);
  recorder.end_step();
  const auto profile = recorder.stop(testing::scratch_path("trainer_test", "norm_profile").string());
  EXPECT_GT(profile.kernels, 0.0);
  EXPECT_LT(profile.kernels, 20.0) << "60 gradients, two dtypes: " << profile.table();
  bool multi_tensor_norm = false;
  for (const auto& [name, ms] : profile.top_kernels) {
    multi_tensor_norm = multi_tensor_norm || name.find("sum_of_squares_kernel") != std::string::npos;
  }
  EXPECT_TRUE(multi_tensor_norm) << "amp8's sum_of_squares, not one norm per tensor: " << profile.table();
}

TEST(StepProfilerTest, BadArgumentsAreNamed) {
  ExpectErrorContaining([] { StepProfiler("", 1, 1); }, "dir must name a folder");
  ExpectErrorContaining([] { StepProfiler("x", -1, 1); }, "first_step must be >= 0, got -1");
  ExpectErrorContaining([] { StepProfiler("x", 0, 0); }, "steps must be >= 1, got 0");
  StepRecorder recorder;
  ExpectErrorContaining([&] { recorder.begin_step(0); }, "not recording");
  ExpectErrorContaining([&] { recorder.stop("x"); }, "not recording");
}

}  // namespace
}  // namespace amp8
