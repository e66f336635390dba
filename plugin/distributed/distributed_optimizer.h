#pragma once

// ZeRO-1 over c10d, as Megatron's DistributedOptimizer: the data-parallel ranks share the FP32
// master params and the optimizer state, each stepping only its shard.
//
//   backward   each parameter's gradient is added into a contiguous gradient buffer (float32
//              when grad_reduce_in_fp32, else the params dtype) as soon as autograd has
//              accumulated it, and the parameter's own .grad is released; a bucket whose
//              gradients are all in is reduce-scattered (average) at once, while the rest of
//              the backward pass runs (buckets launch in a fixed order, the same on every rank).
//              An FP8 weight has no autograd gradient: its module's main_grad is bound to its
//              slice of the buffer (Megatron's param.main_grad), so the wgrad GEMMs accumulate
//              there directly, and the module reports (Fp8LinearImpl::set_main_grad_hook) after
//              the last backward through the layer;
//   step       the rank's shard of the averaged gradients becomes the gradient of its FP32
//              master shard; the optimizer (any torch::optim optimizer, re-pointed at those
//              shards) steps them; the updated shards are written into a contiguous parameter
//              buffer that the model's parameters are views of, and all-gathered in place. An
//              FP8 weight (fp8_params) is quantized from its master shard with a scale from the
//              amax all-reduced over the group, and gathered as FP8: one byte per element.
//
// Buckets are padded to a multiple of world_size × 64 elements, so any world size works; the
// padding is zero and never reaches a parameter. Used through MixedPrecisionPlugin::
// set_process_group, which keeps the user's loop unchanged.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace amp8 {

class Fp8LinearImpl;

struct DistributedOptimizerOptions {
  /// Elements per gradient bucket (Megatron's default: 40 M). Smaller buckets start the
  /// reduce-scatter earlier in the backward pass; larger ones make fewer, faster collectives.
  TORCH_ARG(int64_t, bucket_size) = 40'000'000;
  /// Reduce-scatter each bucket during the backward pass as soon as its gradients are in
  /// (false: all of them at the optimizer step).
  TORCH_ARG(bool, overlap_grad_reduce) = true;

 public:
  void validate() const;
};

class DistributedOptimizer {
 public:
  /// One parameter the optimizer steps.
  struct ParamSpec {
    torch::Tensor model;                       ///< the model's parameter (any float dtype, or FP8)
    std::shared_ptr<Fp8LinearImpl> fp8_owner;  ///< fp8_params: the module whose weight it is
    torch::Tensor seed;                        ///< float32 value the master starts from
  };

  DistributedOptimizer(c10::intrusive_ptr<c10d::ProcessGroup> group,
                       DistributedOptimizerOptions options, bool grad_reduce_in_fp32);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  /// Lays out the buffers, makes the model parameters views of the parameter buffer, hooks
  /// their gradients, and points `optimizer` at this rank's FP32 master shards. `params` are in
  /// the optimizer's order (params[i] belongs to the param group that held it). Every rank
  /// starts from rank 0's parameters and master seeds (broadcast, as DDP does; module buffers
  /// that are not parameters are left as each rank has them).
  void connect(torch::optim::Optimizer& optimizer, std::vector<ParamSpec> params);

  /// false while accumulating micro-batches: gradients are only summed into the buffer; the
  /// reduce-scatter starts in the backward pass after it is set back to true (the last
  /// micro-batch). The Trainer sets it; a loop of its own calls it around its micro-batches.
  void set_gradient_sync(bool enabled) { sync_ = enabled; }
  bool gradient_sync() const { return sync_; }

  /// Finishes the gradient reduction (launches what the backward pass has not, waits for all)
  /// and sets each master shard's gradient (float32). Returns those gradients.
  std::vector<torch::Tensor> reduce_gradients();
  /// clip_grad_norm_ (plugin/optim/grad_clip.h) over this rank's master-gradient shards, the norm
  /// all-reduced over the group. Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  /// After the optimizer stepped: writes the master shards into the parameter buffer (FP8
  /// weights quantized with an all-reduced amax) and all-gathers it.
  void gather_params();
  /// Zeroes the gradient buffer and every gradient, ready for the next step.
  void zero_gradients();

  /// The optimizer's tensors: this rank's FP32 master shards, in the optimizer's order.
  const std::vector<torch::Tensor>& master_shards() const { return master_shards_; }
  c10::ScalarType grad_reduce_dtype(c10::ScalarType params_dtype) const;
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int64_t num_buckets() const;
  /// Elements of the parameter buffers (all buckets, padding included).
  int64_t padded_numel() const;

  /// How long the compute stream of one optimizer step waited on communication (CUDA only):
  /// `reduce_ms` from the end of the backward pass until every gradient bucket is reduced
  /// (with overlap_grad_reduce, what the backward pass did not hide), `gather_ms` from the
  /// all-gather's launch until the parameters are in, `reduce_bytes` / `gather_bytes` what each
  /// rank put into those collectives (whole buckets, padding included).
  struct StepCommunication {
    double reduce_ms = 0, gather_ms = 0;
    int64_t reduce_bytes = 0, gather_bytes = 0;
  };
  /// The figures of the steps completed since the last call (at most the last 4096), oldest
  /// first; empty on the CPU. Waits for the GPU.
  std::vector<StepCommunication> take_communication_times();

 private:
  struct Param;
  struct Bucket;
  struct Buffer;
  struct Piece;

  void on_grad_ready(size_t index, const torch::Tensor& param);
  void on_main_grad_ready(size_t index);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  void relink_params();

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  DistributedOptimizerOptions options_;
  bool grad_reduce_in_fp32_;
  int rank_ = 0, world_size_ = 1;
  bool sync_ = true;
  bool connected_ = false;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<Buffer> buffers_;
  std::vector<Piece> pieces_;
  std::vector<size_t> fp8_params_;  // indices of the FP8 weights (fp8_params), in slot order
  torch::Tensor fp8_piece_slots_;   // int64, on the buffers' device: each local FP8 piece's slot
  std::vector<torch::Tensor> master_shards_;
  std::vector<size_t> launch_order_;  // the same on every rank
  size_t next_launch_ = 0;
  // CUDA events on the compute stream around each step's waits: {backward done, reduced,
  // gather launched, gathered}; take_communication_times() reads them.
  struct StepEvents;
  std::deque<std::unique_ptr<StepEvents>> step_events_;
  bool timing_step_ = false;  // between a step's reduce_gradients and its gather_params
  void record_event(size_t which);
};

}  // namespace amp8
