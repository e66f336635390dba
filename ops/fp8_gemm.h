#pragma once

#include <ATen/ATen.h>

#include "ops/fp8_tensor.h"

namespace amp8 {

/// Optional parts of an FP8 GEMM.
struct Fp8GemmOptions {
  /// Added to every row of the result, shape [N]. Any float dtype; it is converted to what the
  /// tensor cores take (fp16 for an fp16 output, else bf16), on CPU too, so both paths agree.
  at::Tensor bias;
  /// Accumulate: out += A·Bᵀ (+ bias) into `out` ([M, N], the output dtype, not FP8).
  at::Tensor out;
  bool accumulate = false;
  /// Added to the result: y = A·Bᵀ (+ bias) + residual, rounded once, where the GEMM reads it
  /// (cuBLASLt's C at beta = 1; the residual connection of a transformer block without its own
  /// pass over the activations). [M, N], contiguous, 16-byte aligned on the GPU, in the output
  /// dtype (not FP8); not with accumulate. It may be `out` itself (then out += A·Bᵀ + bias).
  at::Tensor residual;
  /// Hopper's fast FP8 accumulation (fewer promotions to full fp32): TE's choice for the
  /// forward GEMM; dgrad and wgrad use full accumulation. Default: false.
  bool use_fast_accum = false;
  /// FP8 output only: the result is multiplied by out_scale (one float32) and saturated
  /// into the FP8 dtype; out_amax (one float32), when defined, receives max|A·Bᵀ + bias|.
  at::Tensor out_scale;
  at::Tensor out_amax;
};

/// y = (A·Bᵀ) * a.scale_inv * b.scale_inv (+ bias) for FP8 A [M, K] and B [N, K], both
/// row-major: the "TN" GEMM Hopper's FP8 tensor cores take, and exactly y = x·Wᵀ of a linear
/// layer. `out_dtype` is float32, bfloat16, float16, or an FP8 dtype (then see out_scale).
/// E5M2 × E5M2 is not supported (neither is it by the hardware); E4M3 × E5M2 is.
///
/// CUDA: cuBLASLt, on LibTorch's cuBLASLt handle, workspace and current stream; K, N (and M
/// for FP8 outputs) must be multiples of 16 and the data 16-byte aligned.
/// CPU: the same arithmetic in fp32 (exact FP8 products, fp32 sums), so the two agree within
/// accumulation-order rounding; the same shape rules are enforced so a CPU run predicts a GPU
/// one.
at::Tensor fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, at::ScalarType out_dtype,
                    const Fp8GemmOptions& options = {});

/// How the CUDA path chooses cuBLASLt's algorithm for a GEMM configuration (shape, dtypes,
/// options, scale modes, alignments: fp8_gemm's and fp8_blockwise_gemm's), once per
/// configuration, at its first call under the current choice.
enum class Fp8GemmAlgoSelection {
  /// cuBLASLt's first heuristic pick: the same algorithm in every run, so the same rounding.
  kHeuristic,
  /// The fastest of up to 8 heuristic candidates, each timed on the call's own operands (what
  /// PyTorch's TunableOp does for cuBLASLt; an accumulating GEMM's candidates add into a copy
  /// of the output, and where that copy does not fit in memory the heuristic's first is kept).
  /// Costs a few milliseconds and one host synchronization per configuration; which
  /// algorithm wins, and so the rounding, can differ from run to run. Not while
  /// at::globalContext().deterministicAlgorithms() is set (the Trainer's deterministic mode):
  /// the heuristic's first then. During CUDA graph capture nothing is timed: a configuration
  /// keeps the algorithm it has, and one first seen there takes the heuristic's.
  kFastestMeasured,
};

/// The process-wide choice (default kHeuristic). Configurations already chosen under the other
/// choice are chosen again at their next call.
void set_fp8_gemm_algo_selection(Fp8GemmAlgoSelection selection);
Fp8GemmAlgoSelection fp8_gemm_algo_selection();

/// Sets the choice for its lifetime and puts the previous one back.
class Fp8GemmAlgoSelectionGuard {
 public:
  explicit Fp8GemmAlgoSelectionGuard(Fp8GemmAlgoSelection selection) : previous_(fp8_gemm_algo_selection()) {
    set_fp8_gemm_algo_selection(selection);
  }
  ~Fp8GemmAlgoSelectionGuard() { set_fp8_gemm_algo_selection(previous_); }
  Fp8GemmAlgoSelectionGuard(const Fp8GemmAlgoSelectionGuard&) = delete;
  Fp8GemmAlgoSelectionGuard& operator=(const Fp8GemmAlgoSelectionGuard&) = delete;

 private:
  Fp8GemmAlgoSelection previous_;
};

/// How many candidate algorithms kFastestMeasured has timed in this process (it grows by the
/// candidates of each configuration chosen that way; 0 where none was).
int64_t fp8_gemm_candidates_timed();

}  // namespace amp8
