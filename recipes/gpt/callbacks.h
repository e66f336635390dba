#pragma once

// The Trainer callbacks of the GPT pretraining recipe: learning-rate schedule, step timing,
// validation, data-parallel communication timing and the metrics file.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "plugin/distributed/distributed_optimizer.h"
#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/trainer.h"
#include "recipes/gpt/decoder.h"

namespace amp8::recipes {

struct PretrainRecipe;

/// Linear warm-up to recipe.lr over recipe.warmup_steps, then cosine decay to recipe.min_lr at
/// the trainer's max_steps; sets every param group's lr before each step.
class LearningRateSchedule : public Callback {
 public:
  LearningRateSchedule(torch::optim::Optimizer& optimizer, const PretrainRecipe& recipe);
  void on_train_batch_start(Trainer& trainer, int64_t step) override;
  /// The rate of the current step.
  double lr() const { return lr_; }
  /// The rate of `step` (0-based).
  double rate(int64_t step) const;

 private:
  torch::optim::Optimizer& optimizer_;
  const PretrainRecipe& recipe_;
  double lr_ = 0;
};

/// The wall time of every step (end to end, as the host sees it after the loss is read).
class StepTimer : public Callback {
 public:
  void on_train_start(Trainer&) override;
  void on_train_batch_end(Trainer&, const StepMetrics&) override;
  /// Median step time over the second half of the steps (0 without steps).
  double steady_step_seconds() const;

 private:
  std::chrono::steady_clock::time_point last_;
  std::vector<double> seconds_;
};

/// Validation loss every `every` steps and after the last one: the same `iters` held-out
/// micro-batches each time (so evaluations compare, and a resume does not change them), in the
/// training precision, without gradients; the mean over data-parallel ranks. Prints one line
/// per evaluation to `out`.
class Evaluator : public Callback {
 public:
  /// The k-th held-out micro-batch: (inputs, targets).
  using Batch = std::function<std::pair<at::Tensor, at::Tensor>(int64_t k)>;
  Evaluator(int64_t every, int64_t iters, Batch batch, Decoder model, int64_t vocab, std::ostream& out);
  void on_train_batch_end(Trainer& trainer, const StepMetrics& m) override;
  /// The step of the latest evaluation (-1 before the first) and its loss.
  int64_t step() const { return step_; }
  double loss() const { return loss_; }
  /// (step, loss) of every evaluation.
  const std::vector<std::pair<double, double>>& points() const { return points_; }

 private:
  int64_t every_, iters_;
  Batch batch_;
  Decoder model_;
  int64_t vocab_;
  std::ostream& out_;
  int64_t step_ = -1;
  double loss_;
  std::vector<std::pair<double, double>> points_;
};

/// Data-parallel on CUDA: the DistributedOptimizer's per-step communication waits, collected
/// every 50 steps (reading them waits for the GPU, so not every step) and at the end.
class CommunicationTimer : public Callback {
 public:
  explicit CommunicationTimer(MixedPrecisionPlugin& plugin) : plugin_(plugin) {}
  void on_train_batch_end(Trainer&, const StepMetrics& m) override;
  void on_train_end(Trainer&) override;
  /// Medians over the second half of the steps measured.
  DistributedOptimizer::StepCommunication steady() const;

 private:
  void collect();
  MixedPrecisionPlugin& plugin_;
  std::vector<DistributedOptimizer::StepCommunication> steps_;
};

/// One JSON object per step into metrics.jsonl (step, loss, lr, loss_scale, skipped_steps,
/// stepped, tokens_per_s, grad_norm, model_tflops_per_gpu, mfu, val_loss, val_ppl). On a resume
/// the file is first cut back to the checkpoint's step, so steps run again after a crash are
/// not listed twice.
class MetricsWriter : public Callback {
 public:
  /// `validation`: read after it evaluated at the same step (register it before this writer),
  /// or null. `peak_flops` 0: no mfu field.
  MetricsWriter(std::string path, const LearningRateSchedule& schedule, int64_t tokens_per_step,
                double flops_per_token_per_device, double peak_flops, const Evaluator* validation);
  void on_train_start(Trainer& trainer) override;
  void on_train_batch_end(Trainer& trainer, const StepMetrics& m) override;

 private:
  std::string path_;
  std::ofstream out_;
  const LearningRateSchedule& schedule_;
  double tokens_per_step_, flops_per_token_per_device_, peak_flops_;
  const Evaluator* validation_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace amp8::recipes
