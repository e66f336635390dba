#include "plugin/distributed/distributed_optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include <c10/util/accumulate.h>

#include "ops/accumulate.h"
#include "ops/blockwise.h"
#include "ops/quantize.h"
#include "plugin/modules/fp8_meta.h"
#include "plugin/optim/fused_optimizer.h"
#include "plugin/optim/grad_clip.h"

namespace amp8 {
namespace {

const void* key(const torch::Tensor& t) { return t.unsafeGetTensorImpl(); }

// Parameters' places in flat zeroed buffers, one per dtype (Megatron's grad buffers): the one-rank
// float32 sums and the static gradients. add() appends parameter n; allocate() makes the buffers
// and returns each parameter's view (undefined for one not added).
class FlatLayout {
 public:
  void add(size_t n, at::ScalarType dtype, at::IntArrayRef sizes) {
    auto& layout = layouts_[dtype];
    layout.slots.push_back({n, layout.size, sizes.vec()});
    layout.size += c10::multiply_integers(sizes);
  }
  bool empty() const { return layouts_.empty(); }
  std::vector<torch::Tensor> allocate(size_t num_params, const torch::Device& device,
                                      std::vector<torch::Tensor>& buffers) const {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> views(num_params);
    for (const auto& [dtype, layout] : layouts_) {
      buffers.push_back(torch::zeros({layout.size}, torch::TensorOptions().dtype(dtype).device(device)));
      for (const auto& slot : layout.slots) {
        views[slot.n] = buffers.back().narrow(0, slot.offset, c10::multiply_integers(slot.sizes)).view(slot.sizes);
      }
    }
    return views;
  }

 private:
  struct Slot {
    size_t n;
    int64_t offset;
    std::vector<int64_t> sizes;
  };
  struct Layout {
    int64_t size = 0;
    std::vector<Slot> slots;
  };
  std::map<at::ScalarType, Layout> layouts_;
};

}  // namespace

DistributedOptimizer::DistributedOptimizer(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                           DistributedOptimizerOptions options, bool grad_reduce_in_fp32,
                                           Fp8WeightScaling fp8_weight_scaling)
    : group_(std::move(group)),
      options_(options),
      grad_reduce_in_fp32_(grad_reduce_in_fp32),
      fp8_weight_scaling_(fp8_weight_scaling) {
  options_.validate();
  if (group_) {
    rank_ = group_->getRank();
    world_size_ = group_->getSize();
  }
}

DistributedOptimizer::~DistributedOptimizer() {
  // The layers outlive this optimizer: their main_grad must not stay bound to its buffers.
  for (auto& param : params_) {
    if (static_gradients_on_ && param.fp8_meta && param.fp8_meta->main_grad().is_bound()) {
      param.fp8_meta->main_grad().bind({}, param.model.device());
    }
  }
}

void DistributedOptimizer::connect(torch::optim::Optimizer& optimizer, std::vector<ParamSpec> specs) {
  TORCH_CHECK(!connected_, "DistributedOptimizer::connect was already called");
  connected_ = true;
  size_t total = 0;
  for (const auto& group : optimizer.param_groups()) total += group.params().size();
  TORCH_CHECK(total == specs.size(), "DistributedOptimizer::connect: the optimizer holds ", total,
              " parameters, got ", specs.size(), " specs");
  index_params(specs);
  if (world_size_ > 1) {
    std::vector<ParamAndGradBuffer::Param> buffered;
    buffered.reserve(specs.size());
    for (const auto& spec : specs) buffered.push_back({spec.model, spec.fp8_meta});
    buffer_ = std::make_unique<ParamAndGradBuffer>(group_, options_, grad_reduce_in_fp32_, std::move(buffered));
    broadcast_seeds(specs);
  }
  make_masters(specs);
  point_optimizer_at_masters(optimizer);
  // FP8 weights on several ranks: quantized again from the (rank 0) masters with an
  // all-reduced amax, so their bytes and scales agree on every rank from the first forward pass.
  // In 128×128 blocks on any number of ranks: the layers were built with one scale each.
  const bool in_blocks = fp8_weight_scaling_ == Fp8WeightScaling::kBlocks128x128;
  if ((buffer_ || in_blocks) && !fp8_params_.empty()) publish_params(/*half_copies_written=*/false);
  zero_gradients();
}

void DistributedOptimizer::index_params(const std::vector<ParamSpec>& specs) {
  params_.resize(specs.size());
  for (size_t n = 0; n < specs.size(); ++n) {
    params_[n].model = specs[n].model;
    params_[n].fp8_meta = specs[n].fp8_meta;
    if (specs[n].fp8_meta) {
      params_[n].fp8_slot = static_cast<int64_t>(fp8_params_.size());
      fp8_params_.push_back(n);
    }
  }
}

void DistributedOptimizer::broadcast_seeds(std::vector<ParamSpec>& specs) {
  // The masters start from rank 0's seeds, one at a time, in place where they already are
  // float32 on the device (no second copy of the model).
  const auto device = specs.front().model.device();
  for (auto& spec : specs) {
    if (!spec.seed.defined()) continue;
    spec.seed = spec.seed.detach().to(device, at::kFloat).contiguous();
    std::vector<torch::Tensor> one{spec.seed};
    group_->broadcast(one, c10d::BroadcastOptions{/*rootRank=*/0})->wait();
  }
}

void DistributedOptimizer::make_masters(const std::vector<ParamSpec>& specs) {
  torch::NoGradGuard no_grad;
  if (buffer_) {
    // This rank's shard of every bucket, cut along the parameters it holds.
    for (auto& shard : buffer_->local_shards()) {
      const auto& spec = specs[shard.param];
      const auto& seed = spec.seed.defined() ? spec.seed : spec.model;
      Piece piece;
      piece.param = shard.param;
      piece.offset = shard.param_offset;
      piece.master = seed.detach()
                         .reshape(-1)
                         .narrow(0, shard.param_offset, shard.numel)
                         .to(shard.values.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                         .requires_grad_(true);
      piece.grad = std::move(shard.grad);
      piece.target = std::move(shard.values);
      pieces_.push_back(std::move(piece));
    }
  } else {
    // One rank: every parameter whole, in its shape; a float32 parameter is its own master.
    for (size_t n = 0; n < specs.size(); ++n) {
      const auto& spec = specs[n];
      Piece piece;
      piece.param = n;
      piece.target = spec.model;
      if (!spec.fp8_meta && spec.model.scalar_type() == at::kFloat) {
        piece.master = spec.model;
      } else {
        const auto& seed = spec.seed.defined() ? spec.seed : spec.model;
        piece.master = seed.detach().to(spec.model.device(), at::kFloat).requires_grad_(true);
      }
      pieces_.push_back(std::move(piece));
    }
  }
  std::vector<int64_t> fp8_piece_slots;
  fp8_piece_ordinal_.assign(pieces_.size(), -1);
  for (size_t i = 0; i < pieces_.size(); ++i) {
    master_shards_.push_back(pieces_[i].master);
    piece_index_[key(pieces_[i].master)] = i;
    const auto& param = params_[pieces_[i].param];
    if (param.fp8_meta) {
      fp8_piece_ordinal_[i] = static_cast<int64_t>(fp8_piece_slots.size());
      fp8_piece_slots.push_back(param.fp8_slot);
    }
  }
  // Each local FP8 piece's weight slot, in pieces_ order (publish_params scatters their amaxes
  // with it). A rank holds at most one piece of a weight.
  if (!fp8_piece_slots.empty()) {
    fp8_piece_slots_ = torch::tensor(fp8_piece_slots, torch::TensorOptions().dtype(at::kLong))
                           .to(pieces_.front().master.device());
  }
}

void DistributedOptimizer::point_optimizer_at_masters(torch::optim::Optimizer& optimizer) {
  std::vector<size_t> optimizer_group;  // of each parameter, in the optimizer's order
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    optimizer_group.insert(optimizer_group.end(), optimizer.param_groups()[g].params().size(), g);
  }
  std::vector<std::vector<torch::Tensor>> group_params(optimizer.param_groups().size());
  for (auto& piece : pieces_) {
    piece.group = static_cast<int64_t>(optimizer_group[piece.param]);
    group_params[piece.group].push_back(piece.master);
  }
  for (size_t g = 0; g < group_params.size(); ++g) optimizer.param_groups()[g].params() = group_params[g];
}

void DistributedOptimizer::set_gradient_sync(bool enabled) {
  if (buffer_) {
    buffer_->set_gradient_sync(enabled);
    return;
  }
  if (enabled || !grad_reduce_in_fp32_ || main_grad_buffer_.defined() || !connected_) return;
  // The first micro-batch that does not end its step: from now on, sum in float32. Allocated
  // here, between micro-batches (never inside a CUDA graph's capture).
  FlatLayout layout;
  for (size_t n = 0; n < params_.size(); ++n) {
    const auto& model = params_[n].model;
    // As Megatron's main_grad: parameters that train; FP8 weights have theirs; and one device.
    if (params_[n].fp8_meta || !model.defined() || !model.requires_grad() || model.device() != device()) continue;
    if (model.scalar_type() != at::kBFloat16 && model.scalar_type() != at::kHalf) continue;
    layout.add(n, at::kFloat, model.sizes());
  }
  if (layout.empty()) return;
  std::vector<torch::Tensor> buffers;
  main_grads_ = layout.allocate(params_.size(), device(), buffers);
  main_grad_buffer_ = buffers.front();
  took_.assign(params_.size(), false);
}

void DistributedOptimizer::take_gradients() {
  if (!main_grad_buffer_.defined()) return;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> sums, grads;
  std::vector<bool> overwrite;
  std::vector<size_t> taken;
  for (size_t n = 0; n < params_.size(); ++n) {
    if (!main_grads_[n].defined() || !params_[n].model.grad().defined()) continue;
    sums.push_back(main_grads_[n]);
    grads.push_back(params_[n].model.grad());
    // A sum's first gradient of the step is written, not added: zero_gradients leaves the
    // sums as they are. Under static gradients a CUDA graph's capture may hold this take, and
    // a replay repeats it as captured: there every take adds into sums zeroed at the step.
    overwrite.push_back(!took_[n] && !static_gradients_on_);
    taken.push_back(n);
  }
  if (grads.empty()) return;
  std::vector<torch::Tensor> contiguous_grads;  // autograd's are nearly always contiguous already
  for (const auto& grad : grads) contiguous_grads.push_back(grad.contiguous());
  accumulate_in_float32(sums, contiguous_grads, overwrite);
  // Only once the sums hold them: a take that throws leaves no sum marked as this step's.
  for (const size_t n : taken) took_[n] = true;
  if (static_gradients_on_) {
    // The .grad stays where a CUDA graph's capture wrote it.
    at::_foreach_zero_(grads);
  } else {
    for (size_t n = 0; n < params_.size(); ++n) {
      if (main_grads_[n].defined()) params_[n].model.mutable_grad().reset();
    }
  }
}

std::vector<torch::Tensor> DistributedOptimizer::main_gradients() const {
  std::vector<torch::Tensor> summed;
  for (size_t n = 0; n < main_grads_.size(); ++n) {
    if (main_grads_[n].defined() && (took_[n] || static_gradients_on_)) summed.push_back(main_grads_[n]);
  }
  return summed;
}

const std::vector<torch::Tensor>& DistributedOptimizer::reduce_gradients() {
  TORCH_CHECK(connected_, "DistributedOptimizer: connect before reducing gradients");
  if (buffer_) buffer_->finish_grad_sync();
  // The last micro-batch's gradients (the plugin leaves them in .grad until now), and those
  // of a backward it did not see.
  take_gradients();
  grads_.assign(pieces_.size(), torch::Tensor());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const size_t n = pieces_[i].param;
    const auto& param = params_[n];
    if (buffer_) {
      grads_[i] = pieces_[i].grad;
    } else if (param.fp8_meta) {
      grads_[i] = param.fp8_meta->main_grad().tensor();
    } else {
      // A sum only where a gradient went in (or every one with static gradients, as their .grad):
      // a parameter that got none stays without one, as torch::optim expects.
      const bool summed = main_grad_buffer_.defined() && main_grads_[n].defined() && (took_[n] || static_gradients_on_);
      grads_[i] = summed ? main_grads_[n] : param.model.grad();
    }
  }
  return grads_;
}

std::vector<torch::Tensor> DistributedOptimizer::set_master_gradients() {
  TORCH_CHECK(grads_.size() == pieces_.size(), "DistributedOptimizer: reduce_gradients before set_master_gradients");
  std::vector<torch::Tensor> grads(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    auto& master = pieces_[i].master;
    const auto& grad = grads_[i];
    if (!grad.is_same(master.grad())) {
      master.mutable_grad() = !grad.defined() || grad.scalar_type() == at::kFloat ? grad : grad.to(at::kFloat);
    }
    grads[i] = master.grad();
  }
  return grads;
}

bool DistributedOptimizer::any_rank(const torch::Tensor& flag) const {
  if (world_size_ > 1) {
    std::vector<torch::Tensor> tensors{flag};
    group_->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
  }
  return flag.item<float>() > 0.0f;
}

at::Device DistributedOptimizer::device() const {
  return pieces_.empty() ? at::Device(at::kCPU) : pieces_.front().master.device();
}

torch::Tensor DistributedOptimizer::global_norm(const std::vector<torch::Tensor>& grads) const {
  return global_grad_norm_tensor(grads, reduce_group(), device());
}

bool DistributedOptimizer::fusable_on_gpu(const torch::optim::Optimizer& optimizer) const {
  if (pieces_.empty()) return false;  // nothing on a GPU to fuse (a rank whose shard is padding)
  for (const auto& piece : pieces_) {
    if (!piece.master.is_cuda()) return false;
  }
  return steps_these_masters(optimizer);
}

bool DistributedOptimizer::steps_these_masters(const torch::optim::Optimizer& optimizer) const {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      if (piece_index_.count(key(param)) == 0) return false;  // added after connect
    }
  }
  return true;
}

torch::Tensor DistributedOptimizer::half_copy(const Piece& piece) const {
  if (params_[piece.param].fp8_meta || piece.target.is_same(piece.master)) return {};
  const auto dtype = piece.target.scalar_type();
  return dtype == at::kBFloat16 || dtype == at::kHalf ? piece.target : torch::Tensor();
}

void DistributedOptimizer::step(torch::optim::Optimizer& optimizer, const std::optional<FusedStep>& fused) {
  torch::NoGradGuard no_grad;
  // FP8 weights with one scale: the fused Adam step measures each piece's amax as it writes the
  // master, so that publish_params does not read the masters a second time for them.
  torch::Tensor piece_amaxes;
  std::vector<bool> measured, written;
  const bool delayed = fp8_weight_scaling_ == Fp8WeightScaling::kPerTensorDelayed && !fp8_params_.empty();
  if (delayed && !fp8_weight_scales_.defined()) {
    // The first step after connect or a load: the scales from the masters as they are.
    fp8_weight_scales_ = compute_current_scale(fp8_weight_amaxes({}, {}), Fp8Format::kE4M3);
  }
  if (fused) {
    std::function<torch::Tensor(const torch::Tensor&)> amax_of, fp8_copy_of, copy_scale_of;
    if (fp8_piece_slots_.defined() && fp8_weight_scaling_ != Fp8WeightScaling::kBlocks128x128 &&
        is_fusable_adam(optimizer)) {
      piece_amaxes = torch::zeros({fp8_piece_slots_.numel()},
                                  torch::TensorOptions().dtype(at::kFloat).device(fp8_piece_slots_.device()));
      measured.assign(static_cast<size_t>(fp8_piece_slots_.numel()), false);
      amax_of = [&](const torch::Tensor& master) {
        const int64_t ordinal = fp8_piece_ordinal_[piece_index_.at(key(master))];
        if (ordinal < 0) return torch::Tensor();
        measured[static_cast<size_t>(ordinal)] = true;
        return piece_amaxes.narrow(0, ordinal, 1);
      };
      if (delayed) {
        // The FP8 weights written by the step itself, at the scales they already have.
        written.assign(measured.size(), false);
        fp8_copy_of = [&](const torch::Tensor& master) {
          const auto index = piece_index_.at(key(master));
          const int64_t ordinal = fp8_piece_ordinal_[index];
          if (ordinal < 0) return torch::Tensor();
          written[static_cast<size_t>(ordinal)] = true;
          return pieces_[index].target.view(master.sizes());
        };
        copy_scale_of = [&](const torch::Tensor& master) {
          const auto& param = params_[pieces_[piece_index_.at(key(master))].param];
          return fp8_weight_scales_.narrow(0, param.fp8_slot, 1);
        };
      }
    }
    fused_optimizer_step(
        optimizer, fused->grad_multiplier,
        [&](const torch::Tensor& master) { return grads_[piece_index_.at(key(master))]; },
        [&](const torch::Tensor& master) {
          if (fp8_copy_of) {
            if (auto fp8 = fp8_copy_of(master); fp8.defined()) return fp8;
          }
          return half_copy(pieces_[piece_index_.at(key(master))]);
        },
        fused->moment_dtypes, amax_of, copy_scale_of);
  } else {
    optimizer.step();
  }
  publish_params(/*half_copies_written=*/fused.has_value(), piece_amaxes, measured, written);
}

torch::Tensor DistributedOptimizer::fp8_weight_amaxes(torch::Tensor piece_amaxes, const std::vector<bool>& measured) {
  std::vector<torch::Tensor> fp8_masters;
  for (const auto& piece : pieces_) {
    if (params_[piece.param].fp8_meta) fp8_masters.push_back(piece.master.detach());
  }
  const auto device = params_[fp8_params_.front()].model.device();
  auto amaxes = torch::zeros({static_cast<int64_t>(fp8_params_.size())},
                             torch::TensorOptions().dtype(at::kFloat).device(device));
  if (!fp8_masters.empty()) {
    // max|x| of each piece (NaN when it holds one), into its weight's slot: as the fused Adam
    // step measured it, else read from the master here (every piece after an unfused or SGD
    // step; after a fused Adam step, a piece it did not update, having no gradient).
    if (!piece_amaxes.defined()) {
      piece_amaxes = compute_amax_many(fp8_masters);
    } else {
      std::vector<torch::Tensor> unmeasured;
      std::vector<size_t> unmeasured_ordinals;
      for (size_t j = 0; j < fp8_masters.size(); ++j) {
        if (measured[j]) continue;
        unmeasured.push_back(fp8_masters[j]);
        unmeasured_ordinals.push_back(j);
      }
      if (!unmeasured.empty()) {
        // Device-to-device copies into the slots (an index tensor from the host would wait
        // for the stream).
        const auto read = compute_amax_many(unmeasured);
        for (size_t k = 0; k < unmeasured.size(); ++k) {
          piece_amaxes.narrow(0, static_cast<int64_t>(unmeasured_ordinals[k]), 1)
              .copy_(read.narrow(0, static_cast<int64_t>(k), 1));
        }
      }
    }
    amaxes.index_copy_(0, fp8_piece_slots_, piece_amaxes);
  }
  if (world_size_ > 1) {
    std::vector<torch::Tensor> tensors{amaxes};
    group_->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
  }
  return amaxes;
}

void DistributedOptimizer::publish_params(bool half_copies_written, torch::Tensor piece_amaxes,
                                          const std::vector<bool>& measured, const std::vector<bool>& written) {
  torch::NoGradGuard no_grad;
  const bool in_blocks = fp8_weight_scaling_ == Fp8WeightScaling::kBlocks128x128;
  const bool delayed = fp8_weight_scaling_ == Fp8WeightScaling::kPerTensorDelayed;
  // FP8 weights with one scale: the amax of each whole weight (all-reduced over the ranks) gives
  // its scale, now (current) or at the next step (delayed: this step's weights are written at
  // the scales the last one gave). Batched over the weights (one multi-tensor amax, one scale
  // kernel, one multi-tensor history update): per weight, these were ~10 small launches, at 350m
  // most of the FP8 step's host time after the backward pass.
  torch::Tensor amaxes, scales, scale_invs;
  if (!fp8_params_.empty() && !in_blocks) {
    amaxes = fp8_weight_amaxes(piece_amaxes, measured);
    scales = delayed && fp8_weight_scales_.defined() ? fp8_weight_scales_
                                                    : compute_current_scale(amaxes, Fp8Format::kE4M3);
    scale_invs = scales.reciprocal();
  }
  // The FP8 weights from their masters in one multi-tensor launch (in blocks: from their
  // pieces), but those the fused step wrote; the half copies the fused step has not written.
  std::vector<torch::Tensor> fp8_masters, fp8_targets;
  std::vector<int64_t> fp8_slots;
  std::vector<size_t> fp8_pieces;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& piece = pieces_[i];
    const auto& param = params_[piece.param];
    if (param.fp8_meta && in_blocks) {
      fp8_pieces.push_back(i);
    } else if (param.fp8_meta) {
      const int64_t ordinal = fp8_piece_ordinal_[i];
      if (ordinal >= 0 && static_cast<size_t>(ordinal) < written.size() && written[static_cast<size_t>(ordinal)]) {
        continue;
      }
      fp8_masters.push_back(piece.master.detach());
      fp8_targets.push_back(piece.target);
      fp8_slots.push_back(param.fp8_slot);
    } else if (!piece.target.is_same(piece.master) && !(half_copies_written && half_copy(piece).defined())) {
      piece.target.copy_(piece.master.detach());
    }
  }
  if (in_blocks) {
    write_fp8_weight_blocks(fp8_pieces);
  } else if (!fp8_masters.empty()) {
    quantize_many(fp8_masters, scales, fp8_slots, Fp8Format::kE4M3, fp8_targets);
  }
  if (buffer_) buffer_->gather_params();
  if (!fp8_params_.empty() && !in_blocks) {
    std::vector<Fp8Meta*> metas;
    metas.reserve(fp8_params_.size());
    for (size_t index : fp8_params_) metas.push_back(params_[index].fp8_meta.get());
    Fp8Meta::weights_written(metas, amaxes, scale_invs, "DistributedOptimizer");
    if (delayed) fp8_weight_scales_ = compute_current_scale(amaxes, Fp8Format::kE4M3);
  }
}

void DistributedOptimizer::write_fp8_weight_blocks(const std::vector<size_t>& fp8_pieces) {
  if (fp8_params_.empty()) return;
  const auto device = params_[fp8_params_.front()].model.device();
  const auto float_options = torch::TensorOptions().dtype(at::kFloat).device(device);
  // Per weight (slot order): a shard of what this rank holds of it; a weight with no piece here
  // gets an empty shard, so that its scale_inv is written all the same.
  std::vector<Fp8WeightShard> shards(fp8_params_.size());
  std::vector<torch::Tensor> outs(fp8_params_.size()), scale_invs(fp8_params_.size());
  for (size_t slot = 0; slot < fp8_params_.size(); ++slot) {
    const auto& param = params_[fp8_params_[slot]];
    shards[slot] = {torch::empty({0}, float_options), param.model.size(0), param.model.size(1), 0};
    outs[slot] = torch::empty({0}, param.model.options());
    scale_invs[slot] = param.fp8_meta->weight_scale_inv_blocks();
  }
  for (size_t i : fp8_pieces) {
    const auto& piece = pieces_[i];
    const auto slot = static_cast<size_t>(params_[piece.param].fp8_slot);
    shards[slot].values = piece.master.detach().reshape({-1});
    shards[slot].offset = piece.offset;
    outs[slot] = piece.target.view({-1});
  }
  // One rank holds every weight whole: each block's amax is its own, and one read of each
  // master quantizes it.
  const bool whole = world_size_ == 1 && std::all_of(shards.begin(), shards.end(), [](const auto& s) {
                       return s.offset == 0 && s.values.numel() == s.rows * s.cols;
                     });
  if (whole) {
    quantize_whole_weights_blockwise(shards, weight_block_options(), outs, scale_invs);
    return;
  }
  // Every FP8 weight's block amaxes in one buffer, so that one all-reduce (MAX) over the ranks
  // completes the blocks a shard boundary cuts. No history: each step's scales are its own.
  std::vector<int64_t> grid_sizes;
  grid_sizes.reserve(shards.size());
  for (const auto& shard : shards) {
    const auto grid = blockwise_amax_shape(shard.rows, shard.cols);
    grid_sizes.push_back(grid[0] * grid[1]);
  }
  auto all_amaxes =
      torch::zeros({std::accumulate(grid_sizes.begin(), grid_sizes.end(), int64_t{0})}, float_options);
  std::vector<torch::Tensor> amaxes(shards.size());
  int64_t begin = 0;
  for (size_t slot = 0; slot < shards.size(); ++slot) {
    amaxes[slot] = all_amaxes.narrow(0, begin, grid_sizes[slot])
                       .view(blockwise_amax_shape(shards[slot].rows, shards[slot].cols));
    begin += grid_sizes[slot];
  }
  blockwise_shard_amax(shards, amaxes);
  if (world_size_ > 1) {
    std::vector<torch::Tensor> tensors{all_amaxes};
    group_->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
  }
  quantize_shards_blockwise(shards, amaxes, weight_block_options(), outs, scale_invs);
}

void DistributedOptimizer::finish_param_gather() {
  if (buffer_) buffer_->finish_param_gather();
}

void DistributedOptimizer::zero_gradients() {
  if (buffer_) {
    buffer_->zero_grads();
  } else {
    for (auto& param : params_) {
      if (param.fp8_meta) param.fp8_meta->main_grad().zero();
      else param.model.mutable_grad().reset();
    }
    if (main_grad_buffer_.defined()) {
      // The next take overwrites each sum (take_gradients); static gradients' takes add.
      if (static_gradients_on_) {
        torch::NoGradGuard no_grad;
        main_grad_buffer_.zero_();
      }
      took_.assign(params_.size(), false);
    }
  }
  for (auto& piece : pieces_) piece.master.mutable_grad().reset();
  grads_.clear();
  if (static_gradients_on_) {
    torch::NoGradGuard no_grad;
    for (auto& buffer : static_grad_buffers_) buffer.zero_();
    // After the resets above (a float32 parameter is its own master): the views again.
    for (size_t n = 0; n < params_.size(); ++n) {
      if (static_grads_[n].defined()) params_[n].model.mutable_grad() = static_grads_[n];
    }
  }
}

void DistributedOptimizer::use_static_gradients() {
  TORCH_CHECK(connected_, "DistributedOptimizer: connect before use_static_gradients");
  TORCH_CHECK(!buffer_, "DistributedOptimizer::use_static_gradients: one rank only (", world_size_,
              " ranks keep their gradients in the ParamAndGradBuffer)");
  if (static_gradients_on_) return;
  // Each parameter's place in the flat buffer of its gradient's dtype (an FP8 weight's main_grad
  // accumulates in float32). One rank has one device: the dtype names the buffer.
  FlatLayout layout;
  for (size_t n = 0; n < params_.size(); ++n) {
    const auto& param = params_[n];
    if (!param.model.defined()) continue;
    TORCH_CHECK(!param.fp8_meta || !param.fp8_meta->main_grad().is_bound(),
                "DistributedOptimizer::use_static_gradients: FP8 weight ", n,
                "'s main_grad is already bound to a buffer");
    layout.add(n, param.fp8_meta ? at::kFloat : param.model.scalar_type(), param.model.sizes());
  }
  static_grads_ = layout.allocate(params_.size(), device(), static_grad_buffers_);
  for (size_t n = 0; n < params_.size(); ++n) {
    auto& param = params_[n];
    if (!param.fp8_meta || !static_grads_[n].defined()) continue;
    // An FP8 weight's gradient is its main_grad: bound to the view, no .grad view of its own.
    param.fp8_meta->main_grad().bind(static_grads_[n], param.model.device());
    static_grads_[n] = torch::Tensor();
  }
  static_gradients_on_ = true;
  zero_gradients();
}

bool DistributedOptimizer::has_model_gradients() const {
  return std::any_of(params_.begin(), params_.end(), [](const Param& param) {
    return !param.fp8_meta && param.model.defined() && param.model.grad().defined();
  });
}

bool DistributedOptimizer::master_is_model(size_t i) const {
  return pieces_.at(i).master.is_same(params_[pieces_[i].param].model);
}

std::optional<torch::Tensor> DistributedOptimizer::master_of(const torch::Tensor& param) const {
  TORCH_CHECK(world_size_ == 1, "DistributedOptimizer: with ", world_size_, " ranks each holds only its "
              "shard of the FP32 masters (ZeRO-1); gathering them for an export is not built yet");
  for (const auto& piece : pieces_) {
    if (params_[piece.param].model.is_same(param)) return piece.master.detach().clone();
  }
  return std::nullopt;
}

std::vector<DistributedOptimizer::StepCommunication> DistributedOptimizer::take_communication_times() {
  return buffer_ ? buffer_->take_communication_times() : std::vector<StepCommunication>{};
}

}  // namespace amp8
