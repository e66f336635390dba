#include "plugin/optim/fused_optimizer.h"

#include <ATen/core/grad_mode.h>

#include <memory>
#include <typeinfo>
#include <utility>

#include "ops/fused_adam.h"
#include "ops/fused_sgd.h"

namespace amp8 {
namespace {

// AdamOptions and AdamWOptions differ only in their type (and in what weight_decay means).
template <typename Options>
AdamStepOptions step_options(const Options& o, bool decoupled) {
  AdamStepOptions step;
  step.lr = o.lr();
  step.beta1 = std::get<0>(o.betas());
  step.beta2 = std::get<1>(o.betas());
  step.eps = o.eps();
  step.weight_decay = o.weight_decay();
  step.decoupled_weight_decay = decoupled;
  return step;
}

// State a step creates or advances joins the optimizer only once fused_*_step has checked its
// input and written the tensors: a step that throws (bad input) leaves the optimizer's state as
// it was, so neither a retry nor the unfused optimizer reads half-made state.
template <typename Options, typename State>
void step_groups(torch::optim::Optimizer& optimizer, bool decoupled, double grad_multiplier,
                 const std::function<torch::Tensor(const torch::Tensor&)>& grad_of,
                 const std::function<torch::Tensor(const torch::Tensor&)>& copy_of,
                 const AdamMomentDtypes& moment_dtypes,
                 const std::function<torch::Tensor(const torch::Tensor&)>& amax_of,
                 const std::function<torch::Tensor(const torch::Tensor&)>& copy_scale_of) {
  auto& states = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    TORCH_CHECK(!options.amsgrad(), "fused_optimizer_step: amsgrad is not fused; step the optimizer itself");
    std::vector<AdamStepTensor> tensors;
    std::vector<std::unique_ptr<State>> created;    // for tensors[i] with no state yet, else null
    tensors.reserve(group.params().size());
    for (auto& param : group.params()) {
      auto grad = grad_of(param);
      if (!grad.defined()) continue;
      AdamStepTensor entry;
      entry.param = param;
      entry.grad = grad;
      const auto found = states.find(param.unsafeGetTensorImpl());
      if (found == states.end() || !found->second) {  // as torch::optim creates it
        auto state = std::make_unique<State>();
        state->step(0);
        state->exp_avg(torch::zeros_like(param, param.options().dtype(moment_dtypes.exp_avg),
                                         at::MemoryFormat::Preserve));
        state->exp_avg_sq(torch::zeros_like(param, param.options().dtype(moment_dtypes.exp_avg_sq),
                                            at::MemoryFormat::Preserve));
        entry.exp_avg = state->exp_avg();
        entry.exp_avg_sq = state->exp_avg_sq();
        entry.step = 1;
        created.push_back(std::move(state));
      } else {
        auto& state = static_cast<State&>(*found->second);
        // Moments of other dtypes (a checkpoint written with other moment_dtypes) are converted;
        // the state takes them only once the step has succeeded, as a created state does.
        entry.exp_avg = state.exp_avg().to(moment_dtypes.exp_avg);
        entry.exp_avg_sq = state.exp_avg_sq().to(moment_dtypes.exp_avg_sq);
        entry.step = state.step() + 1;
        created.push_back(nullptr);
      }
      if (copy_of) entry.model_copy = copy_of(param);
      if (copy_scale_of && entry.model_copy.defined() && entry.model_copy.scalar_type() == at::kFloat8_e4m3fn) {
        entry.model_copy_scale = copy_scale_of(param);
      }
      if (amax_of) entry.amax = amax_of(param);
      tensors.push_back(std::move(entry));
    }
    fused_adam_step(tensors, step_options(options, decoupled), grad_multiplier);
    for (size_t i = 0; i < tensors.size(); ++i) {
      auto* key = tensors[i].param.unsafeGetTensorImpl();
      if (created[i]) states[key] = std::move(created[i]);
      auto& state = static_cast<State&>(*states[key]);
      state.step(tensors[i].step);
      state.exp_avg(tensors[i].exp_avg);  // the same tensor unless converted
      state.exp_avg_sq(tensors[i].exp_avg_sq);
    }
  }
}

// torch::optim::SGD: the momentum buffer created on a param's first step with momentum, as
// torch::optim::SGD creates it (no state without momentum); joins the state as step_groups'.
void step_sgd_groups(torch::optim::Optimizer& optimizer, double grad_multiplier,
                     const std::function<torch::Tensor(const torch::Tensor&)>& grad_of,
                     const std::function<torch::Tensor(const torch::Tensor&)>& copy_of) {
  auto& states = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    SgdStepOptions step{o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov()};
    std::vector<SgdStepTensor> tensors;
    tensors.reserve(group.params().size());
    for (auto& param : group.params()) {
      auto grad = grad_of(param);
      if (!grad.defined()) continue;
      SgdStepTensor entry;
      entry.param = param;
      entry.grad = grad;
      if (step.momentum != 0) {
        const auto found = states.find(param.unsafeGetTensorImpl());
        if (found == states.end() || !found->second) {
          entry.momentum_buffer = torch::empty_like(param, at::MemoryFormat::Contiguous);
          entry.first_step = true;
        } else {
          entry.momentum_buffer =
              static_cast<const torch::optim::SGDParamState&>(*found->second).momentum_buffer();
        }
      }
      if (copy_of) entry.model_copy = copy_of(param);
      tensors.push_back(std::move(entry));
    }
    fused_sgd_step(tensors, step, grad_multiplier);
    for (const auto& t : tensors) {
      if (!t.first_step) continue;
      auto state = std::make_unique<torch::optim::SGDParamState>();
      state->momentum_buffer(t.momentum_buffer);
      states[t.param.unsafeGetTensorImpl()] = std::move(state);
    }
  }
}

template <typename Options>
bool no_group_uses_amsgrad(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    if (static_cast<const Options&>(group.options()).amsgrad()) return false;
  }
  return true;
}

torch::Tensor closure_loss(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

torch::Tensor own_grad(const torch::Tensor& param) { return param.grad(); }

}  // namespace

bool is_fusable(const torch::optim::Optimizer& optimizer) {
  // These classes exactly: a subclass may override step() (its own clipping, a changed update),
  // which the fused step would bypass.
  const std::type_info& type = typeid(optimizer);
  if (type == typeid(torch::optim::AdamW) || type == typeid(FusedAdamW)) {
    return no_group_uses_amsgrad<torch::optim::AdamWOptions>(optimizer);
  }
  if (type == typeid(torch::optim::Adam) || type == typeid(FusedAdam)) {
    return no_group_uses_amsgrad<torch::optim::AdamOptions>(optimizer);
  }
  return type == typeid(torch::optim::SGD) || type == typeid(FusedSGD);
}

namespace {

template <typename State>
void convert_moments(torch::optim::Optimizer& optimizer, const AdamMomentDtypes& moment_dtypes) {
  for (auto& [key, state] : optimizer.state()) {
    auto* adam = dynamic_cast<State*>(state.get());
    if (adam == nullptr) continue;
    if (adam->exp_avg().scalar_type() != moment_dtypes.exp_avg) adam->exp_avg(adam->exp_avg().to(moment_dtypes.exp_avg));
    if (adam->exp_avg_sq().scalar_type() != moment_dtypes.exp_avg_sq) {
      adam->exp_avg_sq(adam->exp_avg_sq().to(moment_dtypes.exp_avg_sq));
    }
  }
}

}  // namespace

void convert_adam_moments(torch::optim::Optimizer& optimizer, const AdamMomentDtypes& moment_dtypes) {
  moment_dtypes.check("convert_adam_moments");
  at::NoGradGuard no_grad;
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    convert_moments<torch::optim::AdamWParamState>(optimizer, moment_dtypes);
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
    convert_moments<torch::optim::AdamParamState>(optimizer, moment_dtypes);
  }
}

bool is_fusable_adam(const torch::optim::Optimizer& optimizer) {
  return is_fusable(optimizer) && dynamic_cast<const torch::optim::SGD*>(&optimizer) == nullptr;
}

void AdamMomentDtypes::check(const std::string& who) const {
  for (const auto& [dtype, field] : {std::pair{exp_avg, "exp_avg_dtype"}, std::pair{exp_avg_sq, "exp_avg_sq_dtype"}}) {
    TORCH_CHECK(dtype == c10::kFloat || dtype == c10::kBFloat16, who, ": ", field,
                " must be float32 or bfloat16, got ", dtype);
  }
}

void fused_optimizer_step(torch::optim::Optimizer& optimizer, double grad_multiplier,
                          const std::function<torch::Tensor(const torch::Tensor&)>& grad_of,
                          const std::function<torch::Tensor(const torch::Tensor&)>& copy_of,
                          const AdamMomentDtypes& moment_dtypes,
                          const std::function<torch::Tensor(const torch::Tensor&)>& amax_of,
                          const std::function<torch::Tensor(const torch::Tensor&)>& copy_scale_of) {
  TORCH_CHECK(is_fusable(optimizer),
              "fused_optimizer_step: expected a torch::optim::Adam or AdamW without amsgrad, or "
              "a torch::optim::SGD");
  moment_dtypes.check("fused_optimizer_step");
  at::NoGradGuard no_grad;
  if (dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr) {
    TORCH_CHECK(moment_dtypes.is_float32(), "fused_optimizer_step: exp_avg_dtype / exp_avg_sq_dtype "
                "apply to Adam and AdamW; torch::optim::SGD's momentum buffer is float32 (got ",
                moment_dtypes.exp_avg, " / ", moment_dtypes.exp_avg_sq, ")");
    step_sgd_groups(optimizer, grad_multiplier, grad_of, copy_of);
  } else if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    step_groups<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
        optimizer, /*decoupled=*/true, grad_multiplier, grad_of, copy_of, moment_dtypes, amax_of, copy_scale_of);
  } else {
    step_groups<torch::optim::AdamOptions, torch::optim::AdamParamState>(
        optimizer, /*decoupled=*/false, grad_multiplier, grad_of, copy_of, moment_dtypes, amax_of, copy_scale_of);
  }
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  auto loss = closure_loss(closure);
  fused_optimizer_step(*this, 1.0, own_grad, {}, moment_dtypes_);
  return loss;
}

void FusedAdamW::set_moment_dtypes(const AdamMomentDtypes& moment_dtypes) {
  moment_dtypes.check("FusedAdamW::set_moment_dtypes");
  moment_dtypes_ = moment_dtypes;
}

torch::Tensor FusedSGD::step(LossClosure closure) {
  auto loss = closure_loss(closure);
  fused_optimizer_step(*this, 1.0, own_grad);
  return loss;
}

torch::Tensor FusedAdam::step(LossClosure closure) {
  auto loss = closure_loss(closure);
  fused_optimizer_step(*this, 1.0, own_grad, {}, moment_dtypes_);
  return loss;
}

void FusedAdam::set_moment_dtypes(const AdamMomentDtypes& moment_dtypes) {
  moment_dtypes.check("FusedAdam::set_moment_dtypes");
  moment_dtypes_ = moment_dtypes;
}

}  // namespace amp8
