#include "plugin/trainer.h"

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/serialize.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <functional>
#include <filesystem>
#include <iostream>
#include <limits>
#include <mutex>
#include <regex>
#include <sstream>

#include "plugin/checkpoint.h"

namespace amp8 {
namespace {

constexpr int64_t kCheckpointVersion = 1;
// Trainer::run_settings in the trainer archive: "setting.<name>" -> the value as a string.
const std::string kSettingPrefix = "setting.";

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

std::vector<at::Generator> default_generators() {
  std::vector<at::Generator> generators{at::detail::getDefaultCPUGenerator()};
  const auto cuda_devices = static_cast<int64_t>(torch::cuda::device_count());
  for (int64_t i = 0; i < cuda_devices; ++i) {
    generators.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i)));
  }
  return generators;
}

void save_rng_states(torch::serialize::OutputArchive& archive) {
  const auto generators = default_generators();
  archive.write("num_rng_states", torch::tensor({static_cast<int64_t>(generators.size())}));
  for (size_t i = 0; i < generators.size(); ++i) {
    auto generator = generators[i];
    std::lock_guard<std::mutex> lock(generator.mutex());
    archive.write("rng_state." + std::to_string(i), generator.get_state());
  }
}

void load_rng_states(torch::serialize::InputArchive& archive) {
  torch::Tensor count;
  TORCH_CHECK(archive.try_read("num_rng_states", count), "checkpoint: the trainer state has no RNG states");
  auto generators = default_generators();
  // A checkpoint from a machine with another GPU count restores what both have.
  const auto n = std::min<int64_t>(count.item<int64_t>(), generators.size());
  for (int64_t i = 0; i < n; ++i) {
    torch::Tensor state;
    TORCH_CHECK(archive.try_read("rng_state." + std::to_string(i), state),
                "checkpoint: RNG state ", i, " is missing");
    std::lock_guard<std::mutex> lock(generators[i].mutex());
    generators[i].set_state(state);
  }
}

// Every parameter and buffer of `module` (recursively) must be in the archive with its shape
// and dtype: torch's loader would silently take another shape.
void check_module_archive(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                          const std::string& path, const std::string& prefix) {
  auto check = [&](const std::string& name, const torch::Tensor& expected, bool is_buffer) {
    if (!expected.defined()) return;
    torch::Tensor stored;
    TORCH_CHECK(archive.try_read(name, stored, is_buffer), "checkpoint ", path, ": ",
                prefix + name, " is missing");
    TORCH_CHECK(stored.sizes() == expected.sizes() && stored.scalar_type() == expected.scalar_type(),
                "checkpoint ", path, ": ", prefix + name, " is ", stored.scalar_type(), " ",
                stored.sizes(), ", the model's is ", expected.scalar_type(), " ", expected.sizes());
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) check(item.key(), item.value(), false);
  for (const auto& item : module.named_buffers(/*recurse=*/false)) check(item.key(), item.value(), true);
  for (const auto& item : module.named_children()) {
    torch::serialize::InputArchive child;
    TORCH_CHECK(archive.try_read(item.key(), child), "checkpoint ", path, ": module ",
                prefix + item.key(), " is missing");
    check_module_archive(*item.value(), child, path, prefix + item.key() + ".");
  }
}

// The state a load changes, kept in memory so a failed load can be undone.
class Snapshot {
 public:
  Snapshot(torch::nn::Module& model, torch::optim::Optimizer& optimizer, PrecisionPlugin& plugin) {
    torch::NoGradGuard no_grad;
    for (const auto& t : model.parameters()) tensors_.emplace_back(t, t.detach().clone());
    for (const auto& t : model.buffers()) tensors_.emplace_back(t, t.detach().clone());
    optimizer_ = serialize([&](auto& archive) { optimizer.save(archive); });
    plugin_ = serialize([&](auto& archive) { plugin.save(archive); });
  }
  void restore(torch::nn::Module& model, torch::optim::Optimizer& optimizer, PrecisionPlugin& plugin) {
    torch::NoGradGuard no_grad;
    for (auto& [target, saved] : tensors_) target.set_data(saved);
    torch::serialize::InputArchive optimizer_archive, plugin_archive;
    optimizer_archive.load_from(optimizer_.data(), optimizer_.size());
    optimizer.load(optimizer_archive);
    plugin_archive.load_from(plugin_.data(), plugin_.size());
    plugin.load(plugin_archive);
  }

 private:
  template <typename Fn>
  static std::string serialize(Fn&& fill) {
    torch::serialize::OutputArchive archive;
    fill(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    return bytes.str();
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> tensors_;
  std::string optimizer_, plugin_;
};

}  // namespace

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

void Trainer::fit(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                  const TrainingStep& training_step, const std::string& ckpt_path) {
  TORCH_CHECK(options.max_steps() >= 0, "max_steps must be >= 0, got ", options.max_steps());
  TORCH_CHECK(options.accumulate_grad_batches() >= 1, "accumulate_grad_batches must be >= 1, got ",
              options.accumulate_grad_batches());
  TORCH_CHECK(options.log_every_n_steps() >= 0, "log_every_n_steps must be >= 0, got ",
              options.log_every_n_steps());
  TORCH_CHECK(options.gradient_clip_val() >= 0 && std::isfinite(options.gradient_clip_val()),
              "gradient_clip_val must be >= 0, got ", options.gradient_clip_val());
  TORCH_CHECK(options.every_n_train_steps() >= 0, "every_n_train_steps must be >= 0, got ",
              options.every_n_train_steps());
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
  TORCH_CHECK(static_cast<bool>(training_step), "Trainer::fit: training_step must be callable");
  TORCH_CHECK(options.nonfinite_loss() == "error" || options.nonfinite_loss() == "skip",
              "nonfinite_loss must be \"error\" or \"skip\", got \"", options.nonfinite_loss(), "\"");

  connect(model, optimizer);
  if (!ckpt_path.empty()) {
    std::string path = ckpt_path;
    if (std::filesystem::is_directory(ckpt_path)) {
      std::vector<std::string> skipped;
      path = latest_checkpoint(ckpt_path, plugins->data_parallel_rank(), plugins->data_parallel_size(), &skipped);
      for (const auto& line : skipped) *log << "Trainer: skipping checkpoint " << line << std::endl;
      TORCH_CHECK(!path.empty(), "Trainer::fit: no complete ",
                  checkpoint_name(0, plugins->data_parallel_rank(), plugins->data_parallel_size())
                      .replace(5, 8, "<N>"),
                  " checkpoint in ", ckpt_path);
      if (!skipped.empty()) *log << "Trainer: resuming from the previous complete checkpoint " << path << std::endl;
    }
    load_checkpoint(path, model, optimizer);
    if (plugins->data_parallel_size() > 1) {
      // Every rank continues from the same step (one whose newest shard was incomplete would
      // otherwise fall back alone): the steps are all equal iff mean(s^2) == mean(s)^2.
      const auto parameters = model.parameters();
      const auto device = parameters.empty() ? torch::Device(torch::kCPU) : parameters.front().device();
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
      torch::Tensor loss;
      {
        auto context = precision.forward_context();
        loss = training_step(TrainStepInput{step, micro, precision});
        context.close();  // the FP8 scale update's errors surface here, not in a destructor
      }
      TORCH_CHECK(loss.defined() && loss.numel() == 1,
                  "Trainer: the training step must return a loss with one element, got ",
                  loss.defined() ? loss.sizes() : at::IntArrayRef{});
      precision.set_gradient_sync(micro == micro_batches - 1);
      precision.backward(micro_batches > 1 ? loss / static_cast<double>(micro_batches) : loss);
      auto detached = loss.detach().to(at::kFloat).reshape({});
      loss_sum = loss_sum.defined() ? loss_sum + detached : detached;
    }
    StepMetrics metrics;
    metrics.grad_norm = std::numeric_limits<double>::quiet_NaN();
    // One host sync per step (the loss is read for the metrics anyway), before the optimizer
    // runs, so a non-finite loss never reaches the weights.
    // Data-parallel: the mean over the ranks, so all of them see one loss and decide alike.
    double loss_value = 0;
    if (data_parallel) {
      // The stop request rides along: a rank that was asked makes the mean non-zero everywhere.
      const auto flag = torch::full({}, stop_requested_.load() ? 1.0f : 0.0f, loss_sum.options());
      const auto reduced = precision.data_parallel_mean(torch::stack({loss_sum, flag})).cpu();
      loss_value = reduced[0].item<double>() / static_cast<double>(micro_batches);
      stop = reduced[1].item<double>() > 0;
    } else {
      loss_value = loss_sum.item<double>() / static_cast<double>(micro_batches);
      stop = stop_requested_.load();
    }
    if (!std::isfinite(loss_value)) {
      if (options.nonfinite_loss() != "skip") {
        precision.discard_gradients(optimizer);
        const std::string saved = save_last_good_state(model, optimizer);
        TORCH_CHECK(false, "Trainer: non-finite loss (", loss_value, ") at step ", step + 1,
                    "; the weights are those after the previous step", saved,
                    " (nonfinite_loss = \"error\"; \"skip\" drops such steps instead)");
      }
      precision.discard_gradients(optimizer);
      metrics.stepped = false;
    } else {
      if (options.gradient_clip_val() > 0) {
        metrics.grad_norm = precision.clip_gradients(optimizer, options.gradient_clip_val());
      } else if (options.check_for_nan_in_grad()) {
        // The global norm without clipping (an infinite max_norm scales nothing).
        metrics.grad_norm = precision.clip_gradients(optimizer, std::numeric_limits<double>::infinity());
      }
      const bool checked = options.gradient_clip_val() > 0 || options.check_for_nan_in_grad();
      if (checked && !std::isfinite(metrics.grad_norm) && !precision.skips_nonfinite_gradients()) {
        if (options.nonfinite_loss() != "skip") {
          precision.discard_gradients(optimizer);
          const std::string saved = save_last_good_state(model, optimizer);
          TORCH_CHECK(false, "Trainer: non-finite gradient norm (", metrics.grad_norm, ") at step ",
                      step + 1, " with a finite loss (", loss_value,
                      "); the weights are those after the previous step", saved,
                      " (nonfinite_loss = \"error\"; \"skip\" drops such steps instead)");
        }
        precision.discard_gradients(optimizer);
        metrics.stepped = false;
      } else {
        metrics.stepped = precision.optimizer_step(optimizer);
      }
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
    }
  }
  for (auto& callback : callbacks) callback->on_train_end(*this);
}

bool Trainer::saves_last() const { return options.save_last() && !options.checkpoint_dir().empty(); }

std::string Trainer::step_checkpoint_path() const {
  const auto name = checkpoint_name(global_step_, plugins->data_parallel_rank(), plugins->data_parallel_size());
  return (std::filesystem::path(options.checkpoint_dir()) / name).string();
}

void Trainer::save_step_checkpoint(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const auto path = step_checkpoint_path();
  try {
    save_checkpoint(path, model, optimizer);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "Trainer: the checkpoint of step ", global_step_, " could not be saved; the "
                "training state is intact in memory and the earlier checkpoints are untouched",
                last_checkpoint_.empty() ? std::string() : " (newest: " + last_checkpoint_ + ")", ": ",
                e.what_without_backtrace());
  }
  last_checkpoint_ = path;
  for (auto& callback : callbacks) callback->on_save_checkpoint(*this, path);
}

std::string Trainer::save_last_good_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  if (!saves_last() && options.every_n_train_steps() == 0) return "";
  const auto path = step_checkpoint_path();
  if (std::filesystem::exists(path)) return " (saved in " + path + ")";
  try {
    save_step_checkpoint(model, optimizer);
  } catch (const c10::Error& e) {
    return " (saving them failed: " + std::string(e.what_without_backtrace()) + ")";
  }
  return " (saved in " + path + ")";
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

torch::serialize::OutputArchive Trainer::checkpoint_archive(torch::nn::Module& model,
                                                            torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive, plugin_archive,
      trainer_archive;
  archive.write("amp8_checkpoint_version", torch::tensor({kCheckpointVersion}));
  model.save(model_archive);
  optimizer.save(optimizer_archive);
  plugins->save(plugin_archive);
  trainer_archive.write("global_step", torch::tensor({global_step_}));
  trainer_archive.write("precision", c10::IValue(plugins->name()));
  for (const auto& [name, value] : run_settings) {
    trainer_archive.write(kSettingPrefix + name, c10::IValue(value));
  }
  save_rng_states(trainer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("plugin", plugin_archive);
  archive.write("trainer", trainer_archive);
  return archive;
}

std::string Trainer::save_checkpoint(const std::string& path, torch::nn::Module& model,
                                     torch::optim::Optimizer& optimizer) {
  auto archive = checkpoint_archive(model, optimizer);
  save_atomically(archive, path);
  return path;
}

void Trainer::load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer& optimizer) {
  connect(model, optimizer);
  torch::serialize::InputArchive archive, model_archive, optimizer_archive, plugin_archive,
      trainer_archive;
  load_archive(archive, path);
  torch::Tensor version, step;
  TORCH_CHECK(archive.try_read("amp8_checkpoint_version", version),
              "checkpoint ", path, " is not an amp8 checkpoint (no amp8_checkpoint_version)");
  TORCH_CHECK(version.item<int64_t>() == kCheckpointVersion, "checkpoint ", path, " has version ",
              version.item<int64_t>(), ", this amp8 reads version ", kCheckpointVersion);
  TORCH_CHECK(archive.try_read("model", model_archive) &&
                  archive.try_read("optimizer", optimizer_archive) &&
                  archive.try_read("plugin", plugin_archive) &&
                  archive.try_read("trainer", trainer_archive),
              "checkpoint ", path, " lacks one of model / optimizer / plugin / trainer");
  TORCH_CHECK(trainer_archive.try_read("global_step", step), "checkpoint ", path,
              " lacks trainer/global_step");
  c10::IValue precision;
  TORCH_CHECK(trainer_archive.try_read("precision", precision) && precision.isString(),
              "checkpoint ", path, " lacks trainer/precision");
  TORCH_CHECK(precision.toStringRef() == plugins->name(), "checkpoint ", path,
              ": the checkpoint was written with precision \"", precision.toStringRef(),
              "\", this plugin is \"", plugins->name(), "\"");
  std::string differences;
  for (const auto& [name, value] : run_settings) {
    c10::IValue stored;
    if (!trainer_archive.try_read(kSettingPrefix + name, stored) || !stored.isString()) continue;
    if (stored.toStringRef() == value || changeable_settings.count(name) > 0) continue;
    differences += (differences.empty() ? "" : ", ") + name + " " + stored.toStringRef() +
                   " (this run: " + value + ")";
  }
  TORCH_CHECK(differences.empty(), "checkpoint ", path, " was written with other settings: ",
              differences, "; an exact resume needs the same ones (to resume anyway, allow them by "
              "name: ", changeable_settings_hint, ")");
  check_module_archive(model, model_archive, path, "");
  // Everything or nothing: the state before the load is kept (in memory) until the load is
  // through, and put back if any part of it throws.
  Snapshot snapshot(model, optimizer, *plugins);
  try {
    plugins->load(plugin_archive);  // checks the precision and the masters first
    model.load(model_archive);
    optimizer.load(optimizer_archive);
    load_rng_states(trainer_archive);
  } catch (const c10::Error& e) {
    snapshot.restore(model, optimizer, *plugins);
    TORCH_CHECK(false, "checkpoint ", path, " could not be loaded, nothing was changed: ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {  // LibTorch's readers throw std::runtime_error too
    snapshot.restore(model, optimizer, *plugins);
    TORCH_CHECK(false, "checkpoint ", path, " could not be loaded, nothing was changed: ", e.what());
  }
  global_step_ = step.item<int64_t>();
}

std::string Trainer::checkpoint_name(int64_t step, int rank, int world_size) {
  char name[64];
  if (world_size <= 1) {
    std::snprintf(name, sizeof(name), "step_%08lld.ckpt", static_cast<long long>(step));
  } else {
    std::snprintf(name, sizeof(name), "step_%08lld-rank%d-of-%d.ckpt", static_cast<long long>(step), rank,
                  world_size);
  }
  return name;
}

std::string Trainer::latest_checkpoint(const std::string& folder, int rank, int world_size,
                                       std::vector<std::string>* skipped) {
  const std::regex pattern(world_size <= 1 ? std::string(R"(step_(\d+)\.ckpt)")
                                           : R"(step_(\d+)-rank)" + std::to_string(rank) + "-of-" +
                                                 std::to_string(world_size) + R"(\.ckpt)");
  std::vector<std::pair<long long, std::string>> candidates;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(folder, error)) {
    std::smatch match;
    const auto name = entry.path().filename().string();
    if (entry.is_regular_file(error) && std::regex_match(name, match, pattern)) {
      candidates.emplace_back(std::stoll(match[1].str()), entry.path().string());
    }
  }
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  for (const auto& [step, path] : candidates) {
    const auto problem = checkpoint_file_problem(path);
    if (problem.empty()) return path;
    if (skipped != nullptr) skipped->push_back(problem);
  }
  return "";
}

namespace {

std::atomic<Trainer*> g_stop_target{nullptr};
volatile std::sig_atomic_t g_stop_signal = 0;
struct sigaction g_previous_term, g_previous_int;

extern "C" void on_stop_signal(int signal) {
  if (g_stop_signal == signal) {  // asked twice: the default action from now on
    std::signal(signal, SIG_DFL);
    std::raise(signal);
    return;
  }
  g_stop_signal = signal;
  if (Trainer* trainer = g_stop_target.load()) trainer->request_stop();
}

}  // namespace

StopOnSignal::StopOnSignal(Trainer& trainer) {
  static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<Trainer*>::is_always_lock_free,
                "the signal handler needs lock-free atomics");
  Trainer* expected = nullptr;
  TORCH_CHECK(g_stop_target.compare_exchange_strong(expected, &trainer),
              "StopOnSignal: another StopOnSignal is active in this process");
  g_stop_signal = 0;
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
