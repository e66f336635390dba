// Fp8Meta: the slot views, history resizes and batched weight bookkeeping; MainGrad: binding,
// accumulation and the ready hook.
#include "plugin/modules/fp8_meta.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/custom_class.h>

#include <algorithm>

#include "ops/fp8_gemm.h"

namespace amp8 {

namespace {
// An Fp8Meta travels in autograd contexts' saved_data, which holds IValues: registered, it is
// one (a custom-class object holding the intrusive_ptr).
const auto fp8_meta_class = torch::class_<Fp8Meta>("amp8", "Fp8Meta");
}  // namespace

// ---- MainGrad ----

void MainGrad::zero(bool set_to_none) {
  if (!set_to_none) {
    if (tensor_.defined()) tensor_.zero_();
  } else if (!bound_) {
    tensor_ = at::Tensor();
  }
  pending_ = 0;
}

void MainGrad::bind(at::Tensor buffer, const at::Device& device) {
  if (buffer.defined()) {
    const auto dtype = buffer.scalar_type();
    TORCH_CHECK(buffer.sizes() == at::IntArrayRef(weight_shape_),
                "Fp8Linear::set_main_grad_buffer: buffer must have the weight's shape ",
                at::IntArrayRef(weight_shape_), ", got ", buffer.sizes());
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "Fp8Linear::set_main_grad_buffer: buffer must be float32, bfloat16 or float16, "
                "got ", dtype);
    TORCH_CHECK(buffer.device() == device, "Fp8Linear::set_main_grad_buffer: buffer must be on "
                "the weight's device ", device, ", got ", buffer.device());
    TORCH_CHECK(buffer.is_contiguous(),
                "Fp8Linear::set_main_grad_buffer: buffer must be contiguous");
    TORCH_CHECK(!bound_,
                "Fp8Linear::set_main_grad_buffer: main_grad is already bound to a buffer (another "
                "optimizer's?); unbind it first with set_main_grad_buffer({})");
  }
  tensor_ = std::move(buffer);
  bound_ = tensor_.defined();
}

void MainGrad::added() {
  if (pending_ > 0) --pending_;
  if (pending_ == 0 && ready_hook_) ready_hook_();
}

void MainGrad::add(const at::Tensor& grad) {
  c10::AutoGradMode no_grad(false);
  if (!tensor_.defined()) tensor_ = at::zeros(weight_shape_, grad.options().dtype(at::kFloat));
  tensor_.add_(grad.to(at::kFloat));
  added();
}

void MainGrad::add_product(const Fp8Tensor& grad_t, const Fp8Tensor& x_t) {
  if (!tensor_.defined()) {
    tensor_ = fp8_gemm(grad_t, x_t, at::kFloat);
  } else {
    Fp8GemmOptions accumulate;
    accumulate.out = tensor_;
    accumulate.accumulate = true;
    fp8_gemm(grad_t, x_t, tensor_.scalar_type(), accumulate);  // float32 unless bound
  }
  added();
}

void MainGrad::add_product(const Fp8BlockwiseTensor& grad_t, const Fp8BlockwiseTensor& x_t) {
  if (!tensor_.defined()) {
    tensor_ = fp8_blockwise_gemm(grad_t, x_t, at::kFloat);
  } else if (tensor_.scalar_type() == at::kFloat || tensor_.scalar_type() == at::kBFloat16) {
    Fp8GemmOptions accumulate;
    accumulate.out = tensor_;
    accumulate.accumulate = true;
    fp8_blockwise_gemm(grad_t, x_t, tensor_.scalar_type(), accumulate);
  } else {
    // A float16 buffer: the block-scaled GEMMs write float32 or bfloat16 only.
    c10::AutoGradMode no_grad(false);
    tensor_.add_(fp8_blockwise_gemm(grad_t, x_t, at::kFloat));
  }
  added();
}

// ---- Fp8Meta ----

Fp8Meta::Fp8Meta(DelayedScalingGroup forward, DelayedScalingGroup backward,
                 at::Tensor weight_scale_inv, std::vector<int64_t> weight_shape)
    : forward_(std::move(forward)),
      backward_(std::move(backward)),
      weight_scale_inv_(std::move(weight_scale_inv)),
      main_grad_(std::move(weight_shape)) {}

const Fp8Meta::SlotViews& Fp8Meta::views() {
  const void* keys[4] = {forward_.scale.const_data_ptr(), forward_.amax_history.const_data_ptr(),
                         backward_.scale.const_data_ptr(), backward_.amax_history.const_data_ptr()};
  if (!std::equal(keys, keys + 4, views_.keys)) {
    for (auto slot : {Fp8Slot::kInput, Fp8Slot::kWeight}) {
      const auto column = static_cast<int64_t>(index(slot));
      views_.scale[index(slot)] = forward_.scale.narrow(0, column, 1);
      views_.amax[index(slot)] = forward_.amax_history[0][column];
    }
    views_.scale[index(Fp8Slot::kGradOutput)] = backward_.scale.narrow(0, 0, 1);
    views_.amax[index(Fp8Slot::kGradOutput)] = backward_.amax_history[0][0];
    std::copy(keys, keys + 4, views_.keys);
  }
  return views_;
}

void Fp8Meta::ensure_history_len(int64_t history_len) {
  if (forward_.amax_history.size(0) == history_len) return;
  // In place (set_), so the module's registered buffers follow. Row 0 and the newest rows are
  // kept.
  c10::AutoGradMode no_grad(false);
  auto resize = [&](at::Tensor& buffer) {
    auto resized = at::zeros({history_len, buffer.size(1)}, buffer.options());
    const int64_t keep = std::min(history_len, buffer.size(0));
    resized.narrow(0, 0, 1).copy_(buffer.narrow(0, 0, 1));
    if (keep > 1) {
      resized.narrow(0, history_len - keep + 1, keep - 1)
          .copy_(buffer.narrow(0, buffer.size(0) - keep + 1, keep - 1));
    }
    buffer.set_(resized);
  };
  resize(forward_.amax_history);
  resize(backward_.amax_history);
}

void Fp8Meta::weights_written(const std::vector<Fp8Meta*>& metas, const at::Tensor& amaxes,
                              const at::Tensor& scale_invs, const char* caller) {
  const auto n = static_cast<int64_t>(metas.size());
  for (const auto& [tensor, name] : {std::pair{&amaxes, "amaxes"}, {&scale_invs, "scale_invs"}}) {
    TORCH_CHECK(tensor->defined() && tensor->scalar_type() == at::kFloat && tensor->dim() == 1 &&
                    tensor->size(0) == n,
                caller, ": ", name, " must be float32 [", n, "] (one per layer), got ",
                tensor->defined() ? c10::toString(tensor->scalar_type()) : "an undefined tensor",
                " ", tensor->defined() ? tensor->sizes() : at::IntArrayRef{});
  }
  if (n == 0) return;
  c10::AutoGradMode no_grad(false);
  std::vector<at::Tensor> amax_slots, scale_inv_slots;
  amax_slots.reserve(n);
  scale_inv_slots.reserve(n);
  for (auto* meta : metas) {
    TORCH_CHECK(meta != nullptr && meta->fp8_params(), caller,
                ": every layer must be an Fp8Linear built with fp8_params");
    amax_slots.push_back(meta->amax(Fp8Slot::kWeight));
    // A weight that was in 128×128 blocks has one scale again (its buffer follows, in place).
    if (meta->weight_in_blocks()) meta->weight_scale_inv_.set_(at::ones({1}, meta->weight_scale_inv_.options()));
    scale_inv_slots.push_back(meta->weight_scale_inv());  // [1]
  }
  const auto device = amax_slots.front().device();
  // The history slot keeps the max of what it holds and the new amax.
  at::_foreach_maximum_(amax_slots, amaxes.to(device).unbind(0));
  at::_foreach_copy_(scale_inv_slots, scale_invs.to(device).reshape({n, 1}).unbind(0));
}

const at::Tensor& Fp8Meta::weight_scale_inv_blocks() {
  TORCH_CHECK(fp8_params(), "Fp8Meta::weight_scale_inv_blocks: the layer has no fp8_params");
  const auto& shape = main_grad_.weight_shape();
  const auto grid = blockwise_scale_shape(shape.at(0), shape.at(1), Fp8BlockShape::k128x128);
  if (weight_scale_inv_.sizes() != at::IntArrayRef(grid)) {
    c10::AutoGradMode no_grad(false);
    weight_scale_inv_.set_(at::zeros(grid, weight_scale_inv_.options()));
  }
  return weight_scale_inv_;
}

}  // namespace amp8
