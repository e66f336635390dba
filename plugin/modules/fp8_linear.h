#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/blockwise.h"
#include "ops/quantize.h"
#include "plugin/fp8/fp8_recipe.h"
#include "plugin/modules/fp8_meta.h"

namespace amp8 {

/// Options of Fp8Linear, like torch::nn::LinearOptions:
///   Fp8LinearOptions(1024, 4096).bias(false)
struct Fp8LinearOptions {
  Fp8LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Size of each input sample.
  TORCH_ARG(int64_t, in_features);
  /// Size of each output sample.
  TORCH_ARG(int64_t, out_features);
  /// Learn an additive bias. Default: true.
  TORCH_ARG(bool, bias) = true;
  /// Rows of amax history in the FP8 metadata buffers; a region whose recipe asks for another
  /// length resizes them (the newest amaxes kept). Default: 1024.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 1024;
  /// Which GEMMs run in FP8; the others run in high precision, where the fixed cost of
  /// quantizing (and the host's per-call work) outweighs the faster GEMMs.
  /// kFp8GemmSizeByShape (-1): per shape, where FP8 was measured faster on an H200
  /// (fp8_gemm_pays_off, plugin/fp8/fp8_gemm_choice.h); a size ≥ 0: GEMMs of at least that
  /// many rows × in_features × out_features; 0: every GEMM. Default: kDefaultFp8MinGemmSize
  /// (kFp8GemmSizeByShape).
  TORCH_ARG(int64_t, fp8_min_gemm_size) = kDefaultFp8MinGemmSize;
  /// Compute in high precision even inside an FP8 region: a layer that
  /// num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 keep out of FP8 (convert_to_fp8
  /// sets it). Default: false.
  TORCH_ARG(bool, keep_in_high_precision) = false;
  /// Reuse the FP8 copy of the weight (and its transpose) while the weight tensor is unchanged
  /// (same version counter): the micro-batches of one optimizer step quantize it once. An
  /// explicit flag, never tied to gradient accumulation. Under the blockwise recipe the copy is
  /// the weight's 128×128 blocks and their transpose. Default: false.
  TORCH_ARG(bool, cache_fp8_weight) = false;
  /// Keep the weight only in FP8 (E4M3, 1 byte per element, with its own scale_inv) —
  /// TE's fp8_model_init. Set by constructing the module under an Fp8ModelInit guard. See
  /// Fp8LinearImpl for how gradients and updates reach such a weight. A layer whose shape FP8
  /// cannot take (a dimension not divisible by 16) keeps its weight in high precision: the
  /// module turns this off for itself, with a warning. Default: false.
  TORCH_ARG(bool, fp8_params) = false;
};

/// RAII guard (TE's fp8_model_init): FP8 modules constructed under it keep their weights only
/// in FP8 (fp8_params). With `preserve_high_precision_init_val` (default true) each module keeps
/// its high-precision initial weight until clear_high_precision_init_val(), so that FP32 master
/// weights are seeded from the real initial values, not from their FP8 rounding.
///
/// With `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16` (Megatron-Core builds each
/// layer under its own FP8 init context, none for its first and last layers in bf16): inside a
/// model's `Fp8ModelInit::Layer` scope for one of those layers, modules are built with
/// high-precision weights, so that the layers the precision keeps in bf16 train bf16 weights,
/// not dequantized FP8 ones. Give it the counts the precision's options have.
class Fp8ModelInit {
 public:
  explicit Fp8ModelInit(bool enabled = true, bool preserve_high_precision_init_val = true,
                        int64_t num_layers_at_start_in_bf16 = 0, int64_t num_layers_at_end_in_bf16 = 0);
  ~Fp8ModelInit();
  Fp8ModelInit(const Fp8ModelInit&) = delete;
  Fp8ModelInit& operator=(const Fp8ModelInit&) = delete;
  /// Whether a module built now keeps its weight only in FP8: inside an enabled guard and not
  /// inside the Layer scope of a layer kept in bf16.
  static bool is_enabled();
  static bool preserve_high_precision_init_val();

  /// Marks the construction of layer `index` of a model's `count` layers (its block loop:
  /// GptModel, LlamaModel). The layers are the units num_layers_at_start/end_in_bf16 count
  /// (convert_to_fp8: the children of the model's largest ModuleList).
  class Layer {
   public:
    Layer(int64_t index, int64_t count);
    ~Layer();
    Layer(const Layer&) = delete;
    Layer& operator=(const Layer&) = delete;

   private:
    bool previous_kept_;
  };

 private:
  bool previous_enabled_;
  bool previous_preserve_;
  int64_t previous_at_start_, previous_at_end_;
};

/// A drop-in replacement for torch::nn::Linear (same parameters, names and initialisation)
/// whose GEMMs run in FP8 inside an Fp8Autocast region:
///   forward  y  = x·Wᵀ + b   E4M3 × E4M3, fast accumulation;
///   backward dx = dy·W       dy in E5M2 ("hybrid") or E4M3, full accumulation;
///            dW = dyᵀ·x      from the FP8 transposes made by cast_transpose in the forward
///                            and backward passes (nothing is quantized twice);
///            db = Σ dy       in high precision.
/// Outside a region, when in_features or out_features is not a multiple of 16 (a one-time
/// warning), or when the GEMM is smaller than fp8_min_gemm_size, it computes exactly like
/// torch::nn::Linear (honouring at::autocast). Any number of
/// rows works: the token dimension is padded to a multiple of 16 internally.
///
/// With fp8_params (built under Fp8ModelInit) `weight` holds E4M3 data (no autograd; the
/// optimizer owns an FP32 master copy, as Megatron's does): the weight gradient, computed in
/// FP8 as usual (or in high precision outside a region), is accumulated in FP32 into
/// main_grad() (Megatron's param.main_grad; in a bound buffer's dtype, see
/// set_main_grad_buffer), and update_fp8_weight(master) re-quantizes the
/// weight after each optimizer step. The backward GEMM's transposed weight is a byte
/// transpose of the stored FP8 weight: nothing is quantized twice. Under the blockwise recipe
/// the weight is stored in 128×128 blocks (update_fp8_weight_blocks; MixedPrecisionPlugin
/// writes it so from its masters) and dgrad reads the same blocks transposed.
///
/// FP8 metadata are buffers, so torch::save(module) keeps them:
///   fp8_fwd_amax_history [H, 2] (slot 0: input, 1: weight), fp8_fwd_scale [2], fp8_fwd_scale_inv
///   [2], fp8_bwd_amax_history [H, 1] (slot 0: grad_output),     fp8_bwd_scale [1],
///   fp8_bwd_scale_inv [1].
class Fp8LinearImpl : public torch::nn::Cloneable<Fp8LinearImpl> {
 public:
  Fp8LinearImpl(int64_t in_features, int64_t out_features)
      : Fp8LinearImpl(Fp8LinearOptions(in_features, out_features)) {}
  explicit Fp8LinearImpl(const Fp8LinearOptions& options_);

  void reset() override;
  /// torch::nn::Linear's initialisation: kaiming_uniform(a = √5) weight, U(±1/√in) bias.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// Input [..., in_features] → output [..., out_features].
  torch::Tensor forward(const torch::Tensor& input);

  /// residual + forward(input), residual of the output's shape (a transformer block's residual
  /// connection: x + proj(attention)). In an FP8 region the GEMM adds it (cuBLASLt's C,
  /// Fp8GemmOptions::residual) where it is in the GEMM's output dtype and the token count needs
  /// no padding: one rounding of x·Wᵀ + b + residual, and no pass of its own over the
  /// activations; elsewhere it is added after, as `residual + forward(input)`.
  torch::Tensor forward_with_residual(const torch::Tensor& input, const torch::Tensor& residual);

  /// forward(input).split_with_sizes(split_sizes, -1), whose pieces' gradients the FP8 backward
  /// quantizes where they are instead of concatenating them first (cast_transpose_columns;
  /// quantize_blockwise_columns in the blockwise recipe): a fused QKV projection's q, k and v,
  /// whose gradients attention returns as three tensors. split_sizes: positive, summing to
  /// out_features. Outside FP8 autograd concatenates the gradients as split_with_sizes'
  /// backward does.
  std::vector<torch::Tensor> forward_split(const torch::Tensor& input,
                                           at::IntArrayRef split_sizes);

  /// Whether the weight shape allows FP8 GEMMs (both dimensions multiples of 16).
  bool fp8_eligible() const;
  /// How many times forward() has run (lets MixedPrecisionPlugin verify that a module it
  /// swapped into a model is the one the model's forward calls).
  int64_t forward_calls() const { return forward_calls_; }

  // ---- fp8_params only ----
  /// The high-precision initial weight (float32), kept under Fp8ModelInit's
  /// preserve_high_precision_init_val until cleared; undefined otherwise.
  const torch::Tensor& high_precision_init_val() const { return high_precision_init_val_; }
  void clear_high_precision_init_val() { high_precision_init_val_ = torch::Tensor(); }
  /// Gradient of the FP8 weight, accumulated over backward passes until zeroed: FP32,
  /// undefined before the first backward and after zero_main_grad(); bound to a buffer
  /// (set_main_grad_buffer), it is that buffer, in its dtype.
  const torch::Tensor& main_grad() const { return meta_->main_grad().tensor(); }
  /// Clears main_grad for the next optimizer step. As torch::optim::Optimizer::zero_grad, it
  /// releases the tensor by default (4 bytes per weight element that are not held between
  /// steps, nor during the next forward pass, where activations peak); the next backward pass
  /// allocates it again (an FP8 pass writes it with its first weight-gradient GEMM, without a
  /// zero fill).
  /// set_to_none=false keeps it allocated and fills it with zeros. A bound buffer stays bound
  /// and is left as it is (its owner zeroes it) unless set_to_none is false.
  void zero_main_grad(bool set_to_none = true);
  /// Binds main_grad to `buffer` ([out_features, in_features]; float32, bfloat16 or float16;
  /// on the weight's device): the weight gradient GEMMs accumulate into it directly, with no
  /// tensor of the module's own and no copy. For a data-parallel gradient bucket (Megatron's
  /// param.main_grad is a view into its grad buffer); the buffer's dtype is then the
  /// accumulation dtype. An undefined tensor unbinds (main_grad becomes undefined).
  void set_main_grad_buffer(torch::Tensor buffer);
  /// Called inside the backward pass once every forward call recorded since the last
  /// zero_main_grad() has added its weight gradient into main_grad (a layer used twice in one
  /// forward pass: after the second), so that a distributed optimizer can start reducing it
  /// while the backward pass goes on. One hook; an empty function removes it. Not copied by
  /// clone().
  void set_main_grad_hook(std::function<void()> hook) {
    meta_->main_grad().set_ready_hook(std::move(hook));
  }
  /// Re-quantizes `master` ([out, in], any float dtype) into the FP8 weight, with a scale from
  /// its own amax (current scaling; the amax is also recorded in the weight's history slot).
  void update_fp8_weight(const torch::Tensor& master);
  /// Re-quantizes `master` into the FP8 weight in 128×128 blocks, each with its own power-of-two
  /// scale (the blockwise recipe's weights, TE's Float8BlockScaling): what forward calls under
  /// the blockwise recipe need. MixedPrecisionPlugin does it from its masters (shards) itself.
  void update_fp8_weight_blocks(const torch::Tensor& master);
  /// Whether the stored FP8 weight is in 128×128 blocks (update_fp8_weight_blocks) rather than
  /// one scale for the whole weight.
  bool fp8_weight_in_blocks() const { return meta_->weight_in_blocks(); }
  /// The stored FP8 weight in 128×128 blocks (data + its block scale_invs).
  Fp8BlockwiseTensor fp8_weight_blocks() const;
  /// The stored FP8 weight's values in `dtype`, whichever way it is scaled (one scale or blocks).
  torch::Tensor dequantized_weight(at::ScalarType dtype = at::kFloat) const;
  /// update_fp8_weight for many layers (masters[i] is layers[i]'s), for a loop that keeps its
  /// own masters: one multi-tensor amax, one scale kernel and one multi-tensor history update
  /// for all of them, then one quantization per layer straight into its FP8 weight's storage.
  /// (MixedPrecisionPlugin's DistributedOptimizer does the same from its master shards, with the
  /// amaxes all-reduced, and reports through fp8_weights_written.)
  static void update_fp8_weights(const std::vector<Fp8LinearImpl*>& layers,
                                 const std::vector<torch::Tensor>& masters);
  /// The stored FP8 weight as an Fp8Tensor (data + scale_inv), when it has one scale.
  Fp8Tensor fp8_weight() const;
  /// An optimizer wrote the FP8 weight's bytes in place (e.g. all-gathered shards, quantized
  /// with compute_current_scale(amax, E4M3), `amax` being the whole weight's):
  /// records amax in the weight's history slot as update_fp8_weight does, takes `scale_inv`
  /// and drops the cached transposes.
  void fp8_weight_written(const torch::Tensor& amax, const torch::Tensor& scale_inv);
  /// fp8_weight_written for many layers in a few launches, as the DistributedOptimizer calls
  /// it after every step: `amaxes` and `scale_invs` are float32 [layers.size()], layer i's at i.
  static void fp8_weights_written(const std::vector<Fp8LinearImpl*>& layers,
                                  const torch::Tensor& amaxes, const torch::Tensor& scale_invs);
  /// Replaces the weight with high-precision `values` ([out, in]): quantizes them with
  /// update_fp8_weight and keeps them (float32) as the high-precision initial value, which
  /// seeds the FP32 master weight. Used when an existing layer's weights move into this one.
  void set_high_precision_weight(const torch::Tensor& values);

  /// The layer's FP8 state (scaling slots, amax group, main_grad): what its autograd nodes keep
  /// and what an optimizer of its FP8 weight talks to. Its own (a clone has another).
  const c10::intrusive_ptr<Fp8Meta>& fp8_meta() const { return meta_; }

  // ---- for modules that fuse this layer's GEMM into an autograd function of their own
  // (Fp8LayerNormLinear, Fp8LayerNormMLP) ----
  /// What one FP8 forward call uses.
  struct Fp8Call {
    /// The FP8 weight and its transpose (cached or fresh); under fp8_params no transpose (the
    /// backward makes it).
    Fp8CastTranspose weight_q;
    /// The blockwise recipe's instead: W in 128×128 blocks and Wᵀ (the same blocks).
    Fp8BlockwiseCastTranspose weight_blocks;
    Fp8Recipe recipe;
    at::ScalarType out_dtype;  ///< the autocast dtype, else the input's
    c10::intrusive_ptr<Fp8Meta> meta;
  };
  /// Whether a GEMM of `rows` rows runs in FP8 (inside a region, not kept in high precision,
  /// an eligible shape, at least fp8_min_gemm_size). No side effects.
  bool runs_in_fp8(int64_t rows) const;
  /// When a GEMM of `rows` rows whose input has `input`'s dtype and device runs in FP8: resizes
  /// the histories to the region's recipe, registers the forward metadata with the region,
  /// quantizes (or takes) the weight and, under fp8_params with grad mode on, expects one more
  /// main_grad addition from the call's backward pass. Otherwise nullopt (a one-time warning
  /// says why, where the reason is the layer's).
  std::optional<Fp8Call> prepare_fp8_call(const torch::Tensor& input, int64_t rows);
  /// An empty tensor on the weight's device that requires grad under fp8_params: an input of
  /// the FP8 autograd function, so that its backward runs (and feeds main_grad) even when
  /// nothing else needs a gradient. Detached, it stands in for a missing bias.
  const torch::Tensor& grad_anchor();

  Fp8LinearOptions options;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor fp8_fwd_amax_history, fp8_fwd_scale, fp8_fwd_scale_inv;
  torch::Tensor fp8_bwd_amax_history, fp8_bwd_scale, fp8_bwd_scale_inv;
  /// fp8_params only: scale_inv of the stored FP8 weight, [1]; in 128×128 blocks, the block
  /// grid (Fp8BlockwiseTensor's layout).
  torch::Tensor weight_scale_inv;

 private:
  Fp8CastTranspose quantized_weight(const Fp8Recipe& recipe);
  Fp8BlockwiseCastTranspose quantized_weight_blocks(const Fp8Recipe& recipe);
  /// Whether weight_cache_ holds the copy of this weight (version, storage) for `recipe`.
  bool weight_cache_fits(const Fp8Recipe& recipe) const;
  torch::Tensor high_precision_forward(const torch::Tensor& input);
  void check_input(const torch::Tensor& input) const;
  // forward's pieces: split_sizes empty → the whole output as one; plus `residual` when defined.
  std::vector<torch::Tensor> forward_pieces(const torch::Tensor& input,
                                            at::IntArrayRef split_sizes,
                                            const torch::Tensor& residual);

  c10::intrusive_ptr<Fp8Meta> meta_;
  torch::Tensor grad_anchor_;
  torch::Tensor high_precision_init_val_;
  /// cache_fp8_weight: the last FP8 copy of the weight (per tensor, or in blocks), and what it
  /// was made from.
  struct WeightCache {
    int64_t version = -1;
    const void* data = nullptr;
    Fp8Scaling scaling = Fp8Scaling::kDelayed;
    Fp8Format format = Fp8Format::kE4M3;
    Fp8CastTranspose tensorwise;
    Fp8BlockwiseCastTranspose blocks;
  };
  std::optional<WeightCache> weight_cache_;
  int64_t forward_calls_ = 0;
};

TORCH_MODULE(Fp8Linear);

}  // namespace amp8
