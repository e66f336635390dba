// Long-run robustness: repeated save/load/resume cycles keep memory flat (and LeakSanitizer,
// in CI's sanitizer stage, finds nothing unreachable at exit).

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>

#include "plugin/mixed_precision_plugin.h"
#include "plugin/trainer.h"
#include "recipes/precision.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define AMP8_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AMP8_UNDER_ASAN 1
#endif
#endif

namespace amp8 {
namespace {

// Resident set size in bytes (Linux).
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
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

}  // namespace
}  // namespace amp8
