#pragma once
// The FP8 state of one linear layer (TE's fp8_meta): its scaling slots, and, for a weight kept in
// FP8, where the weight gradient accumulates. Shared by the module and by every autograd node its
// forward calls create, so that a backward pass never reaches back into the module; and the
// narrow part of a layer an optimizer talks to.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <functional>
#include <vector>

#include "ops/blockwise.h"
#include "ops/fp8_tensor.h"
#include "ops/scaling.h"

namespace amp8 {

/// The FP8 tensors of a linear layer, each with a scale and an amax-history column: the input
/// and the weight in the forward metadata (columns 0 and 1), the output gradient in the backward
/// metadata (column 0).
enum class Fp8Slot { kInput, kWeight, kGradOutput };

/// Megatron's param.main_grad for a weight kept in FP8 (fp8_params), which has no autograd
/// gradient: the layer's backward passes add the weight gradient here (FP32 by default), its
/// optimizer reads and clears it.
class MainGrad {
 public:
  explicit MainGrad(std::vector<int64_t> weight_shape) : weight_shape_(std::move(weight_shape)) {}

  /// The accumulated gradient: FP32, undefined before the first backward pass and after zero();
  /// when bound, the buffer, in its dtype.
  const at::Tensor& tensor() const { return tensor_; }
  bool is_bound() const { return bound_; }
  /// The weight's shape, [out_features, in_features].
  const std::vector<int64_t>& weight_shape() const { return weight_shape_; }
  /// Clears it for the next step: releases the tensor (set_to_none) unless bound, else fills it
  /// with zeros. A bound buffer is left as it is (its owner zeroes it) unless set_to_none is false.
  void zero(bool set_to_none = true);
  /// Binds to `buffer` (the weight's shape; float32, bfloat16 or float16; contiguous; on
  /// `device`): the weight-gradient GEMMs accumulate into it, in its dtype. Undefined unbinds.
  void bind(at::Tensor buffer, const at::Device& device);
  /// Called once every backward pass expected since the last zero() has added its gradient.
  void set_ready_hook(std::function<void()> hook) { ready_hook_ = std::move(hook); }

  // ---- the backward side ----
  /// A forward call (grad mode on) whose backward pass will add into it.
  void expect() { ++pending_; }
  /// += grad (an autograd gradient of the dequantized weight), in FP32.
  void add(const at::Tensor& grad);
  /// += grad_tᵀ-GEMM (dW = dyᵀ·x in FP8), accumulated by the GEMM itself.
  void add_product(const Fp8Tensor& grad_t, const Fp8Tensor& x_t);
  /// The same for a weight in 128×128 blocks (the blockwise recipe): both operands in 1×128
  /// tiles along the tokens, through the block-scaled GEMM.
  void add_product(const Fp8BlockwiseTensor& grad_t, const Fp8BlockwiseTensor& x_t);

 private:
  void added();

  std::vector<int64_t> weight_shape_;
  at::Tensor tensor_;
  bool bound_ = false;
  std::function<void()> ready_hook_;
  // Backward passes expected by forward calls that have not added yet; the hook fires when the
  // last of them has.
  int64_t pending_ = 0;
};

/// The FP8 metadata of one linear layer: views of its slots in the module's buffers (which it
/// shares: `to()`, loading and history resizes move both), the region group its amaxes are
/// reduced over, and, under fp8_params, the stored weight's scale_inv and its MainGrad.
class Fp8Meta : public torch::CustomClassHolder {
 public:
  /// `forward`: history [H, 2], scale [2], scale_inv [2] (kInput, kWeight); `backward`:
  /// [H, 1], [1], [1] (kGradOutput); `weight_scale_inv` [1] under fp8_params, else undefined.
  Fp8Meta(DelayedScalingGroup forward, DelayedScalingGroup backward, at::Tensor weight_scale_inv,
          std::vector<int64_t> weight_shape);

  const DelayedScalingGroup& forward_group() const { return forward_; }
  const DelayedScalingGroup& backward_group() const { return backward_; }
  /// The slot's scale, [1].
  const at::Tensor& scale(Fp8Slot slot) { return views().scale[index(slot)]; }
  /// The slot's amax of this step (history row 0), 0-dim.
  const at::Tensor& amax(Fp8Slot slot) { return views().amax[index(slot)]; }
  /// Resizes both histories in place to `history_len` rows, keeping row 0 and the newest rows.
  void ensure_history_len(int64_t history_len);

  /// The process group of the FP8 region of the last forward call (undefined: none).
  const c10::intrusive_ptr<c10d::ProcessGroup>& amax_reduction_group() const { return group_; }
  void set_amax_reduction_group(c10::intrusive_ptr<c10d::ProcessGroup> group) {
    group_ = std::move(group);
  }

  bool fp8_params() const { return weight_scale_inv_.defined(); }
  /// fp8_params: the stored FP8 weight's scale_inv: [1] (one scale for the whole weight), or in
  /// 128×128 blocks (the blockwise recipe) the block grid of Fp8BlockwiseTensor's layout.
  const at::Tensor& weight_scale_inv() const { return weight_scale_inv_; }
  /// fp8_params: whether the stored weight is in 128×128 blocks.
  bool weight_in_blocks() const { return weight_scale_inv_.defined() && weight_scale_inv_.dim() == 2; }
  MainGrad& main_grad() { return main_grad_; }

  /// Records that an optimizer wrote the FP8 weights of `metas` (fp8_params) in place, at the
  /// scales whose inverses are `scale_invs` (compute_current_scale of `amaxes`, the written
  /// masters' amaxes; under fp8_params_scaling "delayed", of the previous step's amaxes):
  /// float32 `amaxes` and `scale_invs` [metas.size()],
  /// layer i's at i, max-merged into each weight's history slot and taken as its scale_inv, in a
  /// few launches for all layers. `caller` names the API in errors.
  static void weights_written(const std::vector<Fp8Meta*>& metas, const at::Tensor& amaxes,
                              const at::Tensor& scale_invs, const char* caller);
  /// The storage of the FP8 weight's scale_inv for weights written in 128×128 blocks: resized in
  /// place (the module's buffer follows) to the block grid of a [rows, cols] weight, zeros in its
  /// padding, for the writer to fill (quantize_shards_blockwise).
  const at::Tensor& weight_scale_inv_blocks();

 private:
  struct SlotViews {
    at::Tensor scale[3], amax[3];
    const void* keys[4] = {nullptr, nullptr, nullptr, nullptr};
  };
  static size_t index(Fp8Slot slot) { return static_cast<size_t>(slot); }
  // Rebuilt when a buffer's storage changes: the per-call narrow/select ops were a measurable
  // share of the host time of a forward call.
  const SlotViews& views();

  DelayedScalingGroup forward_, backward_;
  at::Tensor weight_scale_inv_;
  MainGrad main_grad_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  SlotViews views_;
};

}  // namespace amp8
