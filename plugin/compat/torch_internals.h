#pragma once
// The parts of PyTorch's C++ internals amp8 relies on, in one place: none of them is LibTorch's
// stable frontend API (torch::nn, torch::optim, at::), so each is wrapped here with the
// behaviour amp8 needs, and tests/torch_internals_test.cc pins that behaviour, so that a
// LibTorch upgrade that changes one fails there, by name, first.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <functional>

namespace amp8::detail {

/// An id of the backward pass (autograd graph task) running on this thread, the same for
/// every backward function of that pass, whatever thread the engine runs it on; -1 outside a
/// backward pass. (torch::autograd::get_current_graph_task_id)
int current_backward_pass();

/// Whether the running backward pass keeps its graph (retain_graph); false outside one.
/// (torch::autograd::get_current_graph_task_keep_graph)
bool current_backward_keeps_graph();

/// Runs `callback` once the running backward pass has computed every gradient, before
/// backward() returns. Only inside a backward pass. (Engine::queue_callback)
void at_end_of_backward_pass(std::function<void()> callback);

/// Calls `hook(param)` each time autograd has accumulated a gradient into param.grad() — after
/// the accumulation, so the gradient is complete for this backward pass. One hook per
/// parameter: setting replaces the previous one; an empty function removes it.
/// (torch::autograd::impl::set_post_acc_grad_hooks)
void set_post_accumulate_grad_hook(const at::Tensor& param, std::function<void(const at::Tensor&)> hook);

/// The current stream of `device` (any device type: CUDA's current stream, the CPU's default).
/// (c10::impl::VirtualGuardImpl)
c10::Stream current_stream(const c10::Device& device);

}  // namespace amp8::detail
