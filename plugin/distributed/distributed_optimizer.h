#pragma once

// The FP32 master params and the optimizer state of MixedPrecisionPlugin, for one rank or many:
// Megatron's DistributedOptimizer (ZeRO-1), of which training on one GPU is the world of one.
//
// The optimizer (any torch::optim optimizer) is re-pointed at FP32 masters: on each rank, its
// shard of every parameter (ParamAndGradBuffer's local shards; with one rank, the whole
// parameter, in its shape). A step, for any world size:
//   reduce_gradients   each master's gradient: with several ranks, its shard of the gradient
//                      buffer after the reduce-scatter (averaged); with one, the gradient where
//                      the backward pass left it (the parameter's .grad, an FP8 weight's
//                      main_grad): a world of one has nothing to reduce, so it keeps no
//                      gradient buffer and copies nothing, unless a step accumulates
//                      micro-batches under grad_reduce_in_fp32 (take_gradients: float32 sums);
//   step               the fused multi-tensor kernels (reading those gradients in their dtype,
//                      writing the model's half copy) or the optimizer's own step() on float32
//                      gradients (set_master_gradients);
//   publish_params     writes the masters into the model: half copies, FP8 weights quantized
//                      with a scale from their amax (all-reduced over the ranks), then, with
//                      several ranks, all-gathers the parameter buffer.
// found_inf, the gradient norm and the FP8 amaxes are all-reduced over the group.
//
// Checkpoints: each rank saves its masters and its optimizer's state with the layout of its
// pieces (save_layout). A checkpoint written by N ranks loads into M ranks (load_resharded):
// every rank reads all N files, puts each parameter's master and per-element optimizer state
// (AdamW's exp_avg, SGD's momentum_buffer, ...) back together from the pieces, and takes its own
// range of them; scalar state (step) is carried over as it is.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "plugin/distributed/param_and_grad_buffer.h"
#include "plugin/optim/fused_optimizer.h"

namespace amp8 {


class DistributedOptimizer {
 public:
  /// One parameter the optimizer steps.
  struct ParamSpec {
    torch::Tensor model;                       ///< the model's parameter (any float dtype, or FP8)
    c10::intrusive_ptr<Fp8Meta> fp8_meta;  ///< fp8_params: the FP8 state of the weight's layer
    torch::Tensor seed;                        ///< float32 value the master starts from (undefined:
                                               ///< the model's value)
  };
  using StepCommunication = ParamAndGradBuffer::StepCommunication;

  /// How FP8 weights (fp8_params) are quantized from their masters after each step: one scale
  /// per weight from its amax (current scaling: a second read of the masters after the step);
  /// one scale per weight from its amax after the previous step (delayed: a fused Adam step
  /// writes the weight in its own pass, as TE's FusedAdam does for Float8Tensor params; values
  /// beyond the scale's range saturate for that step); or one power-of-two scale per 128×128
  /// block (the blockwise recipe's weights, TE's Float8BlockScaling).
  enum class Fp8WeightScaling { kPerTensor, kPerTensorDelayed, kBlocks128x128 };

  /// `group`: the data-parallel ranks; null (or a group of one) is a world of one.
  DistributedOptimizer(c10::intrusive_ptr<c10d::ProcessGroup> group, DistributedOptimizerOptions options,
                       bool grad_reduce_in_fp32,
                       Fp8WeightScaling fp8_weight_scaling = Fp8WeightScaling::kPerTensor);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  /// Makes the masters and points `optimizer` at them. `params` are in the optimizer's order
  /// (params[i] belongs to the param group that held it). With several ranks: lays out the
  /// ParamAndGradBuffer, and every rank starts from rank 0's parameters and master seeds
  /// (broadcast, as DDP does; module buffers that are not parameters are left as each rank has
  /// them). A float32 parameter is its own master on one rank.
  void connect(torch::optim::Optimizer& optimizer, std::vector<ParamSpec> params);

  /// false while accumulating micro-batches (see ParamAndGradBuffer::set_gradient_sync). The
  /// Trainer sets it; a loop of its own calls it around its micro-batches. On one rank with
  /// grad_reduce_in_fp32, the first false turns on float32 accumulation (take_gradients).
  void set_gradient_sync(bool enabled);
  /// One rank, grad_reduce_in_fp32, once a step has accumulated micro-batches: adds each bf16 /
  /// fp16 parameter's autograd gradient into its float32 main gradient (Megatron's main_grad: a
  /// flat float32 buffer, 4 bytes per trainable such parameter on device(), allocated at the
  /// first set_gradient_sync(false)) and releases the .grad (zeroes it with static gradients),
  /// so that the micro-batches are summed in float32, not in the parameters' dtype. One
  /// multi-tensor launch (ops/accumulate.h); a sum's first gradient of a step is written, not
  /// added, so the step does not zero the sums (it does under static gradients, whose CUDA graph
  /// may hold a take and repeat it as captured: every take there adds). The plugin
  /// calls it after each backward with gradient sync off (after every backward under static
  /// gradients); reduce_gradients takes the rest (the last micro-batch's). Nothing to do
  /// otherwise (several ranks sum into the ParamAndGradBuffer; FP8 weights' main_grad and
  /// float32 parameters are float32 already). A parameter that got no gradient in the step
  /// still has none (under static gradients: a zero one, as its .grad). Which parameters have a
  /// sum is decided at the allocation: one unfrozen later sums in its own dtype (as Megatron's
  /// main_grad, made once).
  void take_gradients();
  /// Whether take_gradients sums (from the first set_gradient_sync(false) on one rank).
  bool sums_micro_batches() const { return main_grad_buffer_.defined(); }
  /// The float32 main gradients take_gradients has summed this step (all of them under static
  /// gradients; empty unless it is on).
  std::vector<torch::Tensor> main_gradients() const;

  /// Finishes the gradient reduction and returns each master's gradient, in master_shards()
  /// order, in the dtype it was reduced / accumulated in (undefined: the parameter got none).
  const std::vector<torch::Tensor>& reduce_gradients();
  /// For the optimizer's own step(): sets each master's .grad to its gradient as float32 (a
  /// view when it already is) and returns those (undefined where none).
  std::vector<torch::Tensor> set_master_gradients();
  /// Whether any rank's `flag` (a one-element tensor) is non-zero.
  bool any_rank(const torch::Tensor& flag) const;
  /// The L2 norm of `grads` over every rank (each element lives on exactly one), unread on the
  /// device (global_grad_norm_tensor, plugin/optim/grad_clip.h).
  torch::Tensor global_norm(const std::vector<torch::Tensor>& grads) const;
  /// Where the masters live (the CPU when this rank holds none).
  at::Device device() const;
  /// Whether `optimizer`'s params are all among these masters (fused_optimizer_step can step
  /// them); true for an optimizer with no params (a rank whose shard is only padding).
  bool steps_these_masters(const torch::optim::Optimizer& optimizer) const;
  /// steps_these_masters, and the masters are on a GPU.
  bool fusable_on_gpu(const torch::optim::Optimizer& optimizer) const;
  /// How a step goes through fused_optimizer_step.
  struct FusedStep {
    double grad_multiplier = 1.0;     ///< every gradient multiplied by it
    AdamMomentDtypes moment_dtypes;  ///< Adam / AdamW's moments' dtypes
  };
  /// Steps the masters and writes them into the model (publish). `fused`: step with
  /// fused_optimizer_step; unset: optimizer.step() on the gradients set_master_gradients set.
  void step(torch::optim::Optimizer& optimizer, const std::optional<FusedStep>& fused);
  /// Waits for the all-gathers the last step left in flight (overlap_param_gather); the model's
  /// parameters are then final. Nothing to do on one rank or without the overlap.
  void finish_param_gather();
  /// Zeroes every gradient (the buffer, the model's, main_grad, the masters'), ready for the
  /// next step. With static gradients: fills them with zeros, where they are. The one-rank
  /// float32 sums are not zeroed (outside static gradients) but marked empty: the next take
  /// writes each.
  void zero_gradients();
  /// From now on every gradient the backward pass writes stays at one address (what a CUDA
  /// graph replay needs: it writes where the capture wrote): each parameter's .grad is a view of
  /// a flat buffer of its dtype, zeroed (one fill per dtype) instead of released after each step,
  /// and each FP8 weight's main_grad is bound to a float32 one. The backward pass then always
  /// accumulates (0 + g on a step's first micro-batch: the same values). A parameter that gets no
  /// gradient now has a zero one (torch::optim's step would decay it; the fused step and
  /// every parameter a model uses see no difference). One rank only: several keep their
  /// gradients in the ParamAndGradBuffer already.
  void use_static_gradients();
  bool static_gradients() const { return static_gradients_on_; }
  /// Whether a model parameter holds an autograd gradient that no hook has taken (a backward
  /// pass ran since the last zero_gradients, on one rank).
  bool has_model_gradients() const;

  /// One rank's file of a checkpoint, for load_resharded.
  struct CheckpointShard {
    torch::serialize::InputArchive plugin;     ///< MixedPrecisionPlugin's archive: masters, layout
    torch::serialize::InputArchive optimizer;  ///< the torch::optim optimizer's archive
  };
  /// Writes the layout of this rank's masters ("layout.pieces": per master, in master_shards()
  /// order, its parameter, the range [offset, offset + numel) of that parameter's flattened
  /// elements it holds, and its optimizer param group; "layout.param_numels"): what
  /// load_resharded needs to cut the state again for another world size.
  void save_layout(torch::serialize::OutputArchive& archive) const;
  /// Loads the masters and `optimizer`'s state from the files of a checkpoint written by
  /// shards.size() ranks (shards[j]: rank j's), for this rank of this world size. The model must
  /// already hold the checkpoint's parameters (a float32 parameter that was its own master has
  /// no copy in the plugin archive). Optimizer state must be per element or scalar (every
  /// torch::optim optimizer but LBFGS); anything else is an error that names it. Reads and
  /// checks everything before it changes anything.
  void load_resharded(std::vector<CheckpointShard>& shards, torch::optim::Optimizer& optimizer);
  /// The masters were loaded (MixedPrecisionPlugin::load): kPerTensorDelayed's next scales come
  /// from them, as an uninterrupted run's came from the same values.
  void masters_loaded() { fp8_weight_scales_ = torch::Tensor(); }

  /// The optimizer's tensors: this rank's FP32 masters, in the optimizer's order.
  const std::vector<torch::Tensor>& master_shards() const { return master_shards_; }
  /// Whether master i is the model's own (float32) parameter, on one rank.
  bool master_is_model(size_t i) const;
  /// A copy of `param`'s FP32 master (world of one); std::nullopt when `param` has none.
  std::optional<torch::Tensor> master_of(const torch::Tensor& param) const;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  /// 0 on one rank (no buckets).
  int64_t num_buckets() const { return buffer_ ? buffer_->num_buckets() : 0; }
  /// Elements of the parameter buffers (all buckets, padding included); 0 on one rank.
  int64_t padded_numel() const { return buffer_ ? buffer_->padded_numel() : 0; }
  /// See ParamAndGradBuffer::take_communication_times; empty on one rank.
  std::vector<StepCommunication> take_communication_times();

 private:
  // One master: the piece of a parameter this rank steps, and where its gradient and its
  // updated value go.
  struct Piece {
    size_t param = 0;
    int64_t offset = 0;    // of master's first element in the parameter's flattened elements
    int64_t group = 0;     // the optimizer param group that steps it
    torch::Tensor master;  // float32, what the optimizer steps
    torch::Tensor grad;    // several ranks: its shard of the gradient buffer
    torch::Tensor target;  // where the updated value goes (the model's parameter or its shard)
  };
  struct Param {
    torch::Tensor model;
    c10::intrusive_ptr<Fp8Meta> fp8_meta;
    int64_t fp8_slot = -1;  // its index among the FP8 weights (amax, scale)
  };

  // connect's phases, in order.
  void index_params(const std::vector<ParamSpec>& specs);
  void broadcast_seeds(std::vector<ParamSpec>& specs);
  void make_masters(const std::vector<ParamSpec>& specs);
  void point_optimizer_at_masters(torch::optim::Optimizer& optimizer);
  // `piece_amaxes`: the FP8 pieces' amaxes (fp8_piece_slots_'s order) where the fused step
  // measured them (`measured[j]`); the others, or all when undefined, are read from the masters.
  // `written[j]`: kPerTensorDelayed, the fused step wrote FP8 piece j at fp8_weight_scales_.
  void publish_params(bool half_copies_written, torch::Tensor piece_amaxes = {},
                      const std::vector<bool>& measured = {}, const std::vector<bool>& written = {});
  // Each FP8 weight's amax over its pieces and the ranks (slot order), from piece_amaxes where
  // measured and from the masters elsewhere.
  torch::Tensor fp8_weight_amaxes(torch::Tensor piece_amaxes, const std::vector<bool>& measured);
  // publish_params' FP8 weights in 128×128 blocks, from the FP8 pieces (pieces_ indices).
  void write_fp8_weight_blocks(const std::vector<size_t>& fp8_pieces);
  torch::Tensor half_copy(const Piece& piece) const;
  c10d::ProcessGroup* reduce_group() const { return world_size_ > 1 ? group_.get() : nullptr; }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // null on one rank
  DistributedOptimizerOptions options_;
  bool grad_reduce_in_fp32_;
  Fp8WeightScaling fp8_weight_scaling_;
  int rank_ = 0, world_size_ = 1;
  bool connected_ = false;
  std::unique_ptr<ParamAndGradBuffer> buffer_;  // several ranks only
  // One rank, float32 accumulation (take_gradients): main_grads_[n] is parameter n's view of
  // main_grad_buffer_ (undefined for FP8 weights and float32 parameters).
  torch::Tensor main_grad_buffer_;
  std::vector<torch::Tensor> main_grads_;
  std::vector<bool> took_;  // parameter n's sum holds a gradient of this step
  std::vector<Param> params_;
  std::vector<Piece> pieces_;
  std::vector<torch::Tensor> master_shards_;
  std::vector<torch::Tensor> grads_;                      // this step's, per piece
  std::unordered_map<const void*, size_t> piece_index_;  // master's TensorImpl → pieces_ index
  std::vector<size_t> fp8_params_;  // indices of the FP8 weights (fp8_params), in slot order
  // use_static_gradients: one flat buffer per gradient dtype, and each parameter's view of its
  // buffer (undefined for FP8 weights, whose main_grad is bound to theirs).
  std::vector<torch::Tensor> static_grad_buffers_;
  std::vector<torch::Tensor> static_grads_;  // per params_ entry
  bool static_gradients_on_ = false;
  torch::Tensor fp8_piece_slots_;   // int64, on the masters' device: each local FP8 piece's slot
  // kPerTensorDelayed: the scale each FP8 weight is written at in the next step (slot order),
  // from its amax after the last one; undefined until the first step after connect or a load,
  // which takes it from the masters as they are (so a resumed run writes what an uninterrupted
  // one writes).
  torch::Tensor fp8_weight_scales_;
  std::vector<int64_t> fp8_piece_ordinal_;  // per pieces_ entry: its index among the FP8 pieces, or -1
};

}  // namespace amp8
