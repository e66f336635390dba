#include "recipes/gpt/callbacks.h"

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>

#include "recipes/gpt/pretrain.h"
#include "recipes/gpt/run_folder.h"

namespace amp8::recipes {
namespace {

constexpr double kPi = 3.14159265358979323846;

// The median of `values` (reordered); 0 when empty.
double median(std::vector<double> values) {
  if (values.empty()) return 0;
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

}  // namespace

LearningRateSchedule::LearningRateSchedule(torch::optim::Optimizer& optimizer, const PretrainRecipe& recipe)
    : optimizer_(optimizer), recipe_(recipe) {}

void LearningRateSchedule::on_train_batch_start(Trainer&, int64_t step) {
  lr_ = rate(step);
  for (auto& group : optimizer_.param_groups()) group.options().set_lr(lr_);
}

double LearningRateSchedule::rate(int64_t step) const {
  const int64_t warmup = recipe_.warmup_steps, total = recipe_.trainer.max_steps();
  if (step < warmup) return recipe_.lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress =
      total > warmup ? static_cast<double>(step - warmup) / static_cast<double>(total - warmup) : 1.0;
  return recipe_.min_lr + 0.5 * (recipe_.lr - recipe_.min_lr) * (1.0 + std::cos(kPi * std::min(1.0, progress)));
}

void StepTimer::on_train_start(Trainer&) { last_ = std::chrono::steady_clock::now(); }

void StepTimer::on_train_batch_end(Trainer&, const StepMetrics&) {
  const auto now = std::chrono::steady_clock::now();
  seconds_.push_back(std::chrono::duration<double>(now - last_).count());
  last_ = now;
}

double StepTimer::steady_step_seconds() const {
  return median({seconds_.begin() + static_cast<std::ptrdiff_t>(seconds_.size() / 2), seconds_.end()});
}

Evaluator::Evaluator(int64_t every, int64_t iters, Batch batch, Decoder model, int64_t vocab, std::ostream& out)
    : every_(every), iters_(iters), batch_(std::move(batch)), model_(std::move(model)), vocab_(vocab), out_(out),
      loss_(NAN) {}

void Evaluator::on_train_batch_end(Trainer& trainer, const StepMetrics& m) {
  if (m.step % every_ != 0 && m.step != trainer.options.max_steps()) return;
  auto& precision = *trainer.plugins;
  torch::NoGradGuard no_grad;
  model_.module().eval();
  at::Tensor sum;
  for (int64_t k = 0; k < iters_; ++k) {
    auto [inputs, targets] = batch_(k);
    auto context = precision.forward_context();
    auto logits = precision.convert_output(model_.forward(precision.convert_input(inputs)));
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, vocab_}), targets.reshape({-1}))
                    .to(at::kFloat);
    context.close();
    sum = sum.defined() ? sum + loss : loss;
  }
  model_.module().train();
  step_ = m.step;
  loss_ = precision.data_parallel_mean(sum.reshape({})).item<double>() / static_cast<double>(iters_);
  points_.emplace_back(static_cast<double>(m.step), loss_);
  char line[128];
  std::snprintf(line, sizeof(line), "validation at step %lld | loss %.4f | perplexity %.3f",
                static_cast<long long>(m.step), loss_, std::exp(loss_));
  out_ << line << std::endl;
}

void CommunicationTimer::on_train_batch_end(Trainer&, const StepMetrics& m) {
  if (m.step % 50 == 0) collect();
}

void CommunicationTimer::on_train_end(Trainer&) { collect(); }

DistributedOptimizer::StepCommunication CommunicationTimer::steady() const {
  DistributedOptimizer::StepCommunication result;
  if (steps_.empty()) return result;
  const auto tail_begin = steps_.begin() + static_cast<std::ptrdiff_t>(steps_.size() / 2);
  auto tail_median = [&](auto field) {
    std::vector<double> values;
    for (auto s = tail_begin; s != steps_.end(); ++s) values.push_back(static_cast<double>((*s).*field));
    return median(std::move(values));
  };
  result.reduce_ms = tail_median(&DistributedOptimizer::StepCommunication::reduce_ms);
  result.gather_ms = tail_median(&DistributedOptimizer::StepCommunication::gather_ms);
  result.reduce_bytes = static_cast<int64_t>(tail_median(&DistributedOptimizer::StepCommunication::reduce_bytes));
  result.gather_bytes = static_cast<int64_t>(tail_median(&DistributedOptimizer::StepCommunication::gather_bytes));
  return result;
}

void CommunicationTimer::collect() {
  auto* optimizer = plugin_.distributed_optimizer();  // made when the Trainer connects
  if (optimizer == nullptr) return;
  for (const auto& s : optimizer->take_communication_times()) steps_.push_back(s);
}

MetricsWriter::MetricsWriter(std::string path, const LearningRateSchedule& schedule, int64_t tokens_per_step,
                             double flops_per_token_per_device, double peak_flops, const Evaluator* validation)
    : path_(std::move(path)), schedule_(schedule), tokens_per_step_(static_cast<double>(tokens_per_step)),
      flops_per_token_per_device_(flops_per_token_per_device), peak_flops_(peak_flops), validation_(validation) {}

void MetricsWriter::on_train_start(Trainer& trainer) {
  trim_metrics(path_, trainer.global_step());
  out_.open(path_, std::ios::app);
  TORCH_CHECK(out_.good(), "cannot write the metrics file ", path_);
  last_ = std::chrono::steady_clock::now();
}

void MetricsWriter::on_train_batch_end(Trainer&, const StepMetrics& m) {
  const auto now = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(now - last_).count();
  last_ = now;
  nlohmann::json line = {{"step", m.step},
                         {"loss", m.loss},
                         {"lr", schedule_.lr()},
                         {"loss_scale", m.loss_scale},
                         {"skipped_steps", m.skipped_steps},
                         {"stepped", m.stepped},
                         {"tokens_per_s", seconds > 0 ? tokens_per_step_ / seconds : 0.0}};
  if (std::isfinite(m.grad_norm)) line["grad_norm"] = m.grad_norm;
  // Model TFLOP/s per GPU, and MFU against the GPU's dense bf16 peak when it is known.
  const double tflops = seconds > 0 ? tokens_per_step_ / seconds * flops_per_token_per_device_ / 1e12 : 0.0;
  line["model_tflops_per_gpu"] = tflops;
  if (peak_flops_ > 0) line["mfu"] = tflops * 1e12 / peak_flops_;
  if (validation_ != nullptr && validation_->step() == m.step) {
    line["val_loss"] = validation_->loss();
    line["val_ppl"] = std::exp(validation_->loss());
  }
  out_ << line.dump() << "\n";
  out_.flush();
  TORCH_CHECK(out_.good(), "writing the metrics file ", path_, " failed (is the disk full?)");
}

}  // namespace amp8::recipes
