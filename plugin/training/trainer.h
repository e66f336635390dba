#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/precision/precision_plugin.h"

namespace amp8 {

/// Options of Trainer (Lightning's Trainer arguments of the same names).
struct TrainerOptions {
  /// Optimizer steps to run (a resumed run continues up to it). Default: 100.
  TORCH_ARG(int64_t, max_steps) = 100;
  /// Micro-batches per optimizer step; their losses are averaged. Default: 1.
  TORCH_ARG(int64_t, accumulate_grad_batches) = 1;
  /// A progress line every this many steps (and at the last one); 0 = none. Default: 10.
  TORCH_ARG(int64_t, log_every_n_steps) = 10;
  /// Clip gradients to this global L2 norm (float32, after unscaling); 0 = off. Default: 0.
  TORCH_ARG(double, gradient_clip_val) = 0.0;
  /// Save a checkpoint into checkpoint_dir every this many steps; 0 = no periodic saves.
  /// Default: 0.
  TORCH_ARG(int64_t, every_n_train_steps) = 0;
  /// With a checkpoint_dir: also save after the last step (max_steps, or a stop on
  /// request_stop), whatever every_n_train_steps is (Lightning's save_last). Default: true.
  TORCH_ARG(bool, save_last) = true;
  /// Folder of the checkpoints (step_<N>.ckpt). Default: "" (none).
  TORCH_ARG(std::string, checkpoint_dir) = "";
  /// Tokens in one micro-batch summed over the data-parallel ranks (micro_batch × seq × world
  /// size), for the tokens/s figure, which is the whole run's; model TFLOP/s per device divide
  /// it by the ranks. 0 = not shown. Default: 0.
  TORCH_ARG(int64_t, tokens_per_micro_batch) = 0;
  /// Model FLOPs per token (e.g. 6 N + 12 layers hidden seq for a GPT), for the model TFLOP/s
  /// per device in the progress line; 0 = not shown. Default: 0.
  TORCH_ARG(double, flops_per_token) = 0.0;
  /// The dense bf16 peak of one device (dense_bf16_peak_flops), for MFU = model FLOP/s per
  /// device / peak; 0 = not shown. Default: 0.
  TORCH_ARG(double, peak_flops_per_device) = 0.0;
  /// What a non-finite (inf/NaN) loss does, checked before the optimizer step so the weights
  /// never take it: "error" stops the run with an error naming the step (with a checkpoint_dir
  /// and save_last or every_n_train_steps on, the weights after the previous step are saved
  /// first, and the error names the file);
  /// "skip" drops the step's gradients, counts it as skipped and goes on. Default: "error".
  TORCH_ARG(std::string, nonfinite_loss) = "error";
  /// Also check the gradients when the loss is finite (Megatron's check_for_nan_in_grad): a
  /// non-finite global gradient norm is handled as nonfinite_loss says, except where the
  /// precision plugin skips such steps itself (fp16's loss scaler). With gradient clipping the
  /// norm is computed anyway; without, this costs one pass over the gradients. Default: true.
  TORCH_ARG(bool, check_for_nan_in_grad) = true;
  /// Capture one micro-batch's forward pass, loss and backward pass in a CUDA graph after
  /// cuda_graph_warmup_steps eager steps, and replay it for every micro-batch after that: one
  /// launch instead of thousands, for models small enough that the host's launches, not the GPU,
  /// set the pace (PyTorch's whole-network capture; TE's make_graphed_callables). The FP8 scale
  /// updates are part of the graph; the optimizer step, the clipping and the learning rate stay
  /// outside it. Needs a training step split into a host part and a device part (fit with a
  /// GraphableStep), a MixedPrecisionPlugin on one GPU without loss scaling (bf16-mixed or
  /// "32", with or without FP8; see PrecisionPlugin::cuda_graph_problem), and inputs of one
  /// shape. Default: false.
  TORCH_ARG(bool, cuda_graph) = false;
  /// Steps run eagerly before the capture (their micro-batches on the graph's stream, so the
  /// per-stream state cuBLAS makes on first use exists before it): also what settles the FP8
  /// scales' first updates. Counted from where fit starts (a resumed run warms up too).
  /// Default: 3 (as make_graphed_callables' num_warmup_iters).
  TORCH_ARG(int64_t, cuda_graph_warmup_steps) = 3;
  /// Runs that repeat bit for bit on a GPU (Lightning's Trainer(deterministic=True), Megatron's
  /// --deterministic-mode): fit turns on PyTorch's deterministic algorithms, process-wide and
  /// left on (at::Context::setDeterministicAlgorithms: ops with a deterministic variant use it,
  /// an op with none is an error that names it) and cuDNN's (no autotuning), and sets
  /// CUBLAS_WORKSPACE_CONFIG=:4096:8 where it is unset: use_deterministic_algorithms(). Unlike
  /// torch.use_deterministic_algorithms, new tensors are not filled with NaN
  /// (setDeterministicFillUninitializedMemory(false)): a kernel per allocation that
  /// repeatability does not need (17% of a 350m GPT's blockwise FP8 throughput). Call
  /// that yourself before the first GEMM of the process to be sure cuBLAS's workspace follows
  /// it. amp8's own kernels reduce in a fixed order either way. Default: false.
  TORCH_ARG(bool, deterministic) = false;
};

/// What TrainerOptions::deterministic turns on, process-wide: PyTorch's deterministic
/// algorithms (an error for an op without one) without its NaN fill of new tensors, cuDNN's
/// without autotuning, and CUBLAS_WORKSPACE_CONFIG=:4096:8 unless the environment already sets
/// it.
void use_deterministic_algorithms();

/// What one optimizer step did.
struct StepMetrics {
  int64_t step = 0;         ///< 1-based: the number of optimizer steps done, this one included
  double loss = 0.0;        ///< mean over the step's micro-batches
  bool stepped = true;      ///< false when the step was skipped (non-finite gradients)
  double loss_scale = 1.0;  ///< the scale after the step
  int64_t skipped_steps = 0;
  double grad_norm = 0.0;   ///< before clipping; NaN when neither clipping nor check_for_nan_in_grad measures it
};

class Trainer;

/// Hooks into Trainer::fit (Lightning's Callback). Default: nothing.
class Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_train_start(Trainer& trainer) {}
  /// Before optimizer step `step` (0-based) runs its micro-batches: e.g. set the learning rate.
  virtual void on_train_batch_start(Trainer& trainer, int64_t step) {}
  /// After the step; `metrics.loss` is exact (read from the device).
  virtual void on_train_batch_end(Trainer& trainer, const StepMetrics& metrics) {}
  virtual void on_save_checkpoint(Trainer& trainer, const std::string& path) {}
  virtual void on_train_end(Trainer& trainer) {}
};

/// The precision plugin a Trainer uses; assignable from a plugin, its options, or a preset:
///   trainer.plugins = amp8::recipes::fp16_mixed();
class PluginHandle {
 public:
  PluginHandle() : plugin_(std::make_shared<PrecisionPlugin>()) {}
  PluginHandle(std::shared_ptr<PrecisionPlugin> plugin);
  /// A plugin the caller keeps a handle to (e.g. to call set_process_group or read its state).
  template <typename Plugin, typename = std::enable_if_t<std::is_base_of_v<PrecisionPlugin, Plugin>>>
  PluginHandle(std::shared_ptr<Plugin> plugin) : PluginHandle(std::shared_ptr<PrecisionPlugin>(std::move(plugin))) {}
  PluginHandle(const MixedPrecisionOptions& options)
      : plugin_(std::make_shared<MixedPrecisionPlugin>(options)) {}
  template <typename Plugin,
            typename = std::enable_if_t<std::is_base_of_v<PrecisionPlugin, std::decay_t<Plugin>>>>
  PluginHandle(Plugin&& plugin)
      : plugin_(std::make_shared<std::decay_t<Plugin>>(std::forward<Plugin>(plugin))) {}

  PrecisionPlugin* operator->() const { return plugin_.get(); }
  PrecisionPlugin& operator*() const { return *plugin_; }
  const std::shared_ptr<PrecisionPlugin>& get() const { return plugin_; }

 private:
  std::shared_ptr<PrecisionPlugin> plugin_;
};

/// What the training step receives: which micro-batch to compute, and the precision plugin
/// (for convert_input / convert_output).
struct TrainStepInput {
  int64_t step;         ///< 0-based optimizer step
  int64_t micro_batch;  ///< 0-based, < accumulate_grad_batches
  PrecisionPlugin& precision;
};

/// A training step split where a CUDA graph needs it (TrainerOptions::cuda_graph): `batch` runs
/// on the host for every micro-batch and returns its tensors on the GPU (the same shapes and
/// dtypes every time); `loss` computes the micro-batch's loss from them with device work only
/// (no reads on the host, no shapes that depend on values), so that one capture of it, with
/// the plugin's backward pass, can be replayed for every later micro-batch. It must not depend
/// on anything but `inputs` and the model: a replay repeats the captured kernels on the
/// addresses the capture used. Without cuda_graph, fit runs loss(batch(in), precision) eagerly.
struct GraphableStep {
  std::function<std::vector<torch::Tensor>(const TrainStepInput&)> batch;
  std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs, PrecisionPlugin& precision)> loss;
};

/// The small training loop the recipes use (NeMo's nl.Trainer with a precision plugin):
///
///   amp8::Trainer trainer(amp8::TrainerOptions().max_steps(300).log_every_n_steps(50));
///   trainer.plugins = amp8::recipes::bf16_mixed();
///   trainer.fit(*model, optimizer, [&](const amp8::TrainStepInput& in) {
///     auto [x, y] = batch(in.step, in.micro_batch);            // deterministic in (step, micro)
///     return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), y);
///   });
///
/// fit() connects the plugin (module swaps, master params) on its first call, runs each step's
/// micro-batches inside the plugin's forward context, back-propagates through the plugin,
/// clips, steps (a skipped step still counts as a step, as Megatron's iterations do), prints a
/// progress line (step/total, loss, tokens/s, loss scale, skipped steps, elapsed, ETA) and saves
/// checkpoints. A checkpoint holds the model (parameters and buffers: FP8 metadata included), the
/// optimizer state, the plugin (master params, loss scaler), the step and the RNG states, and is
/// written atomically. fit(..., ckpt_path) resumes from a checkpoint (a file, or a folder: its
/// newest complete step_<N>.ckpt) and continues exactly as the uninterrupted run would have,
/// provided the training step draws its data from (step, micro_batch).
///
/// A long run stops cleanly: request_stop() (e.g. from StopOnSignal, on SIGTERM or SIGINT)
/// finishes the current step, saves a checkpoint (with a checkpoint_dir) and returns from fit
/// with stopped() true. Data-parallel ranks agree on the stop at the step's loss reduction, so
/// all of them stop after the same step. A failed save (a full disk) throws with the state
/// intact in memory and the previous checkpoints untouched.
class Trainer {
 public:
  using TrainingStep = std::function<torch::Tensor(const TrainStepInput&)>;

  explicit Trainer(TrainerOptions options = {}, PluginHandle plugins = {});

  void fit(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
           const TrainingStep& training_step, const std::string& ckpt_path = "");
  /// fit with the step split into its host and device parts: what options.cuda_graph needs.
  void fit(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const GraphableStep& step,
           const std::string& ckpt_path = "");

  /// Writes a checkpoint of the current state to `path` (atomically) and returns it.
  std::string save_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer& optimizer);
  /// The archive save_checkpoint writes: model (parameters and buffers), optimizer, plugin,
  /// trainer (step, RNG states), and a format version.
  torch::serialize::OutputArchive checkpoint_archive(torch::nn::Module& model,
                                                     torch::optim::Optimizer& optimizer);
  /// Restores the state saved by save_checkpoint; connects the plugin first when needed. A
  /// checkpoint written by another number of data-parallel ranks (`path` one of its files, named
  /// by checkpoint_name) is read from all of its ranks' files and cut again for this world size:
  /// the FP32 masters and the optimizer state (PrecisionPlugin::load_resharded); the random state
  /// is that of rank (this rank mod N).
  void load_checkpoint(const std::string& path, torch::nn::Module& model,
                       torch::optim::Optimizer& optimizer);
  /// The newest complete checkpoint in `folder` (see checkpoint_file_problem) for `rank` of
  /// `world_size`, or "" when there is none: this rank's file, intact, of one written by this
  /// world size whose every rank's file is there (so all ranks choose the same step), else
  /// rank 0's file of one written by another whose every file is intact (at one step, this
  /// world size's first). Newer ones that are incomplete or corrupt are skipped; `skipped`,
  /// when given, receives a line for each ("<path>: <what is wrong>"). Steps past `at_most_step`
  /// are passed over (not listed). A rank whose own newest file is corrupt chooses an older step
  /// than the others; fit, given the folder, has the ranks agree on one.
  static std::string latest_checkpoint(const std::string& folder, int rank = 0, int world_size = 1,
                                       std::vector<std::string>* skipped = nullptr,
                                       int64_t at_most_step = std::numeric_limits<int64_t>::max());
  /// step_<N>.ckpt; data-parallel (sharded optimizer state): step_<N>-rank<r>-of-<W>.ckpt.
  static std::string checkpoint_name(int64_t step, int rank = 0, int world_size = 1);
  /// What a name checkpoint_name gives says: the step, and which of how many data-parallel
  /// ranks wrote the file. nullopt for any other name (a rank past the world size, numbers
  /// past int64 / int).
  struct CheckpointName {
    int64_t step;
    int rank, world_size;
  };
  static std::optional<CheckpointName> parse_checkpoint_name(const std::string& name);

  /// Asks fit to stop after the step that is running (or before the first one); safe to call
  /// from another thread. Not from a signal handler: StopOnSignal does that part.
  void request_stop() { stop_requested_.store(true); }
  /// Whether the last fit ended on request_stop before max_steps.
  bool stopped() const { return stopped_; }
  /// The checkpoint the last fit wrote last ("" when none).
  const std::string& last_checkpoint() const { return last_checkpoint_; }

  int64_t global_step() const { return global_step_; }
  /// One entry per step run by this Trainer object (a resumed run starts after the checkpoint).
  const std::vector<StepMetrics>& history() const { return history_; }

  TrainerOptions options;
  PluginHandle plugins;
  std::vector<std::shared_ptr<Callback>> callbacks;
  /// Where progress lines go. Default: std::cout.
  std::ostream* log;
  /// What an exact resume needs besides the state (name -> value, e.g. the seed, the data's
  /// identity, the batch shape, the LR schedule): written into every checkpoint and compared on
  /// load. A value that differs from the checkpoint's is an error naming each difference,
  /// unless its name is in changeable_settings. Settings the checkpoint lacks are not compared.
  std::map<std::string, std::string> run_settings;
  std::set<std::string> changeable_settings;
  /// How the error for differing settings tells the user to allow them (gpt_pretrain: its
  /// --allow-changes flag).
  std::string changeable_settings_hint = "Trainer::changeable_settings";

 private:
  void connect(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  // The newest checkpoint in `folder` every data-parallel rank can resume from (latest_checkpoint
  // on each; where their steps differ, each one's newest at or below the oldest of them, until
  // they agree), through the plugin's data_parallel_mean on `device` (a plugin with several
  // ranks must average there). Logs what it passed over; throws where a rank has none, or where
  // the ranks would load one step's checkpoints written by different world sizes.
  std::string agreed_latest_checkpoint(const std::string& folder, PrecisionPlugin& plugin,
                                       const torch::Device& device, std::ostream& log);
  // What fit runs for one micro-batch: its forward pass, loss and backward pass (with the
  // gradient sync for it set); returns the loss, detached, float32, one element.
  using MicroBatch = std::function<torch::Tensor(const TrainStepInput&)>;
  void fit_loop(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                const MicroBatch& micro_batch, const std::string& ckpt_path);
  void print_progress(const StepMetrics& metrics, double interval_s, int64_t interval_steps);

  bool saves_last() const;
  std::string step_checkpoint_path() const;
  void save_step_checkpoint(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  // After a non-finite step: saves the weights of global_step_ (when checkpoints are on) and
  // returns " (saved in <path>)" for the error message, or "".
  std::string save_last_good_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

  int64_t global_step_ = 0;
  std::atomic<bool> stop_requested_{false};
  bool stopped_ = false;
  std::string last_checkpoint_;
  std::vector<StepMetrics> history_;
  const torch::nn::Module* connected_model_ = nullptr;
  std::chrono::steady_clock::time_point start_;
  int64_t start_step_ = 0;
};

/// Stops a Trainer cleanly on SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C), as
/// Megatron's exit-signal handler does: while it lives, those signals call
/// trainer.request_stop() (an atomic store, safe in a signal handler), so fit finishes the step,
/// saves a checkpoint and returns with stopped() true. One signal is often delivered twice:
/// timeout(1), and launchers that signal a worker and then its process group, send both copies
/// within microseconds. So a repeat of the first signal within `same_request_window` of it is the
/// same request; a repeat after that restores the default action (a second Ctrl-C ends the
/// process), and another kind of signal changes nothing. The previous handlers come back when it
/// is destroyed. One at a time per process.
class StopOnSignal {
 public:
  explicit StopOnSignal(Trainer& trainer, std::chrono::milliseconds same_request_window = std::chrono::seconds(1));
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
  /// The signal received (SIGTERM or SIGINT), or 0.
  int received() const;
};

}  // namespace amp8
