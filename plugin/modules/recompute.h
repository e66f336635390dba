#pragma once
// Activation recomputation: a forward pass that keeps only its input, and is run again in the
// backward pass to get the activations its gradients need. Megatron-Core's "full" recompute
// granularity (TransformerConfig's recompute_granularity, recompute_method,
// recompute_num_layers); torch.utils.checkpoint with use_reentrant=True; TE's
// te.distributed.checkpoint. It trades one more forward pass of the recomputed layers for their
// activations' memory: a decoder layer keeps one [tokens, hidden] tensor instead of the dozen or
// so its backward pass reads.

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace amp8 {

/// Which layers of a stack recompute their activations (Megatron-Core's recompute_method).
enum class RecomputeMethod {
  kNone,     ///< none: every activation is kept
  kUniform,  ///< the layers in chunks of num_layers; each chunk keeps only its input
  kBlock,    ///< the first num_layers layers, each on its own; the others keep theirs
};

/// "none", "uniform" or "block"; throws naming the accepted values.
RecomputeMethod recompute_method_from_string(const std::string& name);
const char* to_string(RecomputeMethod method);

/// Activation recomputation for a stack of layers (forward_layers), under Megatron-Core's
/// names:
///   RecomputeOptions().method(RecomputeMethod::kUniform).num_layers(1)   // every layer
struct RecomputeOptions {
  /// Default: kNone.
  TORCH_ARG(RecomputeMethod, method) = RecomputeMethod::kNone;
  /// The chunk length (kUniform) or how many layers from the first (kBlock); with kNone, an
  /// error if set. Default: 1.
  TORCH_ARG(int64_t, num_layers) = 1;

 public:
  /// Throws naming the field unless num_layers is in [1, layers] (for a method other than
  /// kNone).
  void validate(int64_t layers) const;
};

/// function(input), keeping for the backward pass only `input`, not what `function` computes
/// on the way. The backward pass runs `function` again, as the first run ran it: with the same
/// random-number state (the CPU's and the input's GPU's: dropout draws the same masks), the same
/// at::autocast setting, the same FP8 region (Fp8Autocast) and, under delayed scaling, the
/// scales of the first run, which its region's end has updated since; the amaxes the second run
/// measures do not reach the amax histories, and a region `function` opens itself updates
/// nothing the second time. Then it back-propagates through the second run: the parameters
/// `function` uses get their gradients there (autograd hooks and FP8 main_grad included), and
/// the input gets its gradient.
///
/// As PyTorch's reentrant checkpoint: the gradients come through `.backward()` (an error under
/// torch::autograd::grad, backward with `inputs`, or create_graph); a parameter `function` uses
/// must not be used by another recomputed function or elsewhere in the same forward pass (its
/// gradient would arrive in two backward passes, and the data-parallel buckets and FP8
/// main_grad expect one); random numbers drawn on another device than the CPU and the input's
/// are not replayed. Without grad mode it is function(input). `function` is kept until the
/// backward pass: what it captures must live as long. Not inside a CUDA graph capture.
torch::Tensor recompute_activations(std::function<torch::Tensor(const torch::Tensor&)> function,
                                    const torch::Tensor& input);

/// x through `count` layers, x ← layer(i, x) for i = 0 … count - 1, with the layers `options`
/// names recomputed (recompute_activations): kUniform, chunks of num_layers layers (the last
/// one may be shorter); kBlock, each of the first num_layers layers. Calls
/// options.validate(count) (num_layers in [1, count]).
torch::Tensor forward_layers(int64_t count, const RecomputeOptions& options,
                             std::function<torch::Tensor(int64_t, const torch::Tensor&)> layer,
                             torch::Tensor x);

}  // namespace amp8
