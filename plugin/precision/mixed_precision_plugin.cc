#include "plugin/precision/mixed_precision_plugin.h"

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

bool is_fp8_dtype(c10::ScalarType dtype) {
  return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
}


}  // namespace

// ---- MixedPrecisionPlugin ----

MixedPrecisionPlugin::MixedPrecisionPlugin(const MixedPrecisionOptions& options)
    : options_(options) {
  options_.validate();
  if (options_.canonical_precision() == "16-mixed") {
    scaler_.emplace(LossScalerOptions()
                        .loss_scale(options_.fp16_loss_scale())
                        .initial_scale(options_.fp16_initial_loss_scale())
                        .min_scale(options_.fp16_min_loss_scale())
                        .growth_interval(options_.fp16_loss_scale_window())
                        .hysteresis(options_.fp16_hysteresis()));
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
                   .num_layers_at_end_in_bf16(options_.num_layers_at_end_in_bf16()));
  }
  const auto params_dtype = options_.resolved_params_dtype();
  if (params_dtype == at::kFloat) return;
  torch::NoGradGuard no_grad;
  for (auto& param : model.parameters()) {
    const auto dtype = param.scalar_type();
    if (!param.is_floating_point() || is_fp8_dtype(dtype) || dtype == params_dtype) continue;
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
  TORCH_CHECK(masters_.empty(), "MixedPrecisionPlugin: convert_optimizer was already called");
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
  std::vector<DistributedOptimizer::ParamSpec> specs;  // with a process group
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      Master entry;
      entry.model = param;
      if (auto it = replaced.find(key(param)); it != replaced.end()) entry.model = it->second;
      if (auto owner = fp8_owners.find(key(entry.model)); owner != fp8_owners.end()) {
        const auto& linear = owner->second;
        auto seed = linear->high_precision_init_val();
        if (!seed.defined()) {
          TORCH_WARN_ONCE("MixedPrecisionPlugin: an fp8_params weight has no high-precision "
                          "initial value (built with preserve_high_precision_init_val=false or "
                          "cleared); its FP32 master is seeded from the FP8 values");
          seed = linear->fp8_weight().dequantize(at::kFloat);
        }
        // On the weight's device: the initial value stays where the module was built (e.g. the
        // CPU) when the model is moved afterwards.
        entry.master = seed.detach()
                           .to(entry.model.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                           .requires_grad_(true);
        entry.fp8_owner = linear;
        linear->clear_high_precision_init_val();
      } else if (entry.model.scalar_type() == at::kFloat) {
        entry.master = entry.model;
      } else {
        TORCH_CHECK(entry.model.is_floating_point() && !is_fp8_dtype(entry.model.scalar_type()),
                    "MixedPrecisionPlugin: the optimizer holds a parameter of dtype ",
                    c10::toString(entry.model.scalar_type()),
                    " that is not an FP8 module's weight; expected floating-point parameters");
        auto seed = seeds.find(key(entry.model));
        entry.master = (seed != seeds.end() ? seed->second : entry.model.detach().to(at::kFloat))
                           .requires_grad_(true);
      }
      if (group_) {
        // The distributed optimizer keeps only this rank's shard of each master.
        specs.push_back({entry.model, entry.fp8_owner, entry.master.detach()});
        continue;
      }
      param = entry.master;
      masters_.push_back(std::move(entry));
    }
  }
  for (size_t i = 0; i < masters_.size(); ++i) master_index_[key(masters_[i].master)] = i;
  master_seeds_.clear();
  // The swapped-out parameters (the old modules' float32 weights) were kept only to map this
  // optimizer onto the new ones; nothing else holds them now, so they are freed here.
  conversion_.replaced_params.clear();
  if (group_) {
    distributed_ = std::make_unique<DistributedOptimizer>(group_, distributed_options_,
                                                          options_.grad_reduce_in_fp32());
    distributed_->connect(optimizer, std::move(specs));
  }
}

void MixedPrecisionPlugin::set_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                             DistributedOptimizerOptions options) {
  TORCH_CHECK(masters_.empty() && !distributed_,
              "MixedPrecisionPlugin::set_process_group: call it before connect (the optimizer is "
              "already connected)");
  TORCH_CHECK(group, "MixedPrecisionPlugin::set_process_group: the process group must not be null");
  options.validate();
  group_ = std::move(group);
  distributed_options_ = options;
}

void MixedPrecisionPlugin::set_gradient_sync(bool enabled) {
  if (distributed_) distributed_->set_gradient_sync(enabled);
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

torch::Tensor MixedPrecisionPlugin::convert_input(const torch::Tensor& input) {
  const auto params_dtype = options_.resolved_params_dtype();
  if (!input.defined() || !input.is_floating_point() || params_dtype == at::kFloat ||
      input.scalar_type() == params_dtype) {
    return input;
  }
  return input.to(params_dtype);
}

torch::Tensor MixedPrecisionPlugin::convert_output(const torch::Tensor& output) {
  if (!output.defined() || !output.is_floating_point() || output.scalar_type() == at::kFloat) {
    return output;
  }
  return output.to(at::kFloat);
}

void MixedPrecisionPlugin::backward(const torch::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "MixedPrecisionPlugin::backward: loss must be a tensor with one element, got ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  if (scaler_) {
    loss.to(at::kFloat).mul(scaler_->scale()).backward();
    scaled_backward_since_step_ = true;
  } else {
    loss.backward();
  }
}

void MixedPrecisionPlugin::unscale_gradients(torch::optim::Optimizer& optimizer) {
  if (gradients_ready_) return;
  TORCH_CHECK(model_ != nullptr && (!masters_.empty() || distributed_ || optimizer.param_groups().empty()),
              "MixedPrecisionPlugin: connect(model, optimizer) before stepping");
  // Under loss scaling, gradients from loss.backward() instead of plugin.backward(loss) are not
  // multiplied by the scale, and unscaling would divide them by it: the model would barely train.
  if (scaler_ && !scaled_backward_since_step_) {
    for (const auto& entry : masters_) {
      TORCH_CHECK(!entry.model.defined() || !entry.model.grad().defined(), "MixedPrecisionPlugin (", name(),
                  "): this step's gradients did not come from plugin.backward(loss). loss.backward() does not "
                  "multiply them by the loss scale (", scaler_->scale(),
                  ") and unscaling divides them by it, so the model would barely train: call plugin.backward(loss)");
    }
  }
  torch::NoGradGuard no_grad;
  fused_step_ = use_fused_step(optimizer);
  if (fused_step_) {
    prepare_fused_gradients();
    gradients_ready_ = true;
    return;
  }
  std::vector<torch::Tensor> grads;
  if (distributed_) grads = distributed_->reduce_gradients();
  grads.reserve(masters_.size());
  for (auto& entry : masters_) {
    torch::Tensor grad;
    if (entry.fp8_owner) {
      grad = entry.fp8_owner->main_grad();
    } else if (entry.master.is_same(entry.model)) {
      grad = entry.master.grad();
    } else if (entry.model.grad().defined()) {
      grad = entry.model.grad().to(at::kFloat);
    }
    if (!entry.master.is_same(entry.model)) entry.master.mutable_grad() = grad;
    if (grad.defined()) grads.push_back(grad);
  }
  found_inf_ = false;
  if (scaler_) {
    auto found_inf = scaler_->unscale_(grads);
    if (group_) {
      std::vector<torch::Tensor> tensors{found_inf};
      group_->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
    }
    found_inf_ = found_inf.item<float>() > 0.0f;
  }
  gradients_ready_ = true;
}

double MixedPrecisionPlugin::clip_gradients(torch::optim::Optimizer& optimizer, double max_norm) {
  unscale_gradients(optimizer);
  if (found_inf_) return std::numeric_limits<double>::infinity();  // the step will be skipped
  if (distributed_) return distributed_->clip_grad_norm(max_norm);
  if (fused_step_) {
    // The raw gradients' norm times the multiplier so far; clipping folds into the multiplier.
    std::vector<torch::Tensor> grads;
    for (const auto& grad : fused_grads_) {
      if (grad.defined()) grads.push_back(grad);
    }
    const double norm = global_grad_norm(grads) * grad_multiplier_;
    grad_multiplier_ *= clip_coefficient(norm, max_norm);
    return norm;
  }
  // The optimizer holds the masters, whose gradients unscale_gradients has just set.
  return PrecisionPlugin::clip_gradients(optimizer, max_norm);
}

bool MixedPrecisionPlugin::optimizer_step(torch::optim::Optimizer& optimizer) {
  unscale_gradients(optimizer);
  check_swapped_modules_ran();
  if (scaler_) scaler_->update(found_inf_);
  const bool step = !found_inf_;
  if (step && fused_step_) {
    fused_step(optimizer);
  } else if (step) {
    step_optimizer(optimizer);
    torch::NoGradGuard no_grad;
    if (distributed_) distributed_->gather_params();
    for (auto& entry : masters_) {
      if (!entry.fp8_owner && !entry.master.is_same(entry.model)) entry.model.copy_(entry.master);
    }
    update_fp8_weights();
  } else {
    ++skipped_steps_;
  }
  clear_gradients();
  return step;
}

bool MixedPrecisionPlugin::use_fused_step(const torch::optim::Optimizer& optimizer) const {
  if (!options_.fused_optimizer() || distributed_ || masters_.empty() || !is_fusable(optimizer)) {
    return false;
  }
  for (const auto& entry : masters_) {
    if (!entry.master.is_cuda()) return false;
  }
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      if (master_index_.count(key(param)) == 0) return false;  // added after connect
    }
  }
  return true;
}

void MixedPrecisionPlugin::prepare_fused_gradients() {
  fused_grads_.assign(masters_.size(), torch::Tensor());
  std::vector<torch::Tensor> defined;
  for (size_t i = 0; i < masters_.size(); ++i) {
    const auto& entry = masters_[i];
    if (entry.fp8_owner) {
      fused_grads_[i] = entry.fp8_owner->main_grad();
    } else if (entry.master.is_same(entry.model)) {
      fused_grads_[i] = entry.master.grad();
    } else {
      fused_grads_[i] = entry.model.grad();
    }
    if (fused_grads_[i].defined()) defined.push_back(fused_grads_[i]);
  }
  found_inf_ = false;
  grad_multiplier_ = 1.0;
  if (scaler_) {
    found_inf_ = scaler_->find_non_finite(defined).item<float>() > 0.0f;
    grad_multiplier_ = 1.0 / scaler_->scale();
  }
}

void MixedPrecisionPlugin::fused_step(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  fused_optimizer_step(
      optimizer, grad_multiplier_,
      [&](const torch::Tensor& master) { return fused_grads_[master_index_.at(key(master))]; },
      [&](const torch::Tensor& master) {
        const auto& entry = masters_[master_index_.at(key(master))];
        const bool half_copy = !entry.fp8_owner && !entry.master.is_same(entry.model);
        return half_copy ? entry.model : torch::Tensor();
      });
  update_fp8_weights();
}

void MixedPrecisionPlugin::update_fp8_weights() {
  std::vector<Fp8LinearImpl*> layers;
  std::vector<torch::Tensor> masters;
  for (const auto& entry : masters_) {
    if (!entry.fp8_owner) continue;
    layers.push_back(entry.fp8_owner.get());
    masters.push_back(entry.master);
  }
  Fp8LinearImpl::update_fp8_weights(layers, masters);
}

void MixedPrecisionPlugin::step_optimizer(torch::optim::Optimizer& optimizer) {
  // The distributed optimizer's shards (float32 masters with float32 gradients) take the
  // multi-tensor kernels too; the half copies are written by gather_params.
  if (distributed_ && options_.fused_optimizer() && is_fusable(optimizer) &&
      !distributed_->master_shards().empty() && distributed_->master_shards().front().is_cuda()) {
    fused_optimizer_step(optimizer, 1.0, [](const torch::Tensor& p) { return p.grad(); });
    return;
  }
  optimizer.step();
}

void MixedPrecisionPlugin::discard_gradients(torch::optim::Optimizer& optimizer) {
  clear_gradients();
  ++skipped_steps_;
}

void MixedPrecisionPlugin::clear_gradients() {
  if (distributed_) distributed_->zero_gradients();
  for (auto& entry : masters_) {
    if (entry.fp8_owner) entry.fp8_owner->zero_main_grad();
    if (entry.model.defined()) entry.model.mutable_grad().reset();
    entry.master.mutable_grad().reset();
  }
  fused_grads_.clear();
  grad_multiplier_ = 1.0;
  fused_step_ = false;
  gradients_ready_ = false;
  found_inf_ = false;
  scaled_backward_since_step_ = false;
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
  if (distributed_) return distributed_->master_shards();
  std::vector<torch::Tensor> masters;
  masters.reserve(masters_.size());
  for (const auto& entry : masters_) masters.push_back(entry.master);
  return masters;
}

at::Tensor MixedPrecisionPlugin::fp32_value(const at::Tensor& param) const {
  TORCH_CHECK(!distributed_, "MixedPrecisionPlugin::fp32_value: with a process group each rank holds "
              "only its shard of the FP32 masters (ZeRO-1); gathering them for an export is not "
              "built yet");
  for (const auto& entry : masters_) {
    if (entry.model.is_same(param)) return entry.master.detach().clone();
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
  // Sharded (distributed optimizer): this rank's shards; loading needs the same world size.
  archive.write("dp_world_size", torch::tensor({int64_t{data_parallel_size()}}, at::kLong));
  archive.write("dp_rank", torch::tensor({int64_t{data_parallel_rank()}}, at::kLong));
  for (size_t i = 0; i < masters.size(); ++i) {
    // A float32 parameter is its own master: the model's archive already holds it.
    if (!distributed_ && masters_[i].master.is_same(masters_[i].model)) continue;
    archive.write("master." + std::to_string(i), masters[i].detach(), /*is_buffer=*/true);
  }
  if (scaler_) {
    torch::serialize::OutputArchive scaler_archive;
    scaler_->save(scaler_archive);
    archive.write("loss_scaler", scaler_archive);
  }
}

void MixedPrecisionPlugin::load(torch::serialize::InputArchive& archive) {
  c10::IValue precision;
  TORCH_CHECK(archive.try_read("precision", precision) && precision.isString(),
              "MixedPrecisionPlugin::load: the checkpoint holds no precision-plugin state");
  TORCH_CHECK(precision.toStringRef() == name(),
              "MixedPrecisionPlugin::load: the checkpoint was written with precision \"",
              precision.toStringRef(), "\", this plugin is \"", name(), "\"");
  torch::Tensor skipped, num_masters, dp_world_size, dp_rank;
  TORCH_CHECK(archive.try_read("skipped_steps", skipped) && archive.try_read("num_masters", num_masters),
              "MixedPrecisionPlugin::load: the checkpoint lacks skipped_steps / num_masters");
  if (archive.try_read("dp_world_size", dp_world_size) && archive.try_read("dp_rank", dp_rank)) {
    TORCH_CHECK(dp_world_size.item<int64_t>() == data_parallel_size(),
                "MixedPrecisionPlugin::load: dp_world_size: the checkpoint was written by ",
                dp_world_size.item<int64_t>(), " data-parallel rank(s), this run has ",
                data_parallel_size(), " (resharding is not supported: resume with ",
                dp_world_size.item<int64_t>(), ")");
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
    if (!distributed_ && master.is_same(masters_[i].model)) continue;
    const auto name = "master." + std::to_string(i);
    TORCH_CHECK(archive.try_read(name, values[i], /*is_buffer=*/true),
                "MixedPrecisionPlugin::load: the checkpoint lacks ", name);
    TORCH_CHECK(values[i].sizes() == master.sizes() && values[i].scalar_type() == at::kFloat,
                "MixedPrecisionPlugin::load: ", name, " must be float32 of shape ", master.sizes(),
                ", got ", c10::toString(values[i].scalar_type()), " of shape ", values[i].sizes());
  }
  std::optional<LossScaler> scaler = scaler_;
  if (scaler) {
    torch::serialize::InputArchive scaler_archive;
    TORCH_CHECK(archive.try_read("loss_scaler", scaler_archive),
                "MixedPrecisionPlugin::load: the checkpoint holds no loss-scaler state");
    scaler->load(scaler_archive);
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < masters.size(); ++i) {
    if (values[i].defined()) masters[i].copy_(values[i]);
  }
  scaler_ = scaler;
  skipped_steps_ = skipped.item<int64_t>();
  clear_gradients();
}

}  // namespace amp8
