#include "plugin/training/trainer.h"

// The training loop, its progress line and the stop signals. Checkpoint files:
// trainer_checkpoint.cc.

#include <signal.h>
#include <stdlib.h>
#include <time.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>

#include <ATen/Context.h>

#include "plugin/training/checkpoint.h"
#include "plugin/training/cuda_graph.h"

namespace amp8 {
namespace {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const auto total = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (total >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(total / 3600),
                  static_cast<long long>(total / 60 % 60), static_cast<long long>(total % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%02lld:%02lld", static_cast<long long>(total / 60),
                  static_cast<long long>(total % 60));
  }
  return buf;
}

}  // namespace

void use_deterministic_algorithms() {
  // Not overwritten: a user's own setting (e.g. ":16:8") stands.
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  auto& context = at::globalContext();
  context.setDeterministicAlgorithms(true, /*warn_only=*/false);
  // PyTorch's deterministic mode also fills every new tensor with NaN (or the integer maximum),
  // in case an op reads memory it never wrote: one fill kernel per allocation, ~600 per step of
  // the 350m GPT (blockwise FP8 runs 1.17x faster without them; bench/results/
  // deterministic_no_fill/). No op on amp8's training paths reads memory it did not write, and
  // runs repeat bit for bit without the fill (the GPU resume test runs with these settings), so
  // it is off.
  context.setDeterministicFillUninitializedMemory(false);
  context.setDeterministicCuDNN(true);
  context.setBenchmarkCuDNN(false);
}

PluginHandle::PluginHandle(std::shared_ptr<PrecisionPlugin> plugin) : plugin_(std::move(plugin)) {
  TORCH_CHECK(plugin_ != nullptr, "Trainer: plugins must not be null");
}

Trainer::Trainer(TrainerOptions options_, PluginHandle plugins_)
    : options(std::move(options_)), plugins(std::move(plugins_)), log(&std::cout) {}

void Trainer::connect(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  if (connected_model_ == &model) return;
  TORCH_CHECK(connected_model_ == nullptr,
              "Trainer: this trainer's plugin is connected to another model; use one Trainer per "
              "model");
  plugins->connect(model, optimizer);
  connected_model_ = &model;
}

namespace {

// One micro-batch: its loss from `compute_loss` inside the plugin's forward context (closed
// explicitly, so that the FP8 scale update's errors surface here, not in a destructor), then its
// backward pass (the loss divided over the step's micro-batches); the loss, detached, for the
// step's mean.
template <typename ComputeLoss>
torch::Tensor run_micro_batch(PrecisionPlugin& precision, int64_t micro_batches,
                              ComputeLoss&& compute_loss) {
  torch::Tensor loss;
  {
    auto context = precision.forward_context();
    loss = compute_loss();
    context.close();
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "Trainer: the training step must return a loss with one element, got ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  precision.backward(micro_batches > 1 ? loss / static_cast<double>(micro_batches) : loss);
  return loss.detach().to(at::kFloat).reshape({});
}

}  // namespace

void Trainer::fit(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                  const TrainingStep& training_step, const std::string& ckpt_path) {
  TORCH_CHECK(static_cast<bool>(training_step), "Trainer::fit: training_step must be callable");
  TORCH_CHECK(!options.cuda_graph(), "Trainer: cuda_graph needs the training step split into its host "
              "part (the micro-batch's tensors) and its device part (the loss from them): call fit "
              "with a GraphableStep");
  const int64_t micro_batches = options.accumulate_grad_batches();
  fit_loop(model, optimizer, [&](const TrainStepInput& in) {
    return run_micro_batch(in.precision, micro_batches, [&] { return training_step(in); });
  }, ckpt_path);
}

void Trainer::fit(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const GraphableStep& step,
                  const std::string& ckpt_path) {
  TORCH_CHECK(static_cast<bool>(step.batch) && static_cast<bool>(step.loss),
              "Trainer::fit: the GraphableStep's batch and loss must both be callable");
  TORCH_CHECK(options.cuda_graph_warmup_steps() >= 1, "cuda_graph_warmup_steps must be >= 1, got ",
              options.cuda_graph_warmup_steps());
  const int64_t micro_batches = options.accumulate_grad_batches();
  auto& precision = *plugins;
  const auto forward_backward = [&](const std::vector<torch::Tensor>& inputs) {
    return run_micro_batch(precision, micro_batches, [&] { return step.loss(inputs, precision); });
  };
  if (!options.cuda_graph()) {
    fit_loop(model, optimizer, [&](const TrainStepInput& in) { return forward_backward(step.batch(in)); },
             ckpt_path);
    return;
  }
  std::unique_ptr<CudaGraphedMicroBatch> graphed;
  int64_t first_step = -1;
  fit_loop(model, optimizer, [&](const TrainStepInput& in) {
    if (!graphed) {
      // Here, not before fit_loop: the plugin is connected (and a checkpoint loaded) by now.
      const auto problem = precision.cuda_graph_problem();
      TORCH_CHECK(problem.empty(), "Trainer: cuda_graph: ", problem);
      graphed = std::make_unique<CudaGraphedMicroBatch>(model);
      first_step = in.step;
    }
    const auto inputs = step.batch(in);
    if (in.step - first_step < options.cuda_graph_warmup_steps()) return graphed->run_eager(inputs, forward_backward);
    if (!graphed->captured()) {
      precision.use_static_gradients();
      return graphed->capture_and_run(inputs, forward_backward);
    }
    auto loss = graphed->replay(inputs);
    precision.backward_replayed();
    return loss;
  }, ckpt_path);
}

void Trainer::fit_loop(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                       const MicroBatch& micro_batch, const std::string& ckpt_path) {
  TORCH_CHECK(options.max_steps() >= 0, "max_steps must be >= 0, got ", options.max_steps());
  TORCH_CHECK(options.accumulate_grad_batches() >= 1, "accumulate_grad_batches must be >= 1, got ",
              options.accumulate_grad_batches());
  TORCH_CHECK(options.log_every_n_steps() >= 0, "log_every_n_steps must be >= 0, got ",
              options.log_every_n_steps());
  TORCH_CHECK(options.gradient_clip_val() >= 0 && std::isfinite(options.gradient_clip_val()),
              "gradient_clip_val must be >= 0, got ", options.gradient_clip_val());
  TORCH_CHECK(options.every_n_train_steps() >= 0, "every_n_train_steps must be >= 0, got ",
              options.every_n_train_steps());
  TORCH_CHECK(options.nonfinite_loss() == "error" || options.nonfinite_loss() == "skip",
              "nonfinite_loss must be \"error\" or \"skip\", got \"", options.nonfinite_loss(), "\"");
  // Settings that only another one turns on would be dropped: errors instead, before anything
  // is written.
  const TrainerOptions defaults;
  TORCH_CHECK(options.cuda_graph() || options.cuda_graph_warmup_steps() == defaults.cuda_graph_warmup_steps(),
              "cuda_graph_warmup_steps = ", options.cuda_graph_warmup_steps(), " applies with cuda_graph = true");
  TORCH_CHECK(options.flops_per_token() == 0.0 || options.tokens_per_micro_batch() > 0, "flops_per_token (",
              options.flops_per_token(), ") needs tokens_per_micro_batch: the TFLOP/s figure is tokens/s x "
              "flops_per_token");
  TORCH_CHECK(options.peak_flops_per_device() == 0.0 || options.flops_per_token() > 0.0, "peak_flops_per_device (",
              options.peak_flops_per_device(), ") needs flops_per_token and tokens_per_micro_batch: MFU is the "
              "model FLOP/s per device over the peak");
  TORCH_CHECK(options.every_n_train_steps() == 0 || !options.checkpoint_dir().empty(),
              "every_n_train_steps = ", options.every_n_train_steps(),
              " needs a checkpoint_dir to write to");
  if (!options.checkpoint_dir().empty()) {
    std::error_code error;
    std::filesystem::create_directories(options.checkpoint_dir(), error);
    TORCH_CHECK(std::filesystem::is_directory(options.checkpoint_dir()), "checkpoint_dir ",
                options.checkpoint_dir(), " is not a folder and cannot be created");
    const auto removed = remove_stale_temporaries(options.checkpoint_dir());
    if (!removed.empty()) {
      *log << "Trainer: removed " << removed.size() << " temporary file(s) of interrupted saves in "
           << options.checkpoint_dir() << std::endl;
    }
  }

  if (options.deterministic()) use_deterministic_algorithms();
  connect(model, optimizer);
  if (!ckpt_path.empty()) {
    // Where the ranks' collectives below run: the model's device.
    const auto parameters = model.parameters();
    const auto device = parameters.empty() ? torch::Device(torch::kCPU) : parameters.front().device();
    std::string path = ckpt_path;
    if (std::filesystem::is_directory(ckpt_path)) {
      path = agreed_latest_checkpoint(ckpt_path, *plugins, device, *log);
      TORCH_CHECK(!path.empty(), "Trainer::fit: no complete ",
                  checkpoint_name(0, plugins->data_parallel_rank(), plugins->data_parallel_size())
                      .replace(5, 8, "<N>"),
                  " checkpoint in ", ckpt_path);
    }
    load_checkpoint(path, model, optimizer);
    if (plugins->data_parallel_size() > 1) {
      // Every rank continues from the same step (a folder's ranks agreed above; files given one
      // per rank, as gpt_pretrain does, may differ): the steps are all equal iff
      // mean(s^2) == mean(s)^2.
      const auto s = static_cast<double>(global_step_);
      const auto mean = plugins->data_parallel_mean(torch::tensor({s, s * s}, torch::dtype(torch::kDouble).device(device))).cpu();
      TORCH_CHECK(mean[1].item<double>() == mean[0].item<double>() * mean[0].item<double>(),
                  "Trainer::fit: the data-parallel ranks resumed from different steps (rank ",
                  plugins->data_parallel_rank(), ": step ", global_step_, ", from ", path,
                  "); give every rank the checkpoints of one step");
    }
  }
  stopped_ = false;
  last_checkpoint_.clear();
  model.train();
  for (auto& callback : callbacks) callback->on_train_start(*this);

  auto& precision = *plugins;
  // However fit ends (a step that throws, too), the model leaves it with its parameters final;
  // the normal end waits below, where an error surfaces instead of being swallowed here.
  struct ParamGatherFinisher {
    PrecisionPlugin& precision;
    ~ParamGatherFinisher() {
      try {
        precision.finish_param_gather();
      } catch (...) {  // already unwinding from the step's own error
      }
    }
  } finisher{precision};
  const int64_t micro_batches = options.accumulate_grad_batches();
  start_ = std::chrono::steady_clock::now();
  start_step_ = global_step_;
  auto interval_start = start_;
  int64_t interval_steps = 0;
  const bool data_parallel = precision.data_parallel_size() > 1;
  bool stop = false;
  while (global_step_ < options.max_steps()) {
    // One process stops between steps at once; data-parallel ranks agree at the loss reduction.
    if (!data_parallel && stop_requested_.load()) {
      stop = true;
      break;
    }
    const int64_t step = global_step_;
    for (auto& callback : callbacks) callback->on_train_batch_start(*this, step);
    torch::Tensor loss_sum;
    for (int64_t micro = 0; micro < micro_batches; ++micro) {
      precision.set_gradient_sync(micro == micro_batches - 1);
      auto loss = micro_batch(TrainStepInput{step, micro, precision});
      loss_sum = loss_sum.defined() ? loss_sum + loss : loss;
    }
    StepMetrics metrics;
    // A clip or a step that throws (a collective timing out, a swapped module that never ran)
    // drops the step's gradients first, so that the plugin does not count this step's backward
    // passes into the next fit's.
    const auto or_discard = [&](auto&& work) {
      try {
        return work();
      } catch (...) {
        try {
          precision.discard_gradients(optimizer);
        } catch (...) {  // the first error is the one to report
        }
        throw;
      }
    };
    // One host sync per step, before the optimizer runs, so that a non-finite loss never
    // reaches the weights: the loss (read for the metrics anyway) and, when clipping or
    // checking, the gradients' norm, measured on the device first and read with it.
    // Data-parallel: the loss is the mean over the ranks, so all of them see one loss and
    // decide alike; a rank's stop request rides along (a non-zero mean everywhere).
    const bool measures_norm = options.gradient_clip_val() > 0 || options.check_for_nan_in_grad();
    const torch::Tensor norm =
        measures_norm ? or_discard([&] { return precision.gradient_norm(optimizer); }) : torch::Tensor();
    torch::Tensor read = loss_sum.reshape({1});
    if (data_parallel) {
      const auto flag = torch::full({1}, stop_requested_.load() ? 1.0f : 0.0f, loss_sum.options());
      read = precision.data_parallel_mean(torch::cat({read, flag}));
    }
    if (norm.defined()) read = torch::cat({read.to(at::kDouble), norm.to(read.device(), at::kDouble).reshape({1})});
    const auto values = read.to(torch::kCPU, at::kDouble);
    const double loss_value = values[0].item<double>() / static_cast<double>(micro_batches);
    stop = data_parallel ? values[1].item<double>() > 0 : stop_requested_.load();
    metrics.grad_norm = norm.defined() ? values[values.size(0) - 1].item<double>()
                                       : std::numeric_limits<double>::quiet_NaN();
    // A step whose loss or gradient norm is not finite never reaches the weights: its gradients
    // are dropped and, under nonfinite_loss = "error", the last good state is saved and the run
    // stops. `what` names the value, `context` follows the step number in the message.
    const auto reject = [&](const std::string& what, const std::string& context) {
      if (options.nonfinite_loss() != "skip") {
        // Saved before the gradients are dropped (which counts a skipped step): under "error"
        // the step did not happen, and the checkpoint is that of the previous one.
        const std::string saved = or_discard([&] { return save_last_good_state(model, optimizer); });
        precision.discard_gradients(optimizer);
        TORCH_CHECK(false, "Trainer: ", what, " at step ", step + 1, context,
                    "; the weights are those after the previous step", saved,
                    " (nonfinite_loss = \"error\"; \"skip\" drops such steps instead)");
      }
      precision.discard_gradients(optimizer);
      metrics.stepped = false;
    };
    if (!std::isfinite(loss_value)) {
      reject(c10::str("non-finite loss (", loss_value, ")"), "");
      metrics.grad_norm = std::numeric_limits<double>::quiet_NaN();
    } else if (measures_norm && !std::isfinite(metrics.grad_norm) && !precision.skips_nonfinite_gradients()) {
      reject(c10::str("non-finite gradient norm (", metrics.grad_norm, ")"),
             c10::str(" with a finite loss (", loss_value, ")"));
    } else {
      if (options.gradient_clip_val() > 0) {
        or_discard([&] { precision.clip_gradients_to(optimizer, options.gradient_clip_val(), metrics.grad_norm); });
      }
      metrics.stepped = or_discard([&] { return precision.optimizer_step(optimizer); });
    }
    ++global_step_;
    ++interval_steps;
    metrics.step = global_step_;
    metrics.loss = loss_value;
    metrics.loss_scale = precision.loss_scale();
    metrics.skipped_steps = precision.skipped_steps();
    history_.push_back(metrics);

    const int64_t every = options.log_every_n_steps();
    if (every > 0 && (global_step_ % every == 0 || global_step_ == options.max_steps())) {
      const auto now = std::chrono::steady_clock::now();
      print_progress(metrics, std::chrono::duration<double>(now - interval_start).count(),
                     interval_steps);
      interval_start = now;
      interval_steps = 0;
    }
    for (auto& callback : callbacks) callback->on_train_batch_end(*this, metrics);
    const int64_t save_every = options.every_n_train_steps();
    const bool last = global_step_ == options.max_steps() || stop;
    if ((save_every > 0 && global_step_ % save_every == 0) || (last && saves_last())) {
      save_step_checkpoint(model, optimizer);
    }
    if (stop) break;
  }
  if (stop) {
    stopped_ = true;
    // Stopped before a step ran: the state is that of global_step_, saved unless it already is.
    if (saves_last() && !std::filesystem::exists(step_checkpoint_path())) {
      save_step_checkpoint(model, optimizer);
    } else if (saves_last() && last_checkpoint_.empty()) {
      last_checkpoint_ = step_checkpoint_path();  // the one this fit resumed from holds the state
    }
  }
  precision.finish_param_gather();  // fit returns the model with its final parameters
  for (auto& callback : callbacks) callback->on_train_end(*this);
}

void Trainer::print_progress(const StepMetrics& metrics, double interval_s, int64_t interval_steps) {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t done = global_step_ - start_step_;
  const double eta =
      done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(options.max_steps() - global_step_)
               : std::numeric_limits<double>::quiet_NaN();
  char line[320];
  int n = std::snprintf(line, sizeof(line), "step %lld/%lld | loss %.4f",
                        static_cast<long long>(global_step_),
                        static_cast<long long>(options.max_steps()), metrics.loss);
  if (options.tokens_per_micro_batch() > 0 && interval_s > 0) {
    const double tokens = static_cast<double>(options.tokens_per_micro_batch()) *
                          static_cast<double>(options.accumulate_grad_batches() * interval_steps);
    n += std::snprintf(line + n, sizeof(line) - n, " | %.0f tok/s", tokens / interval_s);
    if (options.flops_per_token() > 0) {
      const double per_device = tokens / interval_s * options.flops_per_token() /
                                static_cast<double>(plugins->data_parallel_size());
      n += std::snprintf(line + n, sizeof(line) - n, " | %.0f TFLOP/s/GPU", per_device / 1e12);
      if (options.peak_flops_per_device() > 0) {
        n += std::snprintf(line + n, sizeof(line) - n, " (%.1f%% MFU)", 100.0 * per_device / options.peak_flops_per_device());
      }
    }
  }
  if (metrics.loss_scale != 1.0 || metrics.skipped_steps > 0) {
    n += std::snprintf(line + n, sizeof(line) - n, " | loss scale %g | skipped %lld",
                       metrics.loss_scale, static_cast<long long>(metrics.skipped_steps));
  }
  if (std::isfinite(metrics.grad_norm)) {
    n += std::snprintf(line + n, sizeof(line) - n, " | grad norm %.3f", metrics.grad_norm);
  }
  std::snprintf(line + n, sizeof(line) - n, " | %s elapsed, ETA %s", format_duration(elapsed).c_str(),
                format_duration(eta).c_str());
  *log << line << std::endl;
}

namespace {

std::atomic<Trainer*> g_stop_target{nullptr};
volatile std::sig_atomic_t g_stop_signal = 0;
std::atomic<int64_t> g_stop_signal_ns{0};          // when g_stop_signal arrived (CLOCK_MONOTONIC)
std::atomic<int64_t> g_same_request_window_ns{0};  // StopOnSignal's same_request_window
struct sigaction g_previous_term, g_previous_int;

int64_t monotonic_ns() {  // clock_gettime is async-signal-safe (POSIX), steady_clock is not said to be
  struct timespec now {};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

extern "C" void on_stop_signal(int signal) {
  const int64_t now = monotonic_ns();
  if (g_stop_signal != 0) {  // the stop is already requested
    // A repeat within the window is the first signal delivered twice: timeout(1), and launchers
    // that signal a worker and then its process group, do that. A later repeat of the same
    // signal is the operator insisting (a second Ctrl-C): the default action from now on.
    if (signal == g_stop_signal && now - g_stop_signal_ns.load() >= g_same_request_window_ns.load()) {
      std::signal(signal, SIG_DFL);
      std::raise(signal);
    }
    return;
  }
  g_stop_signal_ns.store(now);
  g_stop_signal = signal;
  if (Trainer* trainer = g_stop_target.load()) trainer->request_stop();
}

}  // namespace

StopOnSignal::StopOnSignal(Trainer& trainer, std::chrono::milliseconds same_request_window) {
  static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<Trainer*>::is_always_lock_free &&
                    std::atomic<int64_t>::is_always_lock_free,
                "the signal handler needs lock-free atomics");
  TORCH_CHECK(same_request_window.count() >= 0, "StopOnSignal: same_request_window must be >= 0 ms, got ",
              same_request_window.count(), " ms");
  Trainer* expected = nullptr;
  TORCH_CHECK(g_stop_target.compare_exchange_strong(expected, &trainer),
              "StopOnSignal: another StopOnSignal is active in this process");
  g_stop_signal = 0;
  g_same_request_window_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(same_request_window).count());
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &action, &g_previous_term);
  ::sigaction(SIGINT, &action, &g_previous_int);
}

StopOnSignal::~StopOnSignal() {
  ::sigaction(SIGTERM, &g_previous_term, nullptr);
  ::sigaction(SIGINT, &g_previous_int, nullptr);
  g_stop_target.store(nullptr);
}

int StopOnSignal::received() const { return static_cast<int>(g_stop_signal); }

}  // namespace amp8