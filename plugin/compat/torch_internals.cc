#include "plugin/compat/torch_internals.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <utility>

namespace amp8::detail {
namespace {

class PostAccumulateGradHook : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit PostAccumulateGradHook(std::function<void(const at::Tensor&)> hook) : hook_(std::move(hook)) {}
  void operator()(const torch::autograd::Variable& tensor) override { hook_(tensor); }

 private:
  std::function<void(const at::Tensor&)> hook_;
};

}  // namespace

int current_backward_pass() { return torch::autograd::get_current_graph_task_id(); }

bool current_backward_keeps_graph() {
  return current_backward_pass() != -1 && torch::autograd::get_current_graph_task_keep_graph();
}

void at_end_of_backward_pass(std::function<void()> callback) {
  TORCH_CHECK(current_backward_pass() != -1, "at_end_of_backward_pass: no backward pass is running");
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

void set_post_accumulate_grad_hook(const at::Tensor& param, std::function<void(const at::Tensor&)> hook) {
  if (!hook) {
    torch::autograd::impl::set_post_acc_grad_hooks(param, nullptr);
    return;
  }
  torch::autograd::impl::set_post_acc_grad_hooks(
      param, std::make_unique<PostAccumulateGradHook>(std::move(hook)));
}

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

}  // namespace amp8::detail
