#pragma once

// One micro-batch's forward pass, loss and backward pass captured in a CUDA graph and replayed:
// what TrainerOptions::cuda_graph runs (PyTorch's whole-network capture, TE's
// make_graphed_callables), for models whose steps are paced by the host's kernel launches.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <vector>

namespace amp8 {

/// Captures a micro-batch's work once and replays it. The work (`Body`) takes the micro-batch's
/// input tensors and returns its loss (detached, one element); it must be device work only, the
/// same kernels on the same addresses every time: no reads on the host, no shapes that depend on
/// values, every gradient it writes at a fixed address (PrecisionPlugin::use_static_gradients),
/// no state kept on the host between calls that a replay would need updated. Everything runs on
/// a stream of its own (a capture cannot use the default stream), ordered after the caller's
/// current stream's work and before its later work.
class CudaGraphedMicroBatch {
 public:
  using Body = std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs)>;

  /// For `model`'s device, which must be a CUDA GPU (an error names it otherwise, and builds
  /// without CUDA refuse).
  explicit CudaGraphedMicroBatch(const torch::nn::Module& model);
  ~CudaGraphedMicroBatch();
  CudaGraphedMicroBatch(const CudaGraphedMicroBatch&) = delete;
  CudaGraphedMicroBatch& operator=(const CudaGraphedMicroBatch&) = delete;

  /// Runs `body` eagerly on the graph's stream (the warm-up: state that cuBLAS and the caching
  /// allocator make per stream on first use then exists before the capture). Returns its loss.
  torch::Tensor run_eager(const std::vector<torch::Tensor>& inputs, const Body& body);
  /// Copies `inputs` into static inputs of their shapes, captures `body` on them (nothing runs
  /// while capturing), then replays it once. Returns the loss. Once only.
  torch::Tensor capture_and_run(const std::vector<torch::Tensor>& inputs, const Body& body);
  /// Copies `inputs` into the static inputs (same count, shapes, dtypes; an error names the
  /// first that differs) and replays. Returns this replay's loss (a copy: the next replay
  /// overwrites the captured one).
  torch::Tensor replay(const std::vector<torch::Tensor>& inputs);
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace amp8
