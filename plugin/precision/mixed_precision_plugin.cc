#include "plugin/precision/mixed_precision_plugin.h"

#include <cmath>
#include <limits>
#include <unordered_map>

#include "plugin/precision/autocast_guard.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/modules/fp8_layer_norm.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/optim/fused_optimizer.h"
#include "plugin/optim/grad_clip.h"

namespace amp8 {
namespace {

const void* key(const torch::Tensor& t) { return t.unsafeGetTensorImpl(); }



}  // namespace

// ---- MixedPrecisionPlugin ----

MixedPrecisionPlugin::MixedPrecisionPlugin(const MixedPrecisionOptions& options)
    : options_(options) {
  options_.validate();
  if (options_.canonical_precision() == "16-mixed") {
    scaler_.emplace(options_.loss_scaler_options());
  }
  if (options_.fp8_enabled()) fp8_recipe_ = options_.fp8_recipe_options().resolve();
}

std::string MixedPrecisionPlugin::name() const {
  std::string name = options_.canonical_precision();
  if (options_.fp8_enabled()) {
    name += " fp8=" + options_.fp8();
    // Delayed scaling is the default and unnamed (the names of older checkpoints stay valid).
    if (options_.fp8_recipe() != "delayed") name += " recipe=" + options_.fp8_recipe();
    if (options_.fp8_params()) name += " fp8_params";
  }
  return name;
}

void MixedPrecisionPlugin::convert_module(torch::nn::Module& model) {
  TORCH_CHECK(model_ == nullptr,
              "MixedPrecisionPlugin: convert_module/connect was already called; use one plugin per "
              "model");
  model_ = &model;
  if (options_.fp8_enabled()) {
    conversion_ = convert_to_fp8(
        model, Fp8ConversionOptions()
                   .fp8_amax_history_len(options_.fp8_amax_history_len())
                   .fp8_min_gemm_size(options_.fp8_min_gemm_size())
                   .fp8_params(options_.fp8_params())
                   .num_layers_at_start_in_bf16(options_.num_layers_at_start_in_bf16())
                   .num_layers_at_end_in_bf16(options_.num_layers_at_end_in_bf16())
                   .fuse_modules(options_.fp8_fuse_modules()));
  }
  const auto params_dtype = options_.resolved_params_dtype();
  if (params_dtype == at::kFloat) return;
  torch::NoGradGuard no_grad;
  for (auto& param : model.parameters()) {
    const auto dtype = param.scalar_type();
    if (!param.is_floating_point() || isFloat8Type(dtype) || dtype == params_dtype) continue;
    // The master is seeded from the value before the cast, not from its half rounding.
    master_seeds_.emplace_back(param, param.detach().to(at::kFloat, /*non_blocking=*/false,
                                                        /*copy=*/true));
    param.set_data(param.detach().to(params_dtype));
  }
  // A swapped-out module that a typed member still holds gets the same dtype (a copy; it no
  // longer trains), so the forward that calls it runs and the first step names it
  // (check_swapped_modules_ran) instead of LibTorch failing inside the forward on mixed dtypes.
  for (const auto& converted : conversion_.modules) {
    const auto original = converted.original.lock();
    if (!original) continue;
    for (auto& param : original->parameters()) {
      if (param.is_floating_point() && param.scalar_type() != params_dtype) {
        param.set_data(param.detach().to(params_dtype));
      }
    }
  }
}

void MixedPrecisionPlugin::convert_optimizer(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(model_ != nullptr,
              "MixedPrecisionPlugin: call convert_module (or connect) before convert_optimizer");
  TORCH_CHECK(!optimizer_, "MixedPrecisionPlugin: convert_optimizer was already called");
  TORCH_CHECK(moment_dtypes().is_float32() || is_fusable_adam(optimizer),
              "MixedPrecisionPlugin: exp_avg_dtype / exp_avg_sq_dtype ", moment_dtypes().exp_avg, " / ",
              moment_dtypes().exp_avg_sq, " need a torch::optim::Adam or AdamW without amsgrad (the fused step "
              "keeps their moments); this optimizer keeps its own state in float32");
  // A FusedAdamW / FusedAdam's own moment dtypes: the plugin steps it with the precision's.
  const AdamMomentDtypes* own_moments = nullptr;
  if (const auto* fused = dynamic_cast<const FusedAdamW*>(&optimizer)) own_moments = &fused->moment_dtypes();
  if (const auto* fused = dynamic_cast<const FusedAdam*>(&optimizer)) own_moments = &fused->moment_dtypes();
  TORCH_CHECK(own_moments == nullptr || (own_moments->exp_avg == moment_dtypes().exp_avg &&
                                         own_moments->exp_avg_sq == moment_dtypes().exp_avg_sq),
              "MixedPrecisionPlugin: the optimizer's moment dtypes (set_moment_dtypes: ", own_moments->exp_avg,
              " / ", own_moments->exp_avg_sq, ") differ from the precision's exp_avg_dtype / exp_avg_sq_dtype (",
              moment_dtypes().exp_avg, " / ", moment_dtypes().exp_avg_sq,
              "), which the plugin steps it with; set the same in MixedPrecisionOptions");
  TORCH_CHECK(optimizer.state().empty(),
              "MixedPrecisionPlugin: connect the plugin before the optimizer's first step (the "
              "optimizer already holds state for ",
              optimizer.state().size(), " parameters)");
  std::unordered_map<const void*, torch::Tensor> replaced, seeds;
  for (const auto& [old_param, new_param] : conversion_.replaced_params) replaced[key(old_param)] = new_param;
  for (const auto& [param, seed] : master_seeds_) seeds[key(param)] = seed;
  std::unordered_map<const void*, std::shared_ptr<Fp8LinearImpl>> fp8_owners;
  for (const auto& item : model_->named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<Fp8LinearImpl>(item.value());
    if (linear && linear->options.fp8_params()) fp8_owners[key(linear->weight)] = linear;
  }

  torch::NoGradGuard no_grad;
  std::vector<DistributedOptimizer::ParamSpec> specs;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      DistributedOptimizer::ParamSpec spec;
      spec.model = param;
      if (auto it = replaced.find(key(param)); it != replaced.end()) spec.model = it->second;
      if (auto owner = fp8_owners.find(key(spec.model)); owner != fp8_owners.end()) {
        const auto& linear = owner->second;
        spec.seed = linear->high_precision_init_val();
        if (!spec.seed.defined()) {
          TORCH_WARN_ONCE("MixedPrecisionPlugin: an fp8_params weight has no high-precision "
                          "initial value (built with preserve_high_precision_init_val=false or "
                          "cleared); its FP32 master is seeded from the FP8 values");
          spec.seed = linear->dequantized_weight(at::kFloat);
        }
        // On the weight's device: the initial value stays where the module was built (e.g. the
        // CPU) when the model is moved afterwards.
        spec.seed = spec.seed.detach().to(spec.model.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true);
        spec.fp8_meta = linear->fp8_meta();
        linear->clear_high_precision_init_val();
      } else if (spec.model.scalar_type() != at::kFloat) {
        TORCH_CHECK(spec.model.is_floating_point() && !isFloat8Type(spec.model.scalar_type()),
                    "MixedPrecisionPlugin: the optimizer holds a parameter of dtype ",
                    c10::toString(spec.model.scalar_type()),
                    " that is not an FP8 module's weight; expected floating-point parameters");
        // The master is seeded from the value before the cast, not from its half rounding.
        if (auto seed = seeds.find(key(spec.model)); seed != seeds.end()) spec.seed = seed->second;
      }
      specs.push_back(std::move(spec));
    }
  }
  master_seeds_.clear();
  // The swapped-out parameters (the old modules' float32 weights) were kept only to map this
  // optimizer onto the new ones; nothing else holds them now, so they are freed here.
  conversion_.replaced_params.clear();
  // The blockwise recipe reads its weights in 128×128 blocks: the FP8 weights are written so.
  const auto fp8_weight_scaling = options_.fp8_enabled() && fp8_recipe_.blockwise()
                                      ? DistributedOptimizer::Fp8WeightScaling::kBlocks128x128
                                  : options_.fp8_params_scaling() == "delayed"
                                      ? DistributedOptimizer::Fp8WeightScaling::kPerTensorDelayed
                                      : DistributedOptimizer::Fp8WeightScaling::kPerTensor;
  optimizer_ = std::make_unique<DistributedOptimizer>(group_, distributed_options_,
                                                      options_.grad_reduce_in_fp32(), fp8_weight_scaling);
  optimizer_->connect(optimizer, std::move(specs));
  optimizer_->set_gradient_sync(gradient_sync_);  // as set before connect
}

void MixedPrecisionPlugin::set_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                             DistributedOptimizerOptions options) {
  TORCH_CHECK(!optimizer_,
              "MixedPrecisionPlugin::set_process_group: call it before connect (the optimizer is "
              "already connected)");
  TORCH_CHECK(group, "MixedPrecisionPlugin::set_process_group: the process group must not be null");
  options.validate();
  group_ = std::move(group);
  distributed_options_ = options;
}

void MixedPrecisionPlugin::set_gradient_sync(bool enabled) {
  gradient_sync_ = enabled;
  if (optimizer_) optimizer_->set_gradient_sync(enabled);
}

void MixedPrecisionPlugin::finish_param_gather() {
  if (optimizer_) optimizer_->finish_param_gather();
}

torch::Tensor MixedPrecisionPlugin::data_parallel_mean(const torch::Tensor& value) {
  if (!group_) return value;
  // float32 (a half loss is summed in float32), float64 stays float64 (exact integers).
  const auto dtype = value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  std::vector<torch::Tensor> tensors{value.detach().to(dtype).contiguous().clone()};
  group_->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::SUM})->wait();
  return tensors[0].div_(static_cast<double>(group_->getSize()));
}

ForwardContext MixedPrecisionPlugin::forward_context() {
  ForwardContext context;
  const auto dtype = options_.compute_dtype();
  if (options_.autocast_enabled() && dtype != at::kFloat) {
    context.push(std::make_shared<AutocastGuard>(dtype));
  }
  if (options_.fp8_enabled()) {
    auto region = std::make_shared<Fp8Autocast>(fp8_recipe_, /*enabled=*/true, group_);
    context.push(region, [raw = region.get()] { raw->close(); });
  }
  return context;
}

// As Megatron's Float16Module: float32 inputs become the params dtype and half outputs float32;
// other dtypes (float64 targets or masks, integer ids) pass unchanged.
torch::Tensor MixedPrecisionPlugin::convert_input(const torch::Tensor& input) {
  const auto params_dtype = options_.resolved_params_dtype();
  if (!input.defined() || input.scalar_type() != at::kFloat || params_dtype == at::kFloat) return input;
  return input.to(params_dtype);
}

torch::Tensor MixedPrecisionPlugin::convert_output(const torch::Tensor& output) {
  if (!output.defined() || (output.scalar_type() != at::kBFloat16 && output.scalar_type() != at::kHalf)) {
    return output;
  }
  return output.to(at::kFloat);
}

void MixedPrecisionPlugin::backward(const torch::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "MixedPrecisionPlugin::backward: loss must be a tensor with one element, got ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  check_backward_allowed();
  if (scaler_) {
    loss.to(at::kFloat).mul(scaler_->scale()).backward();
    scaled_backward_since_step_ = true;
  } else {
    loss.backward();
  }
  // Micro-batches summed in float32 (one rank, grad_reduce_in_fp32; several ranks' hooks did).
  // The last one's gradients stay in .grad until the step takes them (reduce_gradients), so
  // that an edit of them in between is seen (check_gradients_unchanged); under static
  // gradients every micro-batch's are taken, so that a CUDA graph of any one of them holds it.
  if (optimizer_ && (!gradient_sync_ || optimizer_->static_gradients())) optimizer_->take_gradients();
  if (checks_gradients_unchanged()) grad_norm_after_backward_ = model_gradient_norm();
  note_backward_done();
}

void MixedPrecisionPlugin::check_backward_allowed() const {
  // A backward with gradient sync on ends the step's gradients: another one before the step
  // means the loop steps some other way (optimizer.step() never sees them) or accumulates
  // without saying so.
  TORCH_CHECK(!synced_backward_since_step_, "MixedPrecisionPlugin (", name(), "): plugin.backward(loss) "
              "ran again with no plugin.optimizer_step(optimizer) since a backward with gradient sync on. If the loop steps with "
              "optimizer.step(): where the optimizer steps FP32 master copies, they get their gradients only "
              "from plugin.optimizer_step(), so the model does not train; where params are their own "
              "masters (as in \"32\") it bypasses the plugin's step (gradients pile up unless zeroed, "
              "data-parallel gradients never reach the optimizer): call plugin.optimizer_step(optimizer) "
              "instead, in every precision. If it accumulates gradients over "
              "micro-batches: call plugin.set_gradient_sync(false) before every micro-batch's backward "
              "but the last (as the Trainer does, and as data-parallel training needs)");
}

void MixedPrecisionPlugin::note_backward_done() { synced_backward_since_step_ = gradient_sync_; }

std::string MixedPrecisionPlugin::cuda_graph_problem() const {
  if (group_ && group_->getSize() > 1) {
    return "data-parallel training (" + std::to_string(group_->getSize()) +
           " ranks) reduces gradients from host hooks that a replay does not run; CUDA graphs need one rank";
  }
  if (scaler_) {
    return "precision " + options_.canonical_precision() + " scales the loss by a factor the capture would "
           "fix while the loss scaler changes it; use bf16-mixed (or \"32\")";
  }
  if (!optimizer_) return "the plugin is not connected to a model and an optimizer yet";
  return "";
}

void MixedPrecisionPlugin::use_static_gradients() {
  const auto problem = cuda_graph_problem();
  TORCH_CHECK(problem.empty(), "MixedPrecisionPlugin::use_static_gradients: ", problem);
  optimizer_->use_static_gradients();
}

void MixedPrecisionPlugin::backward_replayed() {
  TORCH_CHECK(optimizer_ && optimizer_->static_gradients(),
              "MixedPrecisionPlugin::backward_replayed: call use_static_gradients() before the capture");
  check_backward_allowed();
  note_backward_done();
}

void MixedPrecisionPlugin::unscale_gradients(torch::optim::Optimizer& optimizer) {
  if (gradients_ready_) return;
  TORCH_CHECK(model_ != nullptr && optimizer_, "MixedPrecisionPlugin: connect(model, optimizer) before stepping");
  // Under loss scaling, gradients from loss.backward() instead of plugin.backward(loss) are not
  // multiplied by the scale, and unscaling would divide them by it: the model would barely train.
  TORCH_CHECK(!scaler_ || scaled_backward_since_step_ || !optimizer_->has_model_gradients(), "MixedPrecisionPlugin (",
              name(), "): this step's gradients did not come from plugin.backward(loss). loss.backward() does not "
              "multiply them by the loss scale (", loss_scale(),
              ") and unscaling divides them by it, so the model would barely train: call plugin.backward(loss)");
  check_gradients_unchanged();
  torch::NoGradGuard no_grad;
  fused_step_ = use_fused_step(optimizer);
  // The fused step reads the gradients as they were reduced and unscales them on the fly; the
  // optimizer's own step() needs them float32 and unscaled, as the masters' .grad.
  const auto& reduced = optimizer_->reduce_gradients();
  grads_ = fused_step_ ? reduced : optimizer_->set_master_gradients();
  std::vector<torch::Tensor> defined;
  for (const auto& grad : grads_) {
    if (grad.defined()) defined.push_back(grad);
  }
  found_inf_ = false;
  grad_multiplier_ = 1.0;
  if (scaler_) {
    if (fused_step_) {
      found_inf_ = optimizer_->any_rank(scaler_->find_non_finite(defined));
      grad_multiplier_ = 1.0 / scaler_->scale();
    } else {
      found_inf_ = optimizer_->any_rank(scaler_->unscale_(defined));
    }
  }
  gradients_ready_ = true;
}

torch::Tensor MixedPrecisionPlugin::gradient_norm(torch::optim::Optimizer& optimizer) {
  unscale_gradients(optimizer);
  if (found_inf_) {  // the step will be skipped
    return torch::full({1}, std::numeric_limits<double>::infinity(),
                       torch::dtype(at::kDouble).device(optimizer_->device()));
  }
  std::vector<torch::Tensor> grads;
  for (const auto& grad : grads_) {
    if (grad.defined()) grads.push_back(grad);
  }
  // The fused step reads the raw reduced gradients: their norm times the multiplier so far.
  const auto norm = optimizer_->global_norm(grads);
  return fused_step_ ? norm * grad_multiplier_ : norm;
}

void MixedPrecisionPlugin::clip_gradients_to(torch::optim::Optimizer& optimizer, double max_norm, double norm) {
  TORCH_CHECK(max_norm > 0, "clip_gradients: max_norm must be positive, got ", max_norm);
  unscale_gradients(optimizer);
  if (found_inf_) return;
  // The fused step: clipping folds into the multiplier.
  if (fused_step_) {
    grad_multiplier_ *= clip_coefficient(norm, max_norm);
    return;
  }
  std::vector<torch::Tensor> grads;
  for (const auto& grad : grads_) {
    if (grad.defined()) grads.push_back(grad);
  }
  clip_grads_to_norm_(grads, norm, max_norm);
}

bool MixedPrecisionPlugin::optimizer_step(torch::optim::Optimizer& optimizer) {
  unscale_gradients(optimizer);
  check_swapped_modules_ran();
  if (scaler_) scaler_->update(found_inf_);
  const bool step = !found_inf_;
  if (step) {
    std::optional<DistributedOptimizer::FusedStep> fused;
    if (fused_step_) {
      fused = DistributedOptimizer::FusedStep{grad_multiplier_, moment_dtypes()};
    } else {
      // float32 moments here (bfloat16 ones always take the fused step); a checkpoint's
      // bfloat16 moments are widened before torch::optim updates them.
      convert_adam_moments(optimizer, moment_dtypes());
    }
    optimizer_->step(optimizer, fused);
  } else {
    ++skipped_steps_;
  }
  clear_gradients();
  return step;
}

bool MixedPrecisionPlugin::use_fused_step(const torch::optim::Optimizer& optimizer) const {
  if (moment_dtypes().is_float32()) {
    return options_.fused_optimizer() && is_fusable(optimizer) && optimizer_->fusable_on_gpu(optimizer);
  }
  // bfloat16 moments exist only in the fused step (on the CPU: its reference).
  TORCH_CHECK(optimizer_->steps_these_masters(optimizer), "MixedPrecisionPlugin: exp_avg_dtype / exp_avg_sq_dtype "
              "bfloat16 step the optimizer through the fused step, which takes only the parameters it held at "
              "convert_optimizer; this optimizer now holds others (added since?)");
  return true;
}

AdamMomentDtypes MixedPrecisionPlugin::moment_dtypes() const {
  return {options_.exp_avg_dtype(), options_.exp_avg_sq_dtype()};
}

void MixedPrecisionPlugin::discard_gradients(torch::optim::Optimizer& optimizer) {
  clear_gradients();
  ++skipped_steps_;
}

void MixedPrecisionPlugin::clear_gradients() {
  if (optimizer_) optimizer_->zero_gradients();
  grads_.clear();
  grad_multiplier_ = 1.0;
  fused_step_ = false;
  gradients_ready_ = false;
  found_inf_ = false;
  scaled_backward_since_step_ = false;
  synced_backward_since_step_ = false;
  grad_norm_after_backward_ = std::numeric_limits<double>::quiet_NaN();
}

bool MixedPrecisionPlugin::checks_gradients_unchanged() const {
  // Not under static gradients: backward() may run inside a CUDA graph's capture, where the
  // norm's host read is not allowed (and every micro-batch is taken there: .grad holds nothing).
  return !gradients_checked_unchanged_ && model_ != nullptr && optimizer_ && optimizer_->world_size() == 1 &&
         !optimizer_->static_gradients() && (scaler_ || optimizer_->sums_micro_batches());
}

double MixedPrecisionPlugin::model_gradient_norm() const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& param : model_->parameters()) {
    if (param.grad().defined()) grads.push_back(param.grad());
  }
  for (const auto& sum : optimizer_->main_gradients()) grads.push_back(sum);
  return grads.empty() ? 0.0 : global_grad_norm(grads, nullptr, grads.front().device());
}

void MixedPrecisionPlugin::check_gradients_unchanged() {
  if (!checks_gradients_unchanged()) return;
  const double before = grad_norm_after_backward_;
  // No plugin.backward since the last step, or an overflow (the step is skipped): next time.
  if (!std::isfinite(before)) return;
  const double now = model_gradient_norm();
  const std::string changed = c10::str("MixedPrecisionPlugin (", name(), "): the gradients changed between "
                                       "plugin.backward(loss) and this step (their norm was ", before,
                                       " after the backward, is ", now, " now). ");
  TORCH_CHECK(now == before || !scaler_, changed, "Until the step they are multiplied by the loss scale (",
              loss_scale(), "), so torch::nn::utils::clip_grad_norm_ (or anything else applied to them there) "
              "works on scaled gradients: clip with plugin.clip_gradients(optimizer, max_norm), "
              "which unscales first");
  TORCH_CHECK(now == before, changed, "The step's gradients are the float32 sum of its micro-batches, which the "
              "plugin holds (grad_reduce_in_fp32); the parameters' .grad holds only the last micro-batch's, so "
              "torch::nn::utils::clip_grad_norm_ (or anything else applied to them there) sees a part of them: "
              "clip with plugin.clip_gradients(optimizer, max_norm). A backward outside plugin.backward(loss) "
              "after it changes them too: call plugin.backward for every micro-batch");
  gradients_checked_unchanged_ = true;
}

void MixedPrecisionPlugin::check_swapped_modules_ran() {
  if (swapped_modules_checked_) return;
  swapped_modules_checked_ = true;
  std::string never_ran;
  for (const auto& converted : conversion_.modules) {
    if (converted.parent_is_container) continue;
    int64_t calls = 0;
    if (auto linear = std::dynamic_pointer_cast<Fp8LinearImpl>(converted.replacement)) {
      calls = linear->forward_calls();
    } else if (auto norm = std::dynamic_pointer_cast<Fp8LayerNormImpl>(converted.replacement)) {
      calls = norm->forward_calls();
    }
    if (calls == 0) never_ran += (never_ran.empty() ? "" : ", ") + converted.path;
  }
  TORCH_CHECK(never_ran.empty(),
              "MixedPrecisionPlugin: convert_module swapped ", never_ran,
              " for FP8 modules, but the model's forward never called them. The model most "
              "likely calls the torch::nn::Linear / LayerNorm held in a typed member, which a "
              "swap cannot re-point in C++. Declare those members as amp8::Fp8Linear / "
              "amp8::Fp8LayerNorm (drop-in replacements that compute in high precision outside "
              "an FP8 region), or hold the layers in a torch::nn::Sequential, ModuleList or "
              "ModuleDict");
}

double MixedPrecisionPlugin::loss_scale() const { return scaler_ ? scaler_->scale() : 1.0; }

std::vector<torch::Tensor> MixedPrecisionPlugin::master_params() const {
  return optimizer_ ? optimizer_->master_shards() : std::vector<torch::Tensor>{};
}

at::Tensor MixedPrecisionPlugin::fp32_value(const at::Tensor& param) const {
  if (optimizer_) {
    if (auto master = optimizer_->master_of(param)) return *master;
  }
  TORCH_CHECK(!isFloat8Type(param.scalar_type()), "MixedPrecisionPlugin::fp32_value: an FP8 parameter "
              "of ", param.sizes(), " has no FP32 master here (not a parameter of the connected model?)");
  return param.detach().to(at::kFloat);
}

void MixedPrecisionPlugin::save(torch::serialize::OutputArchive& archive) const {
  archive.write("precision", c10::IValue(name()));
  archive.write("skipped_steps", torch::tensor({skipped_steps_}, at::kLong));
  const auto masters = master_params();
  archive.write("num_masters", torch::tensor({static_cast<int64_t>(masters.size())}, at::kLong));
  // Sharded (distributed optimizer): this rank's shards, and where they sit (load_resharded
  // loads them into another world size).
  archive.write("dp_world_size", torch::tensor({int64_t{data_parallel_size()}}, at::kLong));
  archive.write("dp_rank", torch::tensor({int64_t{data_parallel_rank()}}, at::kLong));
  if (optimizer_) optimizer_->save_layout(archive);  // unconnected: no masters, no layout
  for (size_t i = 0; i < masters.size(); ++i) {
    // A float32 parameter is its own master: the model's archive already holds it.
    if (optimizer_->master_is_model(i)) continue;
    archive.write("master." + std::to_string(i), masters[i].detach(), /*is_buffer=*/true);
  }
  if (scaler_) {
    torch::serialize::OutputArchive scaler_archive;
    scaler_->save(scaler_archive);
    archive.write("loss_scaler", scaler_archive);
  }
}

MixedPrecisionPlugin::CommonState MixedPrecisionPlugin::read_common_state(torch::serialize::InputArchive& archive,
                                                                        const std::string& caller,
                                                                        const std::string& file) const {
  c10::IValue precision;
  TORCH_CHECK(archive.try_read("precision", precision) && precision.isString(),
              "MixedPrecisionPlugin::", caller, ": ", file, " holds no precision-plugin state");
  TORCH_CHECK(precision.toStringRef() == name(), "MixedPrecisionPlugin::", caller, ": ", file,
              " was written with precision \"", precision.toStringRef(), "\", this plugin is \"", name(), "\"");
  torch::Tensor skipped;
  TORCH_CHECK(archive.try_read("skipped_steps", skipped), "MixedPrecisionPlugin::", caller, ": ", file,
              " lacks skipped_steps");
  CommonState state{skipped.item<int64_t>(), scaler_};
  if (state.scaler) {
    torch::serialize::InputArchive scaler_archive;
    TORCH_CHECK(archive.try_read("loss_scaler", scaler_archive), "MixedPrecisionPlugin::", caller, ": ", file,
                " holds no loss-scaler state");
    state.scaler->load(scaler_archive);
  }
  return state;
}

void MixedPrecisionPlugin::load(torch::serialize::InputArchive& archive) {
  auto common = read_common_state(archive, "load", "the checkpoint");
  torch::Tensor num_masters, dp_world_size, dp_rank;
  TORCH_CHECK(archive.try_read("num_masters", num_masters), "MixedPrecisionPlugin::load: the checkpoint lacks num_masters");
  if (archive.try_read("dp_world_size", dp_world_size) && archive.try_read("dp_rank", dp_rank)) {
    TORCH_CHECK(dp_world_size.item<int64_t>() == data_parallel_size(),
                "MixedPrecisionPlugin::load: dp_world_size: the checkpoint was written by ",
                dp_world_size.item<int64_t>(), " data-parallel rank(s), this run has ",
                data_parallel_size(), " (the Trainer's load_checkpoint loads it into another world size "
                "from every rank's file)");
    TORCH_CHECK(dp_rank.item<int64_t>() == data_parallel_rank(),
                "MixedPrecisionPlugin::load: dp_rank: the checkpoint holds rank ", dp_rank.item<int64_t>(),
                "'s shard, this process is rank ", data_parallel_rank());
  }
  const auto masters = master_params();
  TORCH_CHECK(num_masters.item<int64_t>() == static_cast<int64_t>(masters.size()),
              "MixedPrecisionPlugin::load: the checkpoint holds ", num_masters.item<int64_t>(),
              " master parameters, the optimizer connected to this plugin has ", masters.size());
  // Read and check everything before changing anything.
  std::vector<torch::Tensor> values(masters.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    const auto& master = masters[i];
    if (optimizer_->master_is_model(i)) continue;
    const auto name = "master." + std::to_string(i);
    TORCH_CHECK(archive.try_read(name, values[i], /*is_buffer=*/true),
                "MixedPrecisionPlugin::load: the checkpoint lacks ", name);
    TORCH_CHECK(values[i].sizes() == master.sizes() && values[i].scalar_type() == at::kFloat,
                "MixedPrecisionPlugin::load: ", name, " must be float32 of shape ", master.sizes(),
                ", got ", c10::toString(values[i].scalar_type()), " of shape ", values[i].sizes());
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < masters.size(); ++i) {
    if (values[i].defined()) masters[i].copy_(values[i]);
  }
  if (optimizer_) optimizer_->masters_loaded();  // unconnected: no masters
  scaler_ = std::move(common.scaler);
  skipped_steps_ = common.skipped_steps;
  clear_gradients();
}

int MixedPrecisionPlugin::checkpoint_world_size(torch::serialize::InputArchive& archive) const {
  torch::Tensor dp_world_size;
  if (!archive.try_read("dp_world_size", dp_world_size)) return 1;
  const int64_t written_by = dp_world_size.item<int64_t>();
  TORCH_CHECK(written_by >= 1 && written_by <= std::numeric_limits<int>::max(),
              "MixedPrecisionPlugin: dp_world_size: expected a number of data-parallel ranks (1 to ",
              std::numeric_limits<int>::max(), "), the checkpoint holds ", written_by);
  return static_cast<int>(written_by);
}

void MixedPrecisionPlugin::load_resharded(std::vector<torch::serialize::InputArchive>& archives,
                                          std::vector<torch::serialize::InputArchive>& optimizer_archives,
                                          torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(optimizer_, "MixedPrecisionPlugin::load_resharded: connect the plugin first");
  TORCH_CHECK(!archives.empty() && archives.size() == optimizer_archives.size(),
              "MixedPrecisionPlugin::load_resharded: got ", archives.size(), " plugin and ",
              optimizer_archives.size(), " optimizer archives");
  // Every rank's file is checked; the loss scaler and the skipped steps are taken from rank 0's
  // (every rank saves the same values).
  std::optional<CommonState> common;
  for (size_t j = 0; j < archives.size(); ++j) {
    auto state = read_common_state(archives[j], "load_resharded", "rank " + std::to_string(j) + "'s file");
    if (j == 0) common = std::move(state);
    torch::Tensor dp_world_size, dp_rank;
    TORCH_CHECK(archives[j].try_read("dp_world_size", dp_world_size) && archives[j].try_read("dp_rank", dp_rank) &&
                    dp_world_size.item<int64_t>() == static_cast<int64_t>(archives.size()) &&
                    dp_rank.item<int64_t>() == static_cast<int64_t>(j),
                "MixedPrecisionPlugin::load_resharded: file ", j, " of ", archives.size(),
                " is not rank ", j, " of a checkpoint of ", archives.size(), " ranks");
  }
  std::vector<DistributedOptimizer::CheckpointShard> shards;
  for (size_t j = 0; j < archives.size(); ++j) shards.push_back({std::move(archives[j]), std::move(optimizer_archives[j])});
  optimizer_->load_resharded(shards, optimizer);
  scaler_ = std::move(common->scaler);
  skipped_steps_ = common->skipped_steps;
  clear_gradients();
}

}  // namespace amp8
