// The bulk delayed-scaling update over 1000 slots with history 1024: one kernel launch,
// against eager LibTorch doing the same per group (amax over history, roll, scale formula).

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

#include "bench/bench_util.h"
#include "ops/scaling.h"

namespace {

// TE's Python recipe, op by op, one group at a time.
void eager_update(const std::vector<amp8::DelayedScalingGroup>& groups, float fp8_max) {
  for (const auto& g : groups) {
    auto amax = std::get<0>(g.amax_history.max(0));
    g.amax_history.copy_(at::roll(g.amax_history, -1, 0));
    g.amax_history[0].fill_(0.0);
    auto scale = (fp8_max / amax);
    scale = at::where(amax > 0.0, scale, g.scale);
    scale = at::where(at::isfinite(amax), scale, g.scale);
    scale = at::where(at::isinf(scale), at::full_like(scale, 3.4028234663852886e38), scale);
    g.scale.copy_(scale);
    g.scale_inv.copy_(1.0 / scale);
  }
}

// Median GPU time of one call replayed from a CUDA graph: the kernel alone, without the
// host-side launch overhead that the plain timing includes.
double graph_replay_ms(const std::function<void()>& fn) {
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  double ms = 0;
  {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream, 0));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    fn();
    cudaStreamEndCapture(stream, &graph);
    cudaGraphInstantiate(&exec, graph, 0);
    ms = amp8::bench::median_ms([&] { cudaGraphLaunch(exec, stream); }, 20, 200);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
  return ms;
}

// Kernel launches of one call, counted by capturing it into a CUDA graph.
size_t count_launches(const std::function<void()>& fn) {
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  size_t nodes = 0;
  {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream, 0));
    cudaGraph_t graph;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    fn();
    cudaStreamEndCapture(stream, &graph);
    cudaGraphGetNodes(graph, nullptr, &nodes);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
  return nodes;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace amp8;
  const std::string cmd = bench::command_line(argc, argv);
  const auto cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const int64_t history_len = 1024;
  for (int64_t slots_per_group : {1000, 4, 3}) {
    const int64_t num_groups = (1000 + slots_per_group - 1) / slots_per_group;
    std::vector<DelayedScalingGroup> groups;
    for (int64_t i = 0; i < num_groups; ++i) {
      groups.push_back({at::rand({history_len, slots_per_group}, cuda) * 100,
                        at::ones({slots_per_group}, cuda), at::ones({slots_per_group}, cuda)});
    }
    const DelayedScalingUpdateOptions options{Fp8Format::kE4M3, 0, AmaxComputeAlgo::kMax};
    const double ours_ms =
        bench::median_ms([&] { delayed_scaling_update(groups, options); }, 20, 200);
    const double eager_ms = bench::median_ms([&] { eager_update(groups, 448.0f); }, 3, 20);
    const double bytes = 2.0 * num_groups * slots_per_group * history_len * sizeof(float);
    bench::Record("delayed_scaling_update",
                  std::to_string(num_groups) + " groups x " + std::to_string(slots_per_group) +
                      " slots, history 1024",
                  cmd)
        .timing(ours_ms, "eager LibTorch per group (TE's Python recipe as ATen ops)", eager_ms)
        .set("kernel_launches",
             static_cast<double>(count_launches([&] { delayed_scaling_update(groups, options); })))
        .set("gbps", bytes / ours_ms / 1e6)
        .set("graph_replay_ms", graph_replay_ms([&] { delayed_scaling_update(groups, options); }))
        .print();
  }
  return 0;
}
