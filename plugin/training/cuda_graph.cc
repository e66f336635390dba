#include "plugin/training/cuda_graph.h"

// The capture and replay over LibTorch's at::cuda::CUDAGraph, on a stream from LibTorch's pool.

#include <c10/util/Exception.h>

#if defined(AMP8_WITH_CUDA) && __has_include(<ATen/cuda/CUDAGraph.h>)
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define AMP8_HAS_CUDA_GRAPH 1
#endif


namespace amp8 {

#ifdef AMP8_HAS_CUDA_GRAPH

namespace {

c10::Device model_device(const torch::nn::Module& model) {
  for (const auto& parameter : model.parameters()) return parameter.device();
  for (const auto& buffer : model.buffers()) return buffer.device();
  return c10::Device(c10::kCPU);
}

}  // namespace

struct CudaGraphedMicroBatch::Impl {
  c10::Device device;
  c10::cuda::CUDAStream stream;
  at::cuda::CUDAGraph graph;
  bool captured = false;
  std::vector<torch::Tensor> static_inputs;
  torch::Tensor static_loss;

  // Runs `work` on the graph's stream, after the current stream's work so far; the current
  // stream's later work waits for it.
  template <typename Work>
  torch::Tensor on_stream(Work&& work) {
    const auto current = c10::cuda::getCurrentCUDAStream(device.index());
    at::cuda::CUDAEvent before;
    before.record(current);
    before.block(stream);
    torch::Tensor loss;
    {
      c10::cuda::CUDAStreamGuard guard(stream);
      loss = work();
    }
    at::cuda::CUDAEvent after;
    after.record(stream);
    after.block(current);
    return loss;
  }

  void copy_inputs(const std::vector<torch::Tensor>& inputs) {
    TORCH_CHECK(inputs.size() == static_inputs.size(), "cuda_graph: the micro-batch has ", inputs.size(),
                " input tensors; the captured graph was made for ", static_inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& input = inputs[i];
      const auto& held = static_inputs[i];
      TORCH_CHECK(input.defined() && input.sizes() == held.sizes() && input.scalar_type() == held.scalar_type(),
                  "cuda_graph: the micro-batch's input ", i, " is ",
                  input.defined() ? c10::toString(input.scalar_type()) : "undefined", " ",
                  input.defined() ? input.sizes() : at::IntArrayRef{}, "; the captured graph was made for ",
                  held.scalar_type(), " ", held.sizes(), " (a replay takes the shapes of the capture)");
      held.copy_(input, /*non_blocking=*/true);
    }
  }
};

CudaGraphedMicroBatch::CudaGraphedMicroBatch(const torch::nn::Module& model) {
  const auto device = model_device(model);
  TORCH_CHECK(device.is_cuda(), "cuda_graph: the model is on ", device, "; CUDA graphs need it on a CUDA GPU");
  impl_ = std::unique_ptr<Impl>(new Impl{device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()),
                                         at::cuda::CUDAGraph(), false, {}, {}});
}

CudaGraphedMicroBatch::~CudaGraphedMicroBatch() = default;

bool CudaGraphedMicroBatch::captured() const { return impl_->captured; }

torch::Tensor CudaGraphedMicroBatch::run_eager(const std::vector<torch::Tensor>& inputs, const Body& body) {
  return impl_->on_stream([&] { return body(inputs); });
}

torch::Tensor CudaGraphedMicroBatch::capture_and_run(const std::vector<torch::Tensor>& inputs, const Body& body) {
  auto& impl = *impl_;
  TORCH_CHECK(!impl.captured, "CudaGraphedMicroBatch::capture_and_run: already captured");
  for (const auto& input : inputs) {
    TORCH_CHECK(input.defined() && input.device() == impl.device, "cuda_graph: every micro-batch input must be on ",
                impl.device, ", got ", input.defined() ? input.device().str() : "an undefined tensor");
  }
  impl.on_stream([&] {
    impl.static_inputs.clear();
    for (const auto& input : inputs) impl.static_inputs.push_back(input.clone(at::MemoryFormat::Contiguous));
    // Nothing runs while capturing: the replay below computes this micro-batch.
    impl.graph.capture_begin();
    try {
      impl.static_loss = body(impl.static_inputs);
    } catch (...) {
      try {
        impl.graph.capture_end();
      } catch (...) {
      }
      throw;
    }
    impl.graph.capture_end();
    return torch::Tensor();
  });
  TORCH_CHECK(impl.static_loss.defined() && impl.static_loss.numel() == 1,
              "cuda_graph: the captured work must return a loss with one element");
  impl.captured = true;
  return impl.on_stream([&] {
    impl.graph.replay();
    return impl.static_loss.clone();
  });
}

torch::Tensor CudaGraphedMicroBatch::replay(const std::vector<torch::Tensor>& inputs) {
  auto& impl = *impl_;
  TORCH_CHECK(impl.captured, "CudaGraphedMicroBatch::replay: nothing captured yet");
  return impl.on_stream([&] {
    impl.copy_inputs(inputs);
    impl.graph.replay();
    return impl.static_loss.clone();
  });
}

#else  // no CUDA graphs in this build

struct CudaGraphedMicroBatch::Impl {};

CudaGraphedMicroBatch::CudaGraphedMicroBatch(const torch::nn::Module& model) {
  TORCH_CHECK(false, "cuda_graph: this amp8 was built without CUDA (AMP8_WITH_CUDA); CUDA graphs need it and a "
              "CUDA GPU");
}
CudaGraphedMicroBatch::~CudaGraphedMicroBatch() = default;
bool CudaGraphedMicroBatch::captured() const { return false; }
torch::Tensor CudaGraphedMicroBatch::run_eager(const std::vector<torch::Tensor>&, const Body&) { return {}; }
torch::Tensor CudaGraphedMicroBatch::capture_and_run(const std::vector<torch::Tensor>&, const Body&) { return {}; }
torch::Tensor CudaGraphedMicroBatch::replay(const std::vector<torch::Tensor>&) { return {}; }

#endif

}  // namespace amp8
