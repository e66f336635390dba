#pragma once

// Megatron's ParamAndGradBuffer over c10d: the layout and synchronisation of data-parallel
// parameters and gradients, for the DistributedOptimizer that owns their FP32 masters.
//
//   layout     the parameters, grouped by dtype, are views of one contiguous parameter buffer
//              per dtype, cut into buckets (in reverse order: the backward pass fills the first
//              bucket first); each bucket is padded to a multiple of world_size × 64 elements,
//              so any world size works (the padding is zero and never reaches a parameter);
//   backward   each parameter's gradient is added into the gradient buffer (float32 when
//              grad_reduce_in_fp32, else the params dtype) as soon as autograd has accumulated
//              it (a post-accumulate-grad hook), and the parameter's own .grad is released; an
//              FP8 weight has no autograd gradient: its module's main_grad is bound to its slice
//              of the buffer (Megatron's param.main_grad), so the wgrad GEMMs accumulate there
//              directly, and the module reports after the last backward through the layer. A
//              bucket whose gradients are all in is reduce-scattered (average) at once, while the
//              rest of the backward pass runs (buckets launch in a fixed order, the same on every
//              rank);
//   step       finish_grad_sync() waits for every bucket; the owner steps this rank's shard of
//              each bucket (local_shards) and writes the updated values into its shard of the
//              parameter buffer; gather_params() all-gathers every bucket in place, in the
//              order the forward pass needs them, and waits for them, or, with
//              overlap_param_gather, leaves them in flight: the next forward pass waits for each
//              block's buckets when it reaches the block (wait_for_params).

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "plugin/modules/fp8_meta.h"

namespace torch::nn {
class Module;
}

namespace amp8::detail {
struct ParamGathers;  // param_and_grad_buffer.cc
}

namespace amp8 {

struct DistributedOptimizerOptions {
  /// Elements per gradient bucket (Megatron's default: 40 M). Smaller buckets start the
  /// reduce-scatter earlier in the backward pass; larger ones make fewer, faster collectives.
  TORCH_ARG(int64_t, bucket_size) = 40'000'000;
  /// Reduce-scatter each bucket during the backward pass as soon as its gradients are in
  /// (false: all of them at the optimizer step).
  TORCH_ARG(bool, overlap_grad_reduce) = true;
  /// All-gather the updated parameters while the next forward pass runs (Megatron's
  /// overlap_param_gather): the step launches every bucket's all-gather, in the order the
  /// forward pass uses the parameters, and returns without waiting; the model waits for each
  /// block's parameters with amp8::wait_for_params(block) just before it runs the block
  /// (GptModel and LlamaModel do). A model that does not computes with stale parameters: the
  /// first gradient of a parameter whose bucket no wait reached is an error naming the function.
  /// A forward pass without gradients (evaluation) is not checked: it must run a model that
  /// waits, or call DistributedOptimizer::finish_param_gather() first. The Trainer finishes them
  /// before a checkpoint, a load and when fit ends (on an error too); so does the buffer's
  /// destructor. Default: false (Megatron's default).
  TORCH_ARG(bool, overlap_param_gather) = false;

 public:
  void validate() const;
};

class ParamAndGradBuffer {
 public:
  /// One parameter: the model's tensor (any float dtype, or FP8) and, for an FP8 weight under
  /// fp8_params, its layer's FP8 state (main_grad is bound to the weight's slice of the buffer).
  struct Param {
    at::Tensor model;
    c10::intrusive_ptr<Fp8Meta> fp8_meta;
  };

  /// Lays out the buffers, makes the parameters views of the parameter buffer (keeping their
  /// values), binds FP8 weights' main_grad and hooks every gradient. `params` must be non-empty,
  /// on one device, floating point; the non-FP8 ones must require grad. Every rank then holds
  /// rank 0's parameters (broadcast, as DDP does).
  ParamAndGradBuffer(c10::intrusive_ptr<c10d::ProcessGroup> group, DistributedOptimizerOptions options,
                     bool grad_reduce_in_fp32, std::vector<Param> params);
  /// Unhooks the parameters and unbinds main_grad: the model may outlive the buffer.
  ~ParamAndGradBuffer();
  ParamAndGradBuffer(const ParamAndGradBuffer&) = delete;
  ParamAndGradBuffer& operator=(const ParamAndGradBuffer&) = delete;

  /// This rank's part of one parameter: elements [param_offset, param_offset + numel) of its
  /// flattened values. `grad` is that range of the gradient buffer (the average over the ranks
  /// after finish_grad_sync), `values` that range of the parameter buffer (what gather_params
  /// sends to the other ranks).
  struct Shard {
    size_t param = 0;
    int64_t param_offset = 0, numel = 0;
    at::Tensor grad, values;
  };
  /// Every local shard, bucket by bucket. A rank holds at most one shard of each parameter (its
  /// share of a bucket is one contiguous range).
  std::vector<Shard> local_shards() const;

  /// false while accumulating micro-batches: gradients are only summed into the buffer; the
  /// reduce-scatter starts in the backward pass after it is set back to true (the last
  /// micro-batch).
  void set_gradient_sync(bool enabled) { sync_ = enabled; }
  /// Launches the buckets the backward pass has not and waits for all: the gradient buffer then
  /// holds the averaged gradients in this rank's shards. Re-links parameters a checkpoint load
  /// gave new storage first (relink_params).
  void finish_grad_sync();
  /// All-gathers every bucket of the parameter buffer in place (FP8 as bytes), in the order the
  /// forward pass uses the parameters; waits for them unless overlap_param_gather.
  void gather_params();
  /// Waits for every all-gather still in flight (none: returns at once).
  void finish_param_gather();
  /// A checkpoint load (torch's InputArchive) gives a parameter new storage: make it a view of
  /// the parameter buffer again, with the loaded values.
  void relink_params();
  /// Zeroes the gradient buffer and every gradient, ready for the next step.
  void zero_grads();

  int64_t num_buckets() const;
  /// Elements of the parameter buffers (all buckets, padding included).
  int64_t padded_numel() const;

  /// How long the compute stream of one optimizer step waited on communication (CUDA only):
  /// `reduce_ms` from the end of the backward pass until every gradient bucket is reduced
  /// (with overlap_grad_reduce, what the backward pass did not hide), `gather_ms` from the
  /// all-gather's launch until the parameters are in (with overlap_param_gather: the time the
  /// compute stream stood in the waits for that step's gathers, what the forward pass did not
  /// hide, including an evaluation's waits and the finish at the end of fit),
  /// `reduce_bytes` / `gather_bytes` what each
  /// rank put into those collectives (whole buckets, padding included).
  struct StepCommunication {
    double reduce_ms = 0, gather_ms = 0;
    int64_t reduce_bytes = 0, gather_bytes = 0;
  };
  /// The figures of the steps completed since the last call (at most the last 4096), oldest
  /// first; empty on the CPU. Waits for the GPU.
  std::vector<StepCommunication> take_communication_times();

 private:
  struct Slot;
  struct Bucket;
  struct Buffer;
  struct StepEvents;

  void lay_out(bool grad_reduce_in_fp32);
  void hook(size_t index);
  void broadcast_from_rank_zero();
  void on_grad_ready(size_t index, const at::Tensor& param);
  void on_main_grad_ready(size_t index);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  void record_event(size_t which);
  void check_gathered(size_t index) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  DistributedOptimizerOptions options_;
  int rank_ = 0, world_size_ = 1;
  bool sync_ = true;
  std::vector<Slot> params_;
  std::vector<Bucket> buckets_;
  std::vector<Buffer> buffers_;
  std::vector<size_t> launch_order_;  // the same on every rank
  size_t next_launch_ = 0;
  // CUDA events on the compute stream around each step's waits: {backward done, reduced,
  // gather launched, gathered}; take_communication_times() reads them.
  std::deque<std::unique_ptr<StepEvents>> step_events_;
  bool timing_step_ = false;  // between a step's finish_grad_sync and its gather_params
  // The all-gathers in flight (overlap_param_gather), shared with the registry that
  // amp8::wait_for_params reads, so that a buffer destroyed first leaves nothing dangling.
  std::shared_ptr<detail::ParamGathers> gathers_;
  std::vector<size_t> gather_order_;  // buckets in the order the forward pass uses them
  StepEvents* gathering_step_ = nullptr;  // the step whose all-gathers are in flight (timed)
};

/// overlap_param_gather (DistributedOptimizerOptions): makes the current stream wait for the
/// all-gathers of `module`'s parameters (recursively) that the last optimizer step left in flight
/// on this thread; does nothing when none are. Call it on each block of the forward pass just
/// before running it, as Megatron's forward pre-hooks do.
void wait_for_params(const torch::nn::Module& module);

}  // namespace amp8
