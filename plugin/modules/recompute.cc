#include "plugin/modules/recompute.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>
#include <utility>

#include "plugin/fp8/detail/fp8_state.h"

#if defined(AMP8_WITH_CUDA) && __has_include(<c10/cuda/CUDAGraphsC10Utils.h>)
#include <c10/cuda/CUDAGraphsC10Utils.h>
#define AMP8_HAS_CUDA_CAPTURE_STATUS 1
#endif

namespace amp8 {

RecomputeMethod recompute_method_from_string(const std::string& name) {
  if (name == "none") return RecomputeMethod::kNone;
  if (name == "uniform") return RecomputeMethod::kUniform;
  if (name == "block") return RecomputeMethod::kBlock;
  TORCH_CHECK(false, "recompute method must be \"none\", \"uniform\" or \"block\", got \"", name,
              "\"");
}

const char* to_string(RecomputeMethod method) {
  switch (method) {
    case RecomputeMethod::kUniform:
      return "uniform";
    case RecomputeMethod::kBlock:
      return "block";
    case RecomputeMethod::kNone:
      break;
  }
  return "none";
}

void RecomputeOptions::validate(int64_t layers) const {
  if (method_ == RecomputeMethod::kNone) {
    // Megatron-Core: recompute_num_layers needs a recompute_method.
    TORCH_CHECK(num_layers_ == RecomputeOptions().num_layers_, "recompute num_layers (", num_layers_,
                ") applies with recompute method \"uniform\" or \"block\"; the method is \"none\"");
    return;
  }
  TORCH_CHECK(num_layers_ >= 1 && num_layers_ <= layers, "recompute num_layers must be in [1, ",
              layers, "] (the model's layers) with recompute method \"", to_string(method_),
              "\", got ", num_layers_);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr std::array<c10::DeviceType, 2> kAutocastDevices = {c10::DeviceType::CPU,
                                                             c10::DeviceType::CUDA};

// at::autocast's per-thread setting, as torch.utils.checkpoint keeps it.
struct AutocastSetting {
  std::array<bool, kAutocastDevices.size()> enabled{};
  std::array<c10::ScalarType, kAutocastDevices.size()> dtype{};
  bool cache_enabled = true;

  static AutocastSetting current() {
    AutocastSetting setting;
    for (size_t i = 0; i < kAutocastDevices.size(); ++i) {
      setting.enabled[i] = at::autocast::is_autocast_enabled(kAutocastDevices[i]);
      setting.dtype[i] = at::autocast::get_autocast_dtype(kAutocastDevices[i]);
    }
    setting.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return setting;
  }
  void apply() const {
    for (size_t i = 0; i < kAutocastDevices.size(); ++i) {
      at::autocast::set_autocast_enabled(kAutocastDevices[i], enabled[i]);
      at::autocast::set_autocast_dtype(kAutocastDevices[i], dtype[i]);
    }
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

// The first run's autocast setting, for the life of the guard; an autocast region of its own,
// whose cast cache is cleared at its end when it is the outermost.
class ReplayedAutocast {
 public:
  explicit ReplayedAutocast(const AutocastSetting& setting)
      : previous_(AutocastSetting::current()) {
    setting.apply();
    at::autocast::increment_nesting();
  }
  ~ReplayedAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    previous_.apply();
  }
  ReplayedAutocast(const ReplayedAutocast&) = delete;
  ReplayedAutocast& operator=(const ReplayedAutocast&) = delete;

 private:
  AutocastSetting previous_;
};

// The default generators' states: the CPU's and, for an input on a GPU, that GPU's.
struct RngStates {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static RngStates of(const c10::Device& device) {
    RngStates rng;
    auto save = [&](const at::Generator& generator) {
      auto copy = generator;  // shares the generator: mutex() is not const
      std::lock_guard<std::mutex> lock(copy.mutex());
      rng.states.emplace_back(copy, copy.get_state());
    };
    save(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
    if (device.type() != c10::kCPU) {
      save(at::globalContext().defaultGenerator(
          device.has_index() ? device : c10::Device(device.type(), 0)));
    }
    return rng;
  }
  void restore() const {
    for (auto [generator, state] : states) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }
};

// The scales the first run quantized with, put back into the modules' FP8 metadata for the
// second run (the first run's region has updated them since), and the second run's amaxes
// taken out of the histories again; both undone when the guard ends.
class ReplayedScales {
 public:
  ReplayedScales(const std::vector<DelayedScalingGroup>& groups,
                 const std::vector<std::pair<at::Tensor, at::Tensor>>& first_run)
      : groups_(groups) {
    now_.reserve(groups.size());
    for (const auto& group : groups) {
      now_.push_back({group.scale.clone(), group.scale_inv.clone(), group.amax_history[0].clone()});
    }
    for (size_t i = 0; i < groups.size(); ++i) {
      groups[i].scale.copy_(first_run[i].first);
      groups[i].scale_inv.copy_(first_run[i].second);
    }
  }
  ~ReplayedScales() {
    try {
      for (size_t i = 0; i < groups_.size(); ++i) {
        groups_[i].scale.copy_(now_[i][0]);
        groups_[i].scale_inv.copy_(now_[i][1]);
        groups_[i].amax_history[0].copy_(now_[i][2]);
      }
    } catch (const std::exception& e) {
      TORCH_WARN("recompute_activations: restoring the FP8 scales after the recomputation failed: ",
                 e.what());
    }
  }
  ReplayedScales(const ReplayedScales&) = delete;
  ReplayedScales& operator=(const ReplayedScales&) = delete;

 private:
  const std::vector<DelayedScalingGroup>& groups_;
  std::vector<std::array<at::Tensor, 3>> now_;
};

// Everything the second run needs from the first, kept in the autograd context.
struct RecomputeState : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> function;
  RngStates rng;
  AutocastSetting autocast;
  std::optional<detail::RegionSetting> fp8_region;
  std::vector<DelayedScalingGroup> fp8_groups;
  std::vector<std::pair<at::Tensor, at::Tensor>> fp8_scales;  // (scale, scale_inv) per group
};

const auto recompute_state_class = torch::class_<RecomputeState>("amp8", "RecomputeState");

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  // `anchor` requires grad, so that the node is recorded (and the parameters inside get their
  // gradients) even when `input` does not require grad.
  static torch::Tensor forward(AutogradContext* ctx,
                               std::function<torch::Tensor(const torch::Tensor&)> function,
                               const torch::Tensor& input, const torch::Tensor& anchor) {
    auto state = c10::make_intrusive<RecomputeState>();
    state->rng = RngStates::of(input.device());
    state->autocast = AutocastSetting::current();
    state->fp8_region = detail::current_region_setting();
    torch::Tensor output;
    {
      detail::ForwardGroupRecorder recorder;
      output = function(input);
      state->fp8_groups = recorder.groups();
      state->fp8_scales = recorder.scales();
    }
    state->function = std::move(function);
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = c10::IValue(std::move(state));
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // As torch.utils.checkpoint (reentrant): the second run's backward pass accumulates into
    // the parameters' .grad, which autograd::grad() and backward(inputs=...) never read, and it
    // builds no graph of the gradients.
    TORCH_CHECK(
        torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
        "recompute_activations: its gradients reach the parameters only through .backward() "
        "(not torch::autograd::grad, nor backward with `inputs`)");
    TORCH_CHECK(
        !torch::GradMode::is_enabled(),
        "recompute_activations: no double backward (create_graph) through a recomputed function");
    const auto state = ctx->saved_data["state"].toCustomClass<RecomputeState>();
    const auto input = ctx->get_saved_variables()[0];
    auto replay_input = input.detach().requires_grad_(input.requires_grad());
    torch::Tensor output;
    {
      const auto now = RngStates::of(input.device());
      state->rng.restore();
      ReplayedAutocast autocast(state->autocast);
      detail::ReplayedRegion region(state->fp8_region);
      ReplayedScales scales(state->fp8_groups, state->fp8_scales);
      at::AutoGradMode grad(true);
      try {
        output = state->function(replay_input);
      } catch (...) {
        now.restore();
        throw;
      }
      now.restore();
    }
    if (output.requires_grad() && grads[0].defined()) {
      torch::autograd::backward({output}, {grads[0]});
    }
    return {torch::Tensor(), replay_input.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor recompute_activations(std::function<torch::Tensor(const torch::Tensor&)> function,
                                    const torch::Tensor& input) {
  TORCH_CHECK(function, "recompute_activations: function must not be empty");
  TORCH_CHECK(input.defined(), "recompute_activations: input must be a defined tensor");
  if (!torch::GradMode::is_enabled()) return function(input);
#ifdef AMP8_HAS_CUDA_CAPTURE_STATUS
  TORCH_CHECK(
      !input.is_cuda() ||
          c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
      "recompute_activations: not inside a CUDA graph capture (TrainerOptions::cuda_graph): "
      "the backward pass would set the random-number state and run a second backward pass "
      "inside the graph");
#endif
  return RecomputeFunction::apply(std::move(function), input,
                                  torch::empty({0}).requires_grad_(true));
}

torch::Tensor forward_layers(int64_t count, const RecomputeOptions& options,
                             std::function<torch::Tensor(int64_t, const torch::Tensor&)> layer,
                             torch::Tensor x) {
  options.validate(count);
  auto run = [&](int64_t first, int64_t end, bool recompute) {
    if (!recompute) {
      for (int64_t i = first; i < end; ++i) x = layer(i, x);
      return;
    }
    x = recompute_activations(
        [layer, first, end](const torch::Tensor& input) {
          auto y = input;
          for (int64_t i = first; i < end; ++i) y = layer(i, y);
          return y;
        },
        x);
  };
  switch (options.method()) {
    case RecomputeMethod::kNone:
      run(0, count, false);
      break;
    case RecomputeMethod::kUniform:
      for (int64_t first = 0; first < count; first += options.num_layers()) {
        run(first, std::min(count, first + options.num_layers()), true);
      }
      break;
    case RecomputeMethod::kBlock:
      for (int64_t i = 0; i < count; ++i) run(i, i + 1, i < options.num_layers());
      break;
  }
  return x;
}

}  // namespace amp8
