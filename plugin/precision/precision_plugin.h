#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace amp8 {

/// What PrecisionPlugin::forward_context() returns: a move-only RAII handle. While it lives,
/// the regions the plugin opened (at::autocast, the FP8 region) are active. close() ends them
/// in reverse order of opening and reports what failed there (the FP8 region's amax all-reduce
/// and scale update); the destructor ends whatever is still open without throwing (see
/// Fp8Autocast for what happens to a failure then, and while an exception unwinds).
class ForwardContext {
 public:
  ForwardContext() = default;
  ForwardContext(ForwardContext&&) = default;
  ForwardContext& operator=(ForwardContext&& other) {
    release();
    guards_ = std::move(other.guards_);
    return *this;
  }
  ForwardContext(const ForwardContext&) = delete;
  ForwardContext& operator=(const ForwardContext&) = delete;
  ~ForwardContext() { release(); }

  /// Adds a guard; it ends before every guard added earlier. `close`, when given, is how
  /// close() ends it (it may throw); otherwise, or from the destructor, the guard is destroyed.
  void push(std::shared_ptr<void> guard, std::function<void()> close = {}) {
    guards_.push_back({std::move(guard), std::move(close)});
  }
  /// Ends every region now, innermost first; rethrows the first failure once all are ended.
  void close() {
    std::exception_ptr error;
    while (!guards_.empty()) {
      auto guard = std::move(guards_.back());
      guards_.pop_back();
      if (!guard.close || error) continue;
      try {
        guard.close();
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  struct Guard {
    std::shared_ptr<void> guard;
    std::function<void()> close;
  };
  void release() noexcept {
    while (!guards_.empty()) guards_.pop_back();
  }
  std::vector<Guard> guards_;
};

/// The hooks a precision adds to a training loop: Lightning's Precision plugin, in C++. The
/// defaults are full precision ("32"): no conversion, no scaling.
///
///   plugin.connect(*model, optimizer);
///   for (...) {
///     torch::Tensor loss;
///     { auto guard = plugin.forward_context(); loss = loss_fn(model->forward(plugin.convert_input(x))); }
///     plugin.backward(loss);
///     plugin.optimizer_step(optimizer);   // consumes the gradients: no zero_grad() needed
///   }
///
/// A plugin keeps pointers into the model and optimizer given to connect(): they must outlive
/// it (or the next connect()).
class PrecisionPlugin {
 public:
  virtual ~PrecisionPlugin() = default;

  /// The precision's name as a user writes it: "32", "16-mixed", "bf16-mixed" (+ " fp8=...").
  virtual std::string name() const { return "32"; }

  /// convert_module(model), then convert_optimizer(optimizer). Call it once, before the
  /// optimizer's first step.
  virtual void connect(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
    convert_module(model);
    convert_optimizer(optimizer);
  }
  /// Converts the model for this precision (module swaps, parameter dtypes). Default: nothing.
  virtual void convert_module(torch::nn::Module& model) {}
  /// Rewires the optimizer for this precision (master parameters). Default: nothing.
  virtual void convert_optimizer(torch::optim::Optimizer& optimizer) {}

  /// The regions the forward pass (and the loss) must run in. Default: none.
  virtual ForwardContext forward_context() { return {}; }
  /// Casts a model input to what the converted model expects. Default: unchanged.
  virtual torch::Tensor convert_input(const torch::Tensor& input) { return input; }
  /// Casts a model output for the loss. Default: unchanged.
  virtual torch::Tensor convert_output(const torch::Tensor& output) { return output; }

  /// Back-propagates `loss` (scaled, where the precision scales losses).
  virtual void backward(const torch::Tensor& loss) { loss.backward(); }
  /// Makes the optimizer's gradients ready and true-sized: copied from the model where the
  /// optimizer holds master copies, divided by the loss scale. Idempotent within a step.
  virtual void unscale_gradients(torch::optim::Optimizer& optimizer) {}
  /// The global L2 norm of the optimizer's gradients (after unscaling, in float32, over every
  /// rank), as a one-element float64 tensor left where it was computed: nothing is read back,
  /// so a loop can read it together with its loss in one host sync, as the Trainer does.
  /// Infinite where the step will be skipped (non-finite gradients under loss scaling).
  virtual torch::Tensor gradient_norm(torch::optim::Optimizer& optimizer);
  /// Clips the optimizer's gradients, whose global norm is `norm` (gradient_norm's value, read
  /// back), to a global L2 norm of `max_norm`.
  virtual void clip_gradients_to(torch::optim::Optimizer& optimizer, double max_norm, double norm);
  /// gradient_norm, read back, then clip_gradients_to; returns the norm before clipping.
  double clip_gradients(torch::optim::Optimizer& optimizer, double max_norm);
  /// Steps the optimizer unless the step must be skipped (non-finite gradients under loss
  /// scaling); returns whether it stepped. Either way the gradients are consumed: afterwards
  /// every gradient of the model and the optimizer is cleared.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer);

  /// Drops this step's gradients without stepping (a step skipped by the training loop, e.g. on
  /// a non-finite loss). Default: the optimizer's zero_grad.
  virtual void discard_gradients(torch::optim::Optimizer& optimizer) {
    optimizer.zero_grad(/*set_to_none=*/true);
  }

  // ---- CUDA graphs (TrainerOptions::cuda_graph): a graph of one micro-batch's forward and
  // backward pass, captured through backward(loss) and replayed for later micro-batches ----
  /// Why this plugin cannot take part, or "" when it can. Asked before the capture (after the
  /// eager warm-up steps, so the plugin is connected). Default: it cannot.
  virtual std::string cuda_graph_problem() const {
    return "the precision plugin \"" + name() + "\" keeps no gradients at fixed addresses; use a "
           "MixedPrecisionPlugin (any precision, \"32\" included)";
  }
  /// Makes every gradient the backward pass writes stay at one address from now on (a replay
  /// writes where the capture wrote). Called once, before the capture.
  virtual void use_static_gradients() { TORCH_CHECK(false, cuda_graph_problem()); }
  /// A replay did the work of backward(loss) (the captured one): the same checks and
  /// bookkeeping, without the work.
  virtual void backward_replayed() { TORCH_CHECK(false, cuda_graph_problem()); }

  /// The loss scale in use (1 when the precision does not scale).
  virtual double loss_scale() const { return 1.0; }
  /// Whether optimizer_step itself skips a step whose gradients are not finite (a dynamic loss
  /// scaler does); the Trainer handles such gradients otherwise.
  virtual bool skips_nonfinite_gradients() const { return false; }
  /// Data parallelism: false before every micro-batch's backward but the last of a step, so
  /// gradients are only summed locally until then (DDP's no_sync). The Trainer calls it; a loop
  /// of one's own that accumulates must too (MixedPrecisionPlugin refuses a second backward
  /// after one with sync on, before the step).
  virtual void set_gradient_sync(bool enabled) {}
  /// The element-wise mean of `value` (any shape; float32, or float64 when it is float64) over
  /// the data-parallel ranks; `value` itself without data parallelism. The Trainer reports the
  /// global loss and decides on a non-finite one (and on a stop) with it, so every rank takes
  /// the same decision.
  virtual torch::Tensor data_parallel_mean(const torch::Tensor& value) { return value; }
  /// Waits for the parameters a data-parallel step left in flight
  /// (DistributedOptimizerOptions::overlap_param_gather). The Trainer calls it before anything
  /// reads the parameters outside a forward pass that waits for them itself: a checkpoint, a
  /// load, the end of fit.
  virtual void finish_param_gather() {}
  /// This process's data-parallel rank and the number of ranks (0 and 1 without).
  virtual int data_parallel_rank() const { return 0; }
  virtual int data_parallel_size() const { return 1; }
  /// Steps skipped since the start of training (non-finite gradients).
  virtual int64_t skipped_steps() const { return 0; }

  /// The float32 value training holds for `param`, one of the model's parameters: its FP32
  /// master where the optimizer steps one (MixedPrecisionPlugin), else the parameter itself.
  /// What export_fp32_model (plugin/training/export.h) writes.
  virtual at::Tensor fp32_value(const at::Tensor& param) const { return param.detach().to(at::kFloat); }

  /// Everything of the plugin that changes during training.
  virtual void save(torch::serialize::OutputArchive& archive) const {}
  virtual void load(torch::serialize::InputArchive& archive) {}
  /// The number of data-parallel ranks whose files make up the checkpoint `archive` (a save()
  /// of this plugin) belongs to: 1 unless the state is sharded.
  virtual int checkpoint_world_size(torch::serialize::InputArchive& archive) const { return 1; }
  /// Loads the state of a checkpoint written by another number of ranks: `archives[j]` and
  /// `optimizer_archives[j]` are rank j's plugin and optimizer archives; loads `optimizer` too.
  virtual void load_resharded(std::vector<torch::serialize::InputArchive>& archives,
                              std::vector<torch::serialize::InputArchive>& optimizer_archives,
                              torch::optim::Optimizer& optimizer) {
    TORCH_CHECK(false, "PrecisionPlugin \"", name(), "\" keeps no sharded state to load from ", archives.size(),
                " ranks' files");
  }
};

}  // namespace amp8
