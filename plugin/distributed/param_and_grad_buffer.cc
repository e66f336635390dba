#include "plugin/distributed/param_and_grad_buffer.h"

#include <c10/core/Event.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <utility>

#include "plugin/compat/torch_internals.h"
#include "plugin/modules/fp8_meta.h"

namespace amp8 {
namespace {

constexpr int64_t kAlignment = 64;  // elements; every shard starts on a multiple of it

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

namespace detail {

// The all-gathers a step left in flight (overlap_param_gather) and what waiting for them needs.
// The buffer holds it; while any gather is in flight, so does (weakly) the registry of the
// thread that launched them, which amp8::wait_for_params reads.
struct ParamGathers {
  std::unordered_map<const c10::TensorImpl*, size_t> bucket_of;  // a parameter's bucket
  std::vector<c10::intrusive_ptr<c10d::Work>> works;             // per bucket; null: gathered
  int64_t in_flight = 0;
  // CUDA, on a timed step: each wait's start and end on the compute stream.
  std::optional<c10::Device> timed_on;
  std::vector<std::pair<c10::Event, c10::Event>> waits;

  void wait(size_t bucket) {
    auto& work = works[bucket];
    if (!work) return;
    if (!timed_on) {
      work->wait();
    } else {
      c10::Event start(timed_on->type(), c10::EventFlag::BACKEND_DEFAULT);
      c10::Event end(timed_on->type(), c10::EventFlag::BACKEND_DEFAULT);
      start.record(amp8::detail::current_stream(*timed_on));
      work->wait();  // NCCL: the compute stream waits, the host does not
      end.record(amp8::detail::current_stream(*timed_on));
      waits.emplace_back(std::move(start), std::move(end));
    }
    work.reset();
    --in_flight;
  }

  void wait_for(at::ArrayRef<at::Tensor> params) {
    for (const auto& param : params) {
      if (in_flight == 0) return;
      const auto found = bucket_of.find(param.unsafeGetTensorImpl());
      if (found != bucket_of.end()) wait(found->second);
    }
  }
};

namespace {

// The gathers launched on this thread that may still be in flight.
thread_local std::vector<std::weak_ptr<ParamGathers>> in_flight_on_this_thread;

void register_in_flight(const std::shared_ptr<ParamGathers>& gathers) {
  auto& registry = in_flight_on_this_thread;
  registry.erase(std::remove_if(registry.begin(), registry.end(),
                                [&](const std::weak_ptr<ParamGathers>& entry) {
                                  const auto held = entry.lock();
                                  return !held || held == gathers || held->in_flight == 0;
                                }),
                 registry.end());
  registry.push_back(gathers);
}

}  // namespace
}  // namespace detail

void wait_for_params(const torch::nn::Module& module) {
  auto& registry = detail::in_flight_on_this_thread;
  if (registry.empty()) return;
  const auto params = module.parameters(/*recurse=*/true);
  for (auto it = registry.begin(); it != registry.end();) {
    const auto gathers = it->lock();
    if (!gathers || gathers->in_flight == 0) {
      it = registry.erase(it);
      continue;
    }
    gathers->wait_for(params);
    ++it;
  }
}

void DistributedOptimizerOptions::validate() const {
  TORCH_CHECK(bucket_size_ >= 1, "bucket_size must be >= 1 element, got ", bucket_size_);
}

// One parameter: where it lives in its buffer, and its state in the current backward pass.
struct ParamAndGradBuffer::Slot {
  torch::Tensor model;
  c10::intrusive_ptr<Fp8Meta> fp8_meta;
  size_t buffer = 0, bucket = 0;
  int64_t offset = 0;  // in its buffer
  int64_t numel = 0;
  bool ready = false;  // its gradient is in the buffer for this backward pass
};

// A contiguous range of one buffer, reduce-scattered and all-gathered as one collective.
struct ParamAndGradBuffer::Bucket {
  size_t buffer = 0;
  int64_t begin = 0, size = 0;  // padded: size % (world_size * kAlignment) == 0
  std::vector<size_t> params;
  int64_t pending = 0;  // parameters whose gradient is not in yet
  bool launched = false;
  c10::intrusive_ptr<c10d::Work> work;
};

// The parameters of one dtype: their values (the model's parameters are views of `params`) and
// their gradients (`grads`, in the reduce dtype).
struct ParamAndGradBuffer::Buffer {
  c10::ScalarType param_dtype, grad_dtype;
  torch::Tensor params, grads;
  int64_t numel = 0;
};

// Timing events of one step (see take_communication_times): recorded on the compute stream.
struct ParamAndGradBuffer::StepEvents {
  // backward done, reduced, gather launched, gathered (the last: without overlap_param_gather)
  std::array<std::optional<c10::Event>, 4> events;
  std::vector<std::pair<c10::Event, c10::Event>> gather_waits;  // overlap_param_gather's waits
  int64_t reduce_bytes = 0, gather_bytes = 0;
  bool gathered = false;  // every bucket's all-gather has been waited for
};

ParamAndGradBuffer::ParamAndGradBuffer(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                       DistributedOptimizerOptions options, bool grad_reduce_in_fp32,
                                       std::vector<Param> params)
    : group_(std::move(group)), options_(options), gathers_(std::make_shared<detail::ParamGathers>()) {
  TORCH_CHECK(group_, "ParamAndGradBuffer: the process group must not be null");
  options_.validate();
  TORCH_CHECK(!params.empty(), "DistributedOptimizer: the optimizer holds no parameters");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  const auto device = params.front().model.device();
  params_.resize(params.size());
  for (size_t n = 0; n < params.size(); ++n) {
    auto& model = params[n].model;
    TORCH_CHECK(model.device() == device, "DistributedOptimizer: all parameters must be on one device, got ",
                device, " and ", model.device());
    TORCH_CHECK(model.is_floating_point(), "DistributedOptimizer: parameters must be floating point, got ",
                model.scalar_type());
    TORCH_CHECK(params[n].fp8_meta || model.requires_grad(), "DistributedOptimizer: parameter ", n,
                " of the optimizer does not require grad");
    params_[n].model = model;
    params_[n].fp8_meta = std::move(params[n].fp8_meta);
    params_[n].numel = model.numel();
  }
  lay_out(grad_reduce_in_fp32);
  torch::NoGradGuard no_grad;
  for (auto& buffer : buffers_) {
    buffer.params = torch::zeros({buffer.numel}, torch::TensorOptions().dtype(buffer.param_dtype).device(device));
    buffer.grads = torch::zeros({buffer.numel}, torch::TensorOptions().dtype(buffer.grad_dtype).device(device));
  }
  for (size_t n = 0; n < params_.size(); ++n) {
    auto& param = params_[n];
    auto view = buffers_[param.buffer].params.narrow(0, param.offset, param.numel).view(param.model.sizes());
    view.copy_(param.model.detach());
    param.model.set_data(view);  // the same TensorImpl, now a view: bucket_of stays valid
    gathers_->bucket_of.emplace(param.model.unsafeGetTensorImpl(), param.bucket);
    hook(n);
  }
  gathers_->works.resize(buckets_.size());
  broadcast_from_rank_zero();
  zero_grads();
}

void ParamAndGradBuffer::lay_out(bool grad_reduce_in_fp32) {
  // Buffers by parameter dtype; FP8 weights take the gradient dtype of the model's other
  // parameters (the compute dtype) unless grads reduce in float32.
  c10::ScalarType half_dtype = at::kFloat;
  for (const auto& param : params_) {
    const auto dtype = param.model.scalar_type();
    if (!isFloat8Type(dtype) && dtype != at::kFloat) half_dtype = dtype;
  }
  // Reverse order: the backward pass produces the last parameters' gradients first, so the
  // first bucket fills first.
  for (size_t n = params_.size(); n-- > 0;) {
    auto& param = params_[n];
    const auto dtype = param.model.scalar_type();
    auto buffer = std::find_if(buffers_.begin(), buffers_.end(), [&](const Buffer& b) { return b.param_dtype == dtype; });
    if (buffer == buffers_.end()) {
      Buffer created;
      created.param_dtype = dtype;
      created.grad_dtype = grad_reduce_in_fp32 ? at::kFloat : (isFloat8Type(dtype) ? half_dtype : dtype);
      buffers_.push_back(created);
      buffer = buffers_.end() - 1;
    }
    param.buffer = static_cast<size_t>(buffer - buffers_.begin());
    // A new bucket when this buffer has none open or its open one is full.
    Bucket* open = nullptr;
    for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
      if (it->buffer == param.buffer) {
        open = &*it;
        break;
      }
    }
    if (open == nullptr || open->size >= options_.bucket_size()) {
      Bucket bucket;
      bucket.buffer = param.buffer;
      bucket.begin = buffer->numel;
      buckets_.push_back(bucket);
      open = &buckets_.back();
    }
    param.offset = open->begin + open->size;
    param.bucket = static_cast<size_t>(open - buckets_.data());
    open->size += param.numel;
    open->params.push_back(n);
    buffer->numel = open->begin + open->size;
  }
  // Launch order: the order in which the backward pass completes the buckets, across buffers
  // (FP8 weights and the rest interleave): a bucket is complete when its first parameter's
  // gradient arrives, and the backward pass produces them from the last parameter to the first.
  // (A bucket's params were added last to first: its first parameter is params.back().)
  launch_order_.resize(buckets_.size());
  std::iota(launch_order_.begin(), launch_order_.end(), size_t{0});
  std::sort(launch_order_.begin(), launch_order_.end(),
            [&](size_t a, size_t b) { return buckets_[a].params.back() > buckets_[b].params.back(); });
  // Gather order: the forward pass uses the parameters first to last (the optimizer's order, a
  // module's registration order), so the bucket holding the first parameter goes first.
  gather_order_.assign(launch_order_.rbegin(), launch_order_.rend());
  // Pad every bucket; lay the buckets out again with the padded sizes.
  const int64_t multiple = world_size_ * kAlignment;
  for (auto& buffer : buffers_) buffer.numel = 0;
  for (auto& bucket : buckets_) {
    auto& buffer = buffers_[bucket.buffer];
    const int64_t shift = buffer.numel - bucket.begin;
    bucket.begin = buffer.numel;
    for (size_t p : bucket.params) params_[p].offset += shift;
    bucket.size = round_up(bucket.size, multiple);
    buffer.numel += bucket.size;
  }
}

void ParamAndGradBuffer::hook(size_t n) {
  auto& param = params_[n];
  if (param.fp8_meta) {
    // The FP8 weight has no autograd gradient: its wgrad GEMMs accumulate straight into its
    // slice of the bucket (main_grad bound to it, Megatron's param.main_grad), and its
    // MainGrad says when the last has, so its bucket can be reduced during the backward pass.
    param.fp8_meta->main_grad().bind(
        buffers_[param.buffer].grads.narrow(0, param.offset, param.numel).view(param.model.sizes()),
        param.model.device());
    param.fp8_meta->main_grad().set_ready_hook([this, n] { on_main_grad_ready(n); });
  } else {
    detail::set_post_accumulate_grad_hook(
        param.model, [this, n](const torch::Tensor& grad_holder) { on_grad_ready(n, grad_holder); });
  }
}

void ParamAndGradBuffer::broadcast_from_rank_zero() {
  // Every rank starts from rank 0's parameters (as DDP does), whatever each one initialized.
  for (auto& buffer : buffers_) {
    std::vector<torch::Tensor> one{isFloat8Type(buffer.param_dtype) ? buffer.params.view(at::kByte) : buffer.params};
    group_->broadcast(one, c10d::BroadcastOptions{/*rootRank=*/0})->wait();
  }
}

ParamAndGradBuffer::~ParamAndGradBuffer() {
  // The parameters outlive the buffer (views of its storage): none may stay under an all-gather.
  try {
    finish_param_gather();
  } catch (...) {  // a collective that failed: the run is over, the destructor must not throw
  }
  for (auto& param : params_) {
    if (param.fp8_meta) {
      param.fp8_meta->main_grad().set_ready_hook(nullptr);
      if (param.fp8_meta->main_grad().tensor().defined() &&
          param.fp8_meta->main_grad().tensor().is_alias_of(buffers_[param.buffer].grads)) {
        param.fp8_meta->main_grad().bind({}, param.model.device());
      }
    } else if (param.model.defined()) {
      detail::set_post_accumulate_grad_hook(param.model, nullptr);
    }
  }
}

std::vector<ParamAndGradBuffer::Shard> ParamAndGradBuffer::local_shards() const {
  std::vector<Shard> shards;
  for (const auto& bucket : buckets_) {
    const int64_t share = bucket.size / world_size_;
    const int64_t lo = bucket.begin + rank_ * share, hi = lo + share;
    const auto& buffer = buffers_[bucket.buffer];
    for (size_t p : bucket.params) {
      const auto& param = params_[p];
      const int64_t begin = std::max(lo, param.offset), end = std::min(hi, param.offset + param.numel);
      if (begin >= end) continue;
      Shard shard;
      shard.param = p;
      shard.param_offset = begin - param.offset;
      shard.numel = end - begin;
      shard.grad = buffer.grads.narrow(0, begin, shard.numel);
      shard.values = buffer.params.narrow(0, begin, shard.numel);
      shards.push_back(std::move(shard));
    }
  }
  return shards;
}

int64_t ParamAndGradBuffer::num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

int64_t ParamAndGradBuffer::padded_numel() const {
  int64_t total = 0;
  for (const auto& buffer : buffers_) total += buffer.numel;
  return total;
}

void ParamAndGradBuffer::on_grad_ready(size_t index, const torch::Tensor& tensor) {
  check_gathered(index);
  auto& param = params_[index];
  auto& grad = tensor.mutable_grad();
  if (!grad.defined()) return;
  auto& bucket = buckets_[param.bucket];
  TORCH_CHECK(!bucket.launched,
              "DistributedOptimizer: a gradient arrived for a bucket that is already being "
              "reduced. With gradient accumulation, call set_gradient_sync(false) before every "
              "micro-batch's backward but the last (the Trainer does), or step after each backward");
  {
    torch::NoGradGuard no_grad;
    buffers_[param.buffer].grads.narrow(0, param.offset, param.numel).add_(grad.reshape(-1));
  }
  grad.reset();
  // Only the backward pass that synchronizes (the last micro-batch's) counts towards launching.
  if (sync_ && !param.ready) {
    param.ready = true;
    --bucket.pending;
  }
  if (sync_ && options_.overlap_grad_reduce()) launch_ready_buckets();
}

void ParamAndGradBuffer::on_main_grad_ready(size_t index) {
  // The gradient is already in the bucket (main_grad is its slice); micro-batches that do not
  // synchronize just accumulate there. (The module calls this once per backward pass, after
  // its last use in it: a layer used twice in one forward pass has both gradients in by then.)
  check_gathered(index);
  if (!options_.overlap_grad_reduce()) return;
  auto& param = params_[index];
  auto& bucket = buckets_[param.bucket];
  if (!sync_) {
    TORCH_CHECK(!(param.ready && bucket.launched),
                "DistributedOptimizer: an FP8 weight's gradient arrived after the micro-batch that "
                "synchronizes, for a bucket already being reduced: call set_gradient_sync(false) "
                "before every micro-batch's backward but the last");
    return;
  }
  TORCH_CHECK(!bucket.launched,
              "DistributedOptimizer: an FP8 weight's gradient arrived for a bucket that is already "
              "being reduced (a layer whose backward ran after its bucket was complete)");
  if (!param.ready) {
    param.ready = true;
    --bucket.pending;
  }
  launch_ready_buckets();
}

void ParamAndGradBuffer::launch_ready_buckets() {
  while (next_launch_ < launch_order_.size()) {
    auto& bucket = buckets_[launch_order_[next_launch_]];
    if (bucket.pending > 0) break;
    launch(bucket);
    ++next_launch_;
  }
}

void ParamAndGradBuffer::launch(Bucket& bucket) {
  auto input = buffers_[bucket.buffer].grads.narrow(0, bucket.begin, bucket.size);
  auto output = input.narrow(0, rank_ * (bucket.size / world_size_), bucket.size / world_size_);
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::AVG;
  bucket.work = group_->_reduce_scatter_base(output, input, options);
  bucket.launched = true;
}

void ParamAndGradBuffer::finish_grad_sync() {
  finish_param_gather();  // the last step's, when the forward pass did not wait for them all
  // An FP8 weight's gradient reaches its bucket only through the binding: a weight unbound or
  // re-bound since the buffer was made would train on zeros without a word.
  for (size_t n = 0; n < params_.size(); ++n) {
    const auto& param = params_[n];
    if (!param.fp8_meta) continue;
    const auto& main_grad = param.fp8_meta->main_grad().tensor();
    const auto& grads = buffers_[param.buffer].grads;
    const auto* slice = static_cast<const char*>(grads.const_data_ptr()) + param.offset * grads.element_size();
    TORCH_CHECK(main_grad.defined() && main_grad.const_data_ptr() == slice,
                "DistributedOptimizer: FP8 weight ", n, "'s main_grad is no longer its slice of the "
                "gradient buffer (set_main_grad_buffer was called after connect), so its gradient "
                "would not be reduced");
  }
  relink_params();
  if (step_events_.size() == 4096) step_events_.pop_front();
  step_events_.push_back(std::make_unique<StepEvents>());
  timing_step_ = true;
  record_event(0);
  while (next_launch_ < launch_order_.size()) launch(buckets_[launch_order_[next_launch_++]]);
  for (auto& bucket : buckets_) {
    if (bucket.work) bucket.work->wait();
    bucket.work.reset();
    step_events_.back()->reduce_bytes += bucket.size * c10::elementSize(buffers_[bucket.buffer].grad_dtype);
  }
  record_event(1);
}

void ParamAndGradBuffer::relink_params() {
  finish_param_gather();  // never write under an all-gather
  torch::NoGradGuard no_grad;
  for (auto& param : params_) {
    auto view = buffers_[param.buffer].params.narrow(0, param.offset, param.numel);
    if (param.model.data_ptr() == view.data_ptr() && param.model.numel() == param.numel) continue;
    view.copy_(param.model.detach().reshape(-1));
    param.model.set_data(view.view(param.model.sizes()));
  }
}

void ParamAndGradBuffer::gather_params() {
  finish_param_gather();
  record_event(2);
  auto& gathers = *gathers_;
  gathers.timed_on.reset();
  for (size_t b : gather_order_) {
    const auto& bucket = buckets_[b];
    auto region = buffers_[bucket.buffer].params.narrow(0, bucket.begin, bucket.size);
    if (isFloat8Type(region.scalar_type())) region = region.view(at::kByte);  // FP8 travels as bytes
    auto shard = region.narrow(0, rank_ * (bucket.size / world_size_), bucket.size / world_size_);
    gathers.works[b] = group_->_allgather_base(region, shard);
    ++gathers.in_flight;
    if (timing_step_) step_events_.back()->gather_bytes += region.numel() * region.element_size();
  }
  // The gather rewrites every parameter through its view of the buffer, which no version counter
  // sees: each is bumped, so that what is keyed on a parameter's version (Fp8Linear's
  // cache_fp8_weight) takes the new values.
  for (auto& param : params_) param.model.unsafeGetTensorImpl()->bump_version();
  if (options_.overlap_param_gather()) {
    // Left in flight: the forward pass waits for each block's buckets (wait_for_params).
    const bool timed = timing_step_ && step_events_.back()->events[2].has_value();
    if (timed) gathers.timed_on = buffers_.front().params.device();
    gathering_step_ = timing_step_ ? step_events_.back().get() : nullptr;
    detail::register_in_flight(gathers_);
  } else {
    for (size_t b : gather_order_) gathers.wait(b);
    record_event(3);
    if (timing_step_) step_events_.back()->gathered = true;
  }
  timing_step_ = false;
}

void ParamAndGradBuffer::finish_param_gather() {
  for (size_t b : gather_order_) gathers_->wait(b);
  if (gathering_step_ != nullptr) {
    for (auto& wait : gathers_->waits) gathering_step_->gather_waits.push_back(std::move(wait));
    gathering_step_->gathered = true;
    gathering_step_ = nullptr;
  }
  gathers_->waits.clear();
}

void ParamAndGradBuffer::check_gathered(size_t index) const {
  TORCH_CHECK(!gathers_->works[params_[index].bucket],
              "DistributedOptimizer (overlap_param_gather): parameter ", index, " (",
              params_[index].model.sizes(), ") got a gradient, but the forward pass used it "
              "before its all-gather was waited for, so it computed with its value from before the "
              "last step. Call amp8::wait_for_params(block) before each block of the forward "
              "pass (GptModel and LlamaModel do), or turn overlap_param_gather off");
}

void ParamAndGradBuffer::record_event(size_t which) {
  if (!timing_step_ || buffers_.empty()) return;
  const auto device = buffers_.front().params.device();
  if (device.type() != c10::DeviceType::CUDA) return;
  auto& slot = step_events_.back()->events[which];
  slot.emplace(device.type(), c10::EventFlag::BACKEND_DEFAULT);  // BACKEND_DEFAULT: timed
  slot->record(detail::current_stream(device));
}

std::vector<ParamAndGradBuffer::StepCommunication> ParamAndGradBuffer::take_communication_times() {
  std::vector<StepCommunication> times;
  while (!step_events_.empty()) {
    auto& step = *step_events_.front();
    const auto& e = step.events;
    if (!step.gathered || !e[0]) {  // in progress, skipped (fp16 overflow: nothing gathered) or on the CPU
      if (step_events_.size() == 1 && (timing_step_ || gathering_step_ == &step)) break;
      step_events_.pop_front();
      continue;
    }
    StepCommunication t;
    if (step.gather_waits.empty()) {
      e[3]->synchronize();
      t.gather_ms = e[2]->elapsedTime(*e[3]);
    } else {
      for (auto& [start, end] : step.gather_waits) {
        end.synchronize();
        t.gather_ms += start.elapsedTime(end);
      }
    }
    t.reduce_ms = e[0]->elapsedTime(*e[1]);
    t.reduce_bytes = step.reduce_bytes;
    t.gather_bytes = step.gather_bytes;
    times.push_back(t);
    step_events_.pop_front();
  }
  return times;
}

void ParamAndGradBuffer::zero_grads() {
  for (auto& bucket : buckets_) {
    if (bucket.work) bucket.work->wait();  // never free a buffer a collective still uses
    bucket.work.reset();
    bucket.launched = false;
    bucket.pending = static_cast<int64_t>(bucket.params.size());
  }
  next_launch_ = 0;
  timing_step_ = false;
  torch::NoGradGuard no_grad;
  for (auto& buffer : buffers_) buffer.grads.zero_();
  for (auto& param : params_) {
    param.ready = false;
    if (param.fp8_meta) param.fp8_meta->main_grad().zero();
    else param.model.mutable_grad().reset();
  }
}

}  // namespace amp8
