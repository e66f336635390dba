// Robustness of long runs: non-finite activations and gradients never reach the weights or the
// FP8 scales, training recovers from an injected overflow, and repeated save/load/resume
// cycles keep memory flat (LeakSanitizer, in CI's sanitizer stage, checks for leaks at exit).

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <iostream>
#include <memory>

#include "plugin/fp8/fp8_autocast.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/trainer.h"
#include "recipes/precision.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

// Resident set size in bytes (Linux).
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

bool all_finite(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (!torch::isfinite(p.detach().to(at::kFloat)).all().item<bool>()) return false;
  }
  return true;
}

std::vector<torch::Tensor> snapshot(torch::nn::Module& model) {
  std::vector<torch::Tensor> values;
  for (const auto& p : model.parameters()) values.push_back(p.detach().clone());
  return values;
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].equal(b[i])) return false;
  }
  return true;
}

// A term that is 0 in the forward pass and NaN in the backward pass (d sqrt(u)/du at u = 0 is
// inf, times 0): a finite loss whose gradient is not finite.
torch::Tensor nan_gradient_term(torch::nn::Module& model) {
  torch::Tensor p;
  for (const auto& param : model.parameters()) {
    if (param.requires_grad()) {  // not an FP8 weight (fp8_params): those hold no autograd
      p = param;
      break;
    }
  }
  return 0.0 * torch::sqrt(p - p.detach()).sum().to(at::kFloat);
}

TEST(HardeningTest, NanInActivationsNeverPoisonsFp8Scales) {
  torch::manual_seed(1);
  Fp8Linear layer(Fp8LinearOptions(32, 32).fp8_amax_history_len(4).fp8_min_gemm_size(0));
  const auto recipe = Fp8RecipeOptions().fp8_amax_history_len(4);
  auto step = [&](const torch::Tensor& x) {
    {
      Fp8Autocast region(recipe);
      auto y = layer->forward(x);
      y.sum().backward();
    }
    layer->zero_grad();
  };
  for (int i = 0; i < 3; ++i) step(torch::randn({16, 32}));
  const auto fwd = layer->fp8_fwd_scale.clone(), bwd = layer->fp8_bwd_scale.clone();
  auto poisoned = torch::randn({16, 32});
  poisoned[3][5] = std::numeric_limits<float>::quiet_NaN();
  poisoned[7][1] = std::numeric_limits<float>::infinity();
  step(poisoned);
  // The NaN/inf amax is in the history window: every scale keeps its previous value.
  EXPECT_TRUE(layer->fp8_fwd_scale.equal(fwd)) << layer->fp8_fwd_scale << " vs " << fwd;
  EXPECT_TRUE(layer->fp8_bwd_scale.equal(bwd)) << layer->fp8_bwd_scale << " vs " << bwd;
  EXPECT_TRUE(torch::isfinite(layer->fp8_fwd_scale_inv).all().item<bool>());
  // Once the non-finite amax has left the window (history 4), the scales follow the data again.
  for (int i = 0; i < 4; ++i) step(torch::randn({16, 32}) * 100.0);
  EXPECT_FALSE(layer->fp8_fwd_scale.equal(fwd)) << "the scales move again";
  EXPECT_TRUE(torch::isfinite(layer->fp8_fwd_scale).all().item<bool>());
}

TEST(HardeningTest, NonFiniteGradientWithFiniteLossStopsOrSkipsWithoutTouchingTheWeights) {
  const testing::MlpData data(4);
  for (const char* policy : {"error", "skip"}) {
    for (const auto& options : {recipes::bf16_mixed(), recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0)}) {
      SCOPED_TRACE(std::string(policy) + ", " + MixedPrecisionPlugin(options).name());
      torch::manual_seed(4);
      auto model = testing::make_mlp();
      torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
      Trainer trainer(TrainerOptions().max_steps(6).log_every_n_steps(0).nonfinite_loss(policy), options);
      std::vector<torch::Tensor> before_bad_step;
      auto step_fn = [&](const TrainStepInput& in) {
        auto [x, y] = data.batch(in.step, in.micro_batch, 16);
        auto loss = torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
        if (in.step == 3) {
          before_bad_step = snapshot(*model);
          loss = loss + nan_gradient_term(*model);
        }
        return loss;
      };
      if (std::string(policy) == "error") {
        try {
          trainer.fit(*model, optimizer, step_fn);
          ADD_FAILURE() << "a NaN gradient must stop the run";
        } catch (const c10::Error& e) {
          const std::string message = e.what_without_backtrace();
          EXPECT_NE(message.find("non-finite gradient norm ("), std::string::npos) << message;
          EXPECT_NE(message.find("nan) at step 4 with a finite loss"), std::string::npos) << message;
        }
        EXPECT_EQ(trainer.global_step(), 3);
        EXPECT_TRUE(same(snapshot(*model), before_bad_step)) << "the weights are those after step 3";
      } else {
        trainer.fit(*model, optimizer, step_fn);
        ASSERT_EQ(trainer.history().size(), 6u);
        EXPECT_FALSE(trainer.history()[3].stepped);
        EXPECT_TRUE(trainer.history()[4].stepped);
        EXPECT_EQ(trainer.plugins->skipped_steps(), 1);
      }
      EXPECT_TRUE(all_finite(*model));
    }
  }
}

TEST(HardeningTest, Fp16RecoversWithinTheHysteresisWindowAfterAnInjectedOverflow) {
  const testing::MlpData data(5);
  auto run = [&](bool inject) {
    torch::manual_seed(5);
    auto model = testing::make_mlp();
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    Trainer trainer(TrainerOptions().max_steps(40).log_every_n_steps(0),  // nonfinite_loss "error"
                    recipes::fp16_mixed().fp16_initial_loss_scale(1024).fp16_hysteresis(2));
    trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
      auto [x, y] = data.batch(in.step, in.micro_batch, 32);
      auto loss = torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
      return inject && (in.step == 10 || in.step == 11) ? loss + nan_gradient_term(*model) : loss;
    });
    EXPECT_TRUE(all_finite(*model));
    return trainer.history();
  };
  const auto clean = run(false), injected = run(true);
  // Two overflows in a row: hysteresis 2 absorbs the first, the second halves the scale; both
  // steps are skipped (not an error: the scaler owns fp16 overflows), the next ones are taken.
  EXPECT_FALSE(injected[10].stepped);
  EXPECT_FALSE(injected[11].stepped);
  EXPECT_EQ(injected[10].loss_scale, 1024.0);
  EXPECT_EQ(injected[11].loss_scale, 512.0);
  for (size_t i = 12; i < injected.size(); ++i) EXPECT_TRUE(injected[i].stepped) << "step " << i + 1;
  EXPECT_EQ(injected.back().skipped_steps, clean.back().skipped_steps + 2);
  // Two lost steps out of 40 barely move the end of training.
  EXPECT_NEAR(injected.back().loss, clean.back().loss, 0.02 * clean.back().loss);
}

TEST(HardeningTest, HundredSaveLoadResumeCyclesKeepMemoryFlat) {
  const auto dir = testing::scratch_path("HardeningTest", "cycles");
  std::filesystem::create_directories(dir);
  const auto path = (dir / "cycle.ckpt").string();
  const testing::MlpData data(3);
  // fp16 + FP8 with fp8_params: every kind of state a checkpoint holds (masters, loss scaler,
  // FP8 metadata and FP8 weights, AdamW state, RNG states).
  const auto options = recipes::fp16_with_fp8_mixed().fp8_min_gemm_size(0).fp16_initial_loss_scale(1024);
  auto cycle = [&](int64_t step) {
    torch::manual_seed(3);
    auto model = testing::make_mlp();  // the plugin converts it (FP8 weights under fp8_params)
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    Trainer trainer(TrainerOptions().max_steps(step + 1).log_every_n_steps(0), options);
    trainer.fit(*model, optimizer,
                [&](const TrainStepInput& in) {
                  auto [x, y] = data.batch(in.step, in.micro_batch, 16);
                  return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
                },
                step == 0 ? "" : path);  // resume from the previous cycle's checkpoint
    EXPECT_EQ(trainer.global_step(), step + 1);
    trainer.save_checkpoint(path, *model, optimizer);
  };
  for (int64_t step = 0; step < 10; ++step) cycle(step);  // allocator and caches warm up
  const double before = resident_bytes();
  for (int64_t step = 10; step < 110; ++step) cycle(step);
  const double growth = resident_bytes() - before;
  std::cout << "resident memory over 100 save/load/resume cycles: " << before / 1e6 << " MB -> "
            << (before + growth) / 1e6 << " MB\n";
#ifndef AMP8_UNDER_ASAN
  // A leaked checkpoint's worth per cycle (the archive of this MLP is ~100 KB) would add ~10 MB
  // over 100 cycles; allow 4 MB of allocator noise.
  EXPECT_LT(growth, 4e6) << "resident memory grew by " << growth / 1e6 << " MB over 100 cycles";
#else
  (void)growth;  // ASan's quarantine holds freed memory; LeakSanitizer checks leaks at exit
#endif
  testing::remove_tree(dir);
}

// The test suites' scratch folders (tests/test_util.h) go when the process that made them ends,
// and a forked child (some tests fork) removes its own but leaves its parent's alone.
TEST(HardeningTest, ScratchFoldersAreRemovedByTheProcessThatMadeThemOnly) {
  const auto temp = std::filesystem::temp_directory_path();
  const auto folder = temp / ("amp8_scratch_folders_" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder / "inner");
  std::ofstream(folder / "inner" / "file") << "scratch";
  auto* folders = new testing::ScratchFolders;
  folders->add(folder);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const auto own = temp / ("amp8_scratch_folders_" + std::to_string(::getpid()));
    std::filesystem::create_directories(own);
    folders->add(own);
    delete folders;  // the child's copy of the object ends first
    const bool parents_kept = std::filesystem::exists(folder / "inner" / "file");
    const bool own_removed = !std::filesystem::exists(own);
    ::_exit(parents_kept ? (own_removed ? 0 : 2) : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 1) << "a forked child removed its parent's scratch folder";
  EXPECT_NE(WEXITSTATUS(status), 2) << "a forked child left its own scratch folder";
  EXPECT_TRUE(std::filesystem::exists(folder / "inner" / "file"));
  delete folders;
  EXPECT_FALSE(std::filesystem::exists(folder)) << "the scratch folder outlived the object that owns it";
  testing::remove_tree(folder.string());
  testing::remove_tree((temp / ("amp8_scratch_folders_" + std::to_string(child))).string());
  EXPECT_THROW(testing::scratch_path("HardeningTest", "/absolute"), std::invalid_argument);
}

}  // namespace
}  // namespace amp8
