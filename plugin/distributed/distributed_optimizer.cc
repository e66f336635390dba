#include "plugin/distributed/distributed_optimizer.h"

#include <c10/core/Event.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <optional>
#include <cmath>

#include "ops/quantize.h"
#include "plugin/compat/torch_internals.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/optim/grad_clip.h"

namespace amp8 {
namespace {

constexpr int64_t kAlignment = 64;  // elements; every shard starts on a multiple of it

bool is_fp8(c10::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2; }

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

void DistributedOptimizerOptions::validate() const {
  TORCH_CHECK(bucket_size_ >= 1, "bucket_size must be >= 1 element, got ", bucket_size_);
}

// One model parameter: where it lives in its buffer, and its state in the current step.
struct DistributedOptimizer::Param {
  torch::Tensor model;
  std::shared_ptr<Fp8LinearImpl> fp8_owner;
  size_t buffer = 0, bucket = 0;
  int64_t fp8_slot = -1;  // fp8_owner: its index among the FP8 weights (amax, scale)
  int64_t offset = 0;  // in its buffer
  int64_t numel = 0;
  bool ready = false;  // its gradient is in the buffer for this backward pass
};

// A contiguous range of one buffer, reduce-scattered and all-gathered as one collective.
struct DistributedOptimizer::Bucket {
  size_t buffer = 0;
  int64_t begin = 0, size = 0;  // padded: size % (world_size * kAlignment) == 0
  std::vector<size_t> params;
  int64_t pending = 0;  // parameters whose gradient is not in yet
  bool launched = false;
  c10::intrusive_ptr<c10d::Work> work;
};

// The parameters of one dtype: their values (the model's parameters are views of `params`) and
// their gradients (`grads`, in the reduce dtype).
struct DistributedOptimizer::Buffer {
  c10::ScalarType param_dtype, grad_dtype;
  torch::Tensor params, grads;
  int64_t numel = 0;
};

// Timing events of one step (see communication_times): recorded on the compute stream.
struct DistributedOptimizer::StepEvents {
  std::array<std::optional<c10::Event>, 4> events;
  int64_t reduce_bytes = 0, gather_bytes = 0;
};

// The intersection of one parameter with this rank's shard of its bucket.
struct DistributedOptimizer::Piece {
  size_t param = 0;
  int64_t param_offset = 0;   // within the parameter (flattened)
  int64_t buffer_offset = 0;  // within the buffer
  int64_t numel = 0;
  torch::Tensor master;       // float32 [numel], what the optimizer steps
};

DistributedOptimizer::DistributedOptimizer(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                           DistributedOptimizerOptions options, bool grad_reduce_in_fp32)
    : group_(std::move(group)), options_(options), grad_reduce_in_fp32_(grad_reduce_in_fp32) {
  TORCH_CHECK(group_, "DistributedOptimizer: the process group must not be null");
  options_.validate();
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
}

DistributedOptimizer::~DistributedOptimizer() {
  // The hooks point at this object: take them off the parameters, which may outlive it.
  for (auto& param : params_) {
    if (param.fp8_owner) {
      param.fp8_owner->set_main_grad_hook(nullptr);
      if (param.fp8_owner->main_grad().defined() &&
          param.fp8_owner->main_grad().is_alias_of(buffers_[param.buffer].grads)) {
        param.fp8_owner->set_main_grad_buffer({});
      }
    } else if (param.model.defined()) {
      detail::set_post_accumulate_grad_hook(param.model, nullptr);
    }
  }
}

c10::ScalarType DistributedOptimizer::grad_reduce_dtype(c10::ScalarType params_dtype) const {
  return grad_reduce_in_fp32_ ? at::kFloat : params_dtype;
}

int64_t DistributedOptimizer::num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

int64_t DistributedOptimizer::padded_numel() const {
  int64_t total = 0;
  for (const auto& buffer : buffers_) total += buffer.numel;
  return total;
}

void DistributedOptimizer::connect(torch::optim::Optimizer& optimizer, std::vector<ParamSpec> specs) {
  TORCH_CHECK(!connected_, "DistributedOptimizer::connect was already called");
  connected_ = true;
  size_t total = 0;
  for (const auto& group : optimizer.param_groups()) total += group.params().size();
  TORCH_CHECK(total == specs.size(), "DistributedOptimizer::connect: the optimizer holds ", total,
              " parameters, got ", specs.size(), " specs");
  TORCH_CHECK(!specs.empty(), "DistributedOptimizer: the optimizer holds no parameters");
  const auto device = specs.front().model.device();

  // Buffers by parameter dtype; FP8 weights take the gradient dtype of the model's other
  // parameters (the compute dtype) unless grads reduce in float32.
  c10::ScalarType half_dtype = at::kFloat;
  for (const auto& spec : specs) {
    TORCH_CHECK(spec.model.device() == device, "DistributedOptimizer: all parameters must be on one device, got ",
                device, " and ", spec.model.device());
    TORCH_CHECK(spec.model.is_floating_point(), "DistributedOptimizer: parameters must be floating point, got ",
                spec.model.scalar_type());
    if (!is_fp8(spec.model.scalar_type()) && spec.model.scalar_type() != at::kFloat) {
      half_dtype = spec.model.scalar_type();
    }
  }
  params_.resize(specs.size());
  std::vector<size_t> optimizer_group(specs.size());
  {
    size_t i = 0;
    for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      for (size_t k = 0; k < optimizer.param_groups()[g].params().size(); ++k) optimizer_group[i++] = g;
    }
  }
  // Reverse order: the backward pass produces the last parameters' gradients first, so the
  // first bucket fills first.
  const int64_t multiple = world_size_ * kAlignment;
  for (size_t n = specs.size(); n-- > 0;) {
    const auto& spec = specs[n];
    auto& param = params_[n];
    param.model = spec.model;
    param.fp8_owner = spec.fp8_owner;
    param.numel = spec.model.numel();
    const auto dtype = spec.model.scalar_type();
    auto buffer = std::find_if(buffers_.begin(), buffers_.end(), [&](const Buffer& b) { return b.param_dtype == dtype; });
    if (buffer == buffers_.end()) {
      Buffer created;
      created.param_dtype = dtype;
      created.grad_dtype = grad_reduce_in_fp32_ ? at::kFloat : (is_fp8(dtype) ? half_dtype : dtype);
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
  // Pad every bucket; lay the buckets out again with the padded sizes.
  for (auto& buffer : buffers_) buffer.numel = 0;
  for (auto& bucket : buckets_) {
    auto& buffer = buffers_[bucket.buffer];
    const int64_t shift = buffer.numel - bucket.begin;
    bucket.begin = buffer.numel;
    for (size_t p : bucket.params) params_[p].offset += shift;
    bucket.size = round_up(bucket.size, multiple);
    buffer.numel += bucket.size;
  }

  torch::NoGradGuard no_grad;
  for (auto& buffer : buffers_) {
    buffer.params = torch::zeros({buffer.numel}, torch::TensorOptions().dtype(buffer.param_dtype).device(device));
    buffer.grads = torch::zeros({buffer.numel}, torch::TensorOptions().dtype(buffer.grad_dtype).device(device));
  }
  for (size_t n = 0; n < params_.size(); ++n) {
    auto& param = params_[n];
    if (param.fp8_owner) {
      param.fp8_slot = static_cast<int64_t>(fp8_params_.size());
      fp8_params_.push_back(n);
    }
    auto view = buffers_[param.buffer].params.narrow(0, param.offset, param.numel).view(param.model.sizes());
    view.copy_(param.model.detach());
    param.model.set_data(view);
    if (param.fp8_owner) {
      // The FP8 weight has no autograd gradient: its wgrad GEMMs accumulate straight into its
      // slice of the bucket (main_grad bound to it, Megatron's param.main_grad), and the module
      // says when the last has, so its bucket can be reduced during the backward pass.
      param.fp8_owner->set_main_grad_buffer(
          buffers_[param.buffer].grads.narrow(0, param.offset, param.numel).view(param.model.sizes()));
      param.fp8_owner->set_main_grad_hook([this, n] { on_main_grad_ready(n); });
    } else {
      TORCH_CHECK(param.model.requires_grad(), "DistributedOptimizer: parameter ", n,
                  " of the optimizer does not require grad");
      detail::set_post_accumulate_grad_hook(
          param.model, [this, n](const torch::Tensor& grad_holder) { on_grad_ready(n, grad_holder); });
    }
  }
  // Every rank starts from rank 0's parameters (as DDP does), whatever each one initialized:
  // the parameter buffers (FP8 as bytes) and the float32 values the masters start from.
  {
    std::vector<torch::Tensor> tensors;
    for (auto& buffer : buffers_) {
      tensors.push_back(is_fp8(buffer.param_dtype) ? buffer.params.view(at::kByte) : buffer.params);
    }
    // Seeds one at a time, in place where they already are float32 on the device (no second
    // copy of the model).
    for (auto& spec : specs) {
      if (!spec.seed.defined()) continue;
      spec.seed = spec.seed.detach().to(device, at::kFloat).contiguous();
      tensors.push_back(spec.seed);
    }
    for (auto& tensor : tensors) {
      std::vector<torch::Tensor> one{tensor};
      group_->broadcast(one, c10d::BroadcastOptions{/*rootRank=*/0})->wait();
    }
  }

  // This rank's shard of every bucket, cut along the parameters it holds.
  std::vector<std::vector<torch::Tensor>> group_params(optimizer.param_groups().size());
  for (const auto& bucket : buckets_) {
    const int64_t shard = bucket.size / world_size_;
    const int64_t lo = bucket.begin + rank_ * shard, hi = lo + shard;
    for (size_t p : bucket.params) {
      const auto& param = params_[p];
      const int64_t begin = std::max(lo, param.offset), end = std::min(hi, param.offset + param.numel);
      if (begin >= end) continue;
      Piece piece;
      piece.param = p;
      piece.param_offset = begin - param.offset;
      piece.buffer_offset = begin;
      piece.numel = end - begin;
      const auto& seed = specs[p].seed.defined() ? specs[p].seed : specs[p].model;
      piece.master = seed.detach()
                         .reshape(-1)
                         .narrow(0, piece.param_offset, piece.numel)
                         .to(device, at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                         .requires_grad_(true);
      group_params[optimizer_group[p]].push_back(piece.master);
      pieces_.push_back(std::move(piece));
    }
  }
  for (const auto& piece : pieces_) master_shards_.push_back(piece.master);
  // Each local FP8 piece's weight slot, in pieces_ order (gather_params scatters their amaxes
  // with it). A rank holds at most one piece of a weight: its shard of the weight's bucket is
  // one contiguous range.
  std::vector<int64_t> fp8_piece_slots;
  for (const auto& piece : pieces_) {
    if (params_[piece.param].fp8_owner) fp8_piece_slots.push_back(params_[piece.param].fp8_slot);
  }
  if (!fp8_piece_slots.empty()) {
    auto sorted = fp8_piece_slots;
    std::sort(sorted.begin(), sorted.end());
    TORCH_INTERNAL_ASSERT(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                          "DistributedOptimizer: two local pieces of one FP8 weight");
    fp8_piece_slots_ = torch::tensor(fp8_piece_slots, torch::TensorOptions().dtype(at::kLong))
                           .to(buffers_.front().params.device());
  }
  for (size_t g = 0; g < group_params.size(); ++g) optimizer.param_groups()[g].params() = group_params[g];
  // FP8 weights: quantized again from the (rank 0) masters with an all-reduced amax, so their
  // bytes and scales agree on every rank from the first forward pass.
  if (!fp8_params_.empty()) gather_params();
  zero_gradients();
}

void DistributedOptimizer::on_grad_ready(size_t index, const torch::Tensor& tensor) {
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

void DistributedOptimizer::on_main_grad_ready(size_t index) {
  // The gradient is already in the bucket (main_grad is its slice); micro-batches that do not
  // synchronize just accumulate there. (The module calls this once per backward pass, after
  // its last use in it: a layer used twice in one forward pass has both gradients in by then.)
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

void DistributedOptimizer::launch_ready_buckets() {
  while (next_launch_ < launch_order_.size()) {
    auto& bucket = buckets_[launch_order_[next_launch_]];
    if (bucket.pending > 0) break;
    launch(bucket);
    ++next_launch_;
  }
}

void DistributedOptimizer::launch(Bucket& bucket) {
  auto input = buffers_[bucket.buffer].grads.narrow(0, bucket.begin, bucket.size);
  auto output = input.narrow(0, rank_ * (bucket.size / world_size_), bucket.size / world_size_);
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::AVG;
  bucket.work = group_->_reduce_scatter_base(output, input, options);
  bucket.launched = true;
}

std::vector<torch::Tensor> DistributedOptimizer::reduce_gradients() {
  TORCH_CHECK(connected_, "DistributedOptimizer: connect before reducing gradients");
  // An FP8 weight's gradient reaches its bucket only through the binding: a module reset()
  // or re-bound since connect would train on zeros without a word.
  for (size_t n : fp8_params_) {
    const auto& param = params_[n];
    const auto& main_grad = param.fp8_owner->main_grad();
    const auto& grads = buffers_[param.buffer].grads;
    const auto* slice = static_cast<const char*>(grads.const_data_ptr()) + param.offset * grads.element_size();
    TORCH_CHECK(main_grad.defined() && main_grad.const_data_ptr() == slice,
                "DistributedOptimizer: FP8 weight ", n, "'s main_grad is no longer its slice of the "
                "gradient buffer (the module was reset() or set_main_grad_buffer was called after "
                "connect), so its gradient would not be reduced");
  }
  if (step_events_.size() == 4096) step_events_.pop_front();
  step_events_.push_back(std::make_unique<StepEvents>());
  timing_step_ = true;
  record_event(0);
  while (next_launch_ < launch_order_.size()) launch(buckets_[launch_order_[next_launch_++]]);
  for (auto& bucket : buckets_) {
    if (bucket.work) bucket.work->wait();
    bucket.work.reset();
    step_events_.back()->reduce_bytes +=
        bucket.size * c10::elementSize(buffers_[bucket.buffer].grad_dtype);
  }
  record_event(1);
  std::vector<torch::Tensor> grads;
  grads.reserve(pieces_.size());
  for (auto& piece : pieces_) {
    const auto& buffer = buffers_[params_[piece.param].buffer];
    auto grad = buffer.grads.narrow(0, piece.buffer_offset, piece.numel);
    if (grad.scalar_type() != at::kFloat) grad = grad.to(at::kFloat);
    piece.master.mutable_grad() = grad;
    grads.push_back(grad);
  }
  return grads;
}

double DistributedOptimizer::clip_grad_norm(double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& piece : pieces_) {
    if (piece.master.grad().defined()) grads.push_back(piece.master.grad());
  }
  return clip_grad_norm_(grads, max_norm, group_.get(), buffers_.front().grads.device());
}

void DistributedOptimizer::relink_params() {
  // A checkpoint load (torch's InputArchive) gives a parameter new storage; make it a view of
  // the parameter buffer again, with the loaded values, before the buffer is gathered into.
  for (auto& param : params_) {
    auto view = buffers_[param.buffer].params.narrow(0, param.offset, param.numel);
    if (param.model.data_ptr() == view.data_ptr() && param.model.numel() == param.numel) continue;
    view.copy_(param.model.detach().reshape(-1));
    param.model.set_data(view.view(param.model.sizes()));
  }
}

void DistributedOptimizer::gather_params() {
  torch::NoGradGuard no_grad;
  relink_params();
  // FP8 weights: the amax of each whole weight, all-reduced, gives its scale on every rank.
  // Batched over the weights (one multi-tensor amax, one scale kernel, one multi-tensor history
  // update): per weight, these were ~10 small launches, at 350m most of the FP8 step's host
  // time after the backward pass.
  const auto& fp8_params = fp8_params_;
  torch::Tensor amaxes, scales, scale_invs;
  if (!fp8_params.empty()) {
    const auto device = buffers_.front().params.device();
    amaxes = torch::zeros({static_cast<int64_t>(fp8_params.size())},
                          torch::TensorOptions().dtype(at::kFloat).device(device));
    std::vector<torch::Tensor> fp8_masters;
    for (const auto& piece : pieces_) {
      if (params_[piece.param].fp8_owner) fp8_masters.push_back(piece.master.detach());
    }
    if (!fp8_masters.empty()) {
      // max|x| of each piece (the infinity norm; NaN when it holds one), into its weight's slot.
      auto piece_amaxes = at::stack(at::_foreach_norm(fp8_masters, INFINITY)).to(at::kFloat);
      amaxes.index_copy_(0, fp8_piece_slots_, piece_amaxes);
    }
    std::vector<torch::Tensor> tensors{amaxes};
    group_->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
    scales = compute_current_scale(amaxes, Fp8Format::kE4M3);
    scale_invs = scales.reciprocal();
  }
  for (const auto& piece : pieces_) {
    const auto& param = params_[piece.param];
    auto target = buffers_[param.buffer].params.narrow(0, piece.buffer_offset, piece.numel);
    if (param.fp8_owner) {
      const int64_t slot = param.fp8_slot;
      quantize(piece.master.detach(), scales.narrow(0, slot, 1), Fp8Format::kE4M3, {}, false, target);
    } else {
      target.copy_(piece.master.detach());
    }
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  record_event(2);
  for (const auto& bucket : buckets_) {
    auto region = buffers_[bucket.buffer].params.narrow(0, bucket.begin, bucket.size);
    if (is_fp8(region.scalar_type())) region = region.view(at::kByte);  // FP8 travels as bytes
    auto shard = region.narrow(0, rank_ * (bucket.size / world_size_), bucket.size / world_size_);
    works.push_back(group_->_allgather_base(region, shard));
    if (timing_step_) step_events_.back()->gather_bytes += region.numel() * region.element_size();
  }
  for (auto& work : works) work->wait();
  record_event(3);
  timing_step_ = false;
  if (!fp8_params.empty()) {
    std::vector<Fp8LinearImpl*> owners;
    owners.reserve(fp8_params.size());
    for (size_t index : fp8_params) owners.push_back(params_[index].fp8_owner.get());
    Fp8LinearImpl::fp8_weights_written(owners, amaxes, scale_invs);
  }
}

void DistributedOptimizer::record_event(size_t which) {
  if (!timing_step_ || buffers_.empty()) return;
  const auto device = buffers_.front().params.device();
  if (device.type() != c10::DeviceType::CUDA) return;
  auto& slot = step_events_.back()->events[which];
  slot.emplace(device.type(), c10::EventFlag::BACKEND_DEFAULT);  // BACKEND_DEFAULT: timed
  slot->record(detail::current_stream(device));
}

std::vector<DistributedOptimizer::StepCommunication> DistributedOptimizer::take_communication_times() {
  std::vector<StepCommunication> times;
  while (!step_events_.empty()) {
    const auto& e = step_events_.front()->events;
    if (!e[3]) {  // in progress, skipped (fp16 overflow: nothing gathered) or on the CPU
      if (step_events_.size() == 1 && timing_step_) break;
      step_events_.pop_front();
      continue;
    }
    e[3]->synchronize();
    const auto& step = step_events_.front();
    StepCommunication t;
    t.reduce_ms = e[0]->elapsedTime(*e[1]);
    t.gather_ms = e[2]->elapsedTime(*e[3]);
    t.reduce_bytes = step->reduce_bytes;
    t.gather_bytes = step->gather_bytes;
    times.push_back(t);
    step_events_.pop_front();
  }
  return times;
}

void DistributedOptimizer::zero_gradients() {
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
    if (param.fp8_owner) param.fp8_owner->zero_main_grad();
    else param.model.mutable_grad().reset();
  }
  for (auto& piece : pieces_) piece.master.mutable_grad().reset();
}

}  // namespace amp8
