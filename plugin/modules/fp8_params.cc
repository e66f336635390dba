// Fp8Linear under fp8_params (TE's fp8_model_init): the FP8 weight the module stores, its
// re-quantization from an FP32 master after each optimizer step, and the module's side of
// main_grad (its Fp8Meta's MainGrad), where the weight gradient accumulates.
#include "plugin/modules/fp8_linear.h"

#include <torch/autograd.h>

#include <cmath>

#include "ops/blockwise.h"
#include "ops/quantize.h"
#include "ops/scaling.h"

namespace amp8 {

namespace {
thread_local bool model_init_enabled = false;
thread_local bool model_init_preserve = true;
thread_local int64_t model_init_at_start = 0, model_init_at_end = 0;
thread_local bool building_kept_layer = false;
}  // namespace

Fp8ModelInit::Fp8ModelInit(bool enabled, bool preserve_high_precision_init_val,
                           int64_t num_layers_at_start_in_bf16, int64_t num_layers_at_end_in_bf16)
    : previous_enabled_(model_init_enabled),
      previous_preserve_(model_init_preserve),
      previous_at_start_(model_init_at_start),
      previous_at_end_(model_init_at_end) {
  TORCH_CHECK(num_layers_at_start_in_bf16 >= 0 && num_layers_at_end_in_bf16 >= 0,
              "Fp8ModelInit: num_layers_at_start_in_bf16 and num_layers_at_end_in_bf16 must be >= 0, got ",
              num_layers_at_start_in_bf16, " and ", num_layers_at_end_in_bf16);
  model_init_enabled = enabled;
  model_init_preserve = preserve_high_precision_init_val;
  model_init_at_start = num_layers_at_start_in_bf16;
  model_init_at_end = num_layers_at_end_in_bf16;
}

Fp8ModelInit::~Fp8ModelInit() {
  model_init_enabled = previous_enabled_;
  model_init_preserve = previous_preserve_;
  model_init_at_start = previous_at_start_;
  model_init_at_end = previous_at_end_;
}

Fp8ModelInit::Layer::Layer(int64_t index, int64_t count) : previous_kept_(building_kept_layer) {
  TORCH_CHECK(index >= 0 && index < count, "Fp8ModelInit::Layer: index must be in [0, count), got ", index,
              " of ", count);
  TORCH_CHECK(model_init_at_start + model_init_at_end <= count,
              "Fp8ModelInit: num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = ",
              model_init_at_start + model_init_at_end, " exceeds the model's ", count, " layers");
  building_kept_layer =
      previous_kept_ || index < model_init_at_start || index >= count - model_init_at_end;
}

Fp8ModelInit::Layer::~Layer() { building_kept_layer = previous_kept_; }

bool Fp8ModelInit::is_enabled() { return model_init_enabled && !building_kept_layer; }
bool Fp8ModelInit::preserve_high_precision_init_val() { return model_init_preserve; }

Fp8Tensor Fp8LinearImpl::fp8_weight() const {
  TORCH_CHECK(options.fp8_params(), "Fp8Linear::fp8_weight: the module has no fp8_params");
  TORCH_CHECK(!fp8_weight_in_blocks(), "Fp8Linear(", options.in_features(), ", ",
              options.out_features(),
              "): the FP8 weight is stored in 128x128 blocks (the blockwise recipe), not with one "
              "scale; a region of another recipe needs it written with update_fp8_weight");
  return Fp8Tensor(weight, weight_scale_inv, Fp8Format::kE4M3);
}

Fp8BlockwiseTensor Fp8LinearImpl::fp8_weight_blocks() const {
  TORCH_CHECK(options.fp8_params(), "Fp8Linear::fp8_weight_blocks: the module has no fp8_params");
  TORCH_CHECK(fp8_weight_in_blocks(), "Fp8Linear(", options.in_features(), ", ",
              options.out_features(),
              "): under the blockwise recipe the FP8 weight must be stored in 128x128 blocks; it "
              "holds one scale for the whole weight. MixedPrecisionPlugin with fp8_recipe "
              "\"blockwise\" stores it so; a loop of its own calls update_fp8_weight_blocks(master)");
  return {weight, weight_scale_inv, Fp8Format::kE4M3, Fp8BlockShape::k128x128};
}

torch::Tensor Fp8LinearImpl::dequantized_weight(at::ScalarType dtype) const {
  return fp8_weight_in_blocks() ? fp8_weight_blocks().dequantize(dtype) : fp8_weight().dequantize(dtype);
}

void Fp8LinearImpl::update_fp8_weight_blocks(const torch::Tensor& master) {
  TORCH_CHECK(options.fp8_params(),
              "Fp8Linear::update_fp8_weight_blocks: the module was not built with fp8_params "
              "(construct it under amp8::Fp8ModelInit)");
  TORCH_CHECK(master.defined() && master.sizes() == weight.sizes(),
              "Fp8Linear::update_fp8_weight_blocks: master must have shape ", weight.sizes(), ", got ",
              master.defined() ? master.sizes() : at::IntArrayRef{});
  torch::NoGradGuard no_grad;
  auto values = master.detach().to(weight.device());
  if (values.scalar_type() != at::kFloat && values.scalar_type() != at::kBFloat16 &&
      values.scalar_type() != at::kHalf) {
    values = values.to(at::kFloat);
  }
  values = values.contiguous();
  const int64_t rows = weight.size(0), cols = weight.size(1);
  quantize_whole_weights_blockwise({{values.reshape({-1}), rows, cols, 0}}, weight_block_options(),
                                   {weight.view({-1})}, {meta_->weight_scale_inv_blocks()});
}

void Fp8LinearImpl::update_fp8_weight(const torch::Tensor& master) {
  TORCH_CHECK(options.fp8_params(),
              "Fp8Linear::update_fp8_weight: the module was not built with fp8_params "
              "(construct it under amp8::Fp8ModelInit)");
  TORCH_CHECK(master.defined(), "Fp8Linear::update_fp8_weight: master must be a defined tensor");
  TORCH_CHECK(master.sizes() == weight.sizes(), "Fp8Linear::update_fp8_weight: master must have shape ",
              weight.sizes(), ", got ", master.sizes());
  update_fp8_weights({this}, {master});
}

void Fp8LinearImpl::fp8_weight_written(const torch::Tensor& amax, const torch::Tensor& scale_inv) {
  TORCH_CHECK(options.fp8_params(),
              "Fp8Linear::fp8_weight_written: the module was not built with fp8_params");
  TORCH_CHECK(amax.numel() == 1 && scale_inv.numel() == 1,
              "Fp8Linear::fp8_weight_written: amax and scale_inv must hold one value each, got "
              "shapes ", amax.sizes(), " and ", scale_inv.sizes());
  fp8_weights_written({this}, amax.reshape({1}).to(at::kFloat),
                      scale_inv.reshape({1}).to(at::kFloat));
}

void Fp8LinearImpl::update_fp8_weights(const std::vector<Fp8LinearImpl*>& layers,
                                       const std::vector<torch::Tensor>& masters) {
  TORCH_CHECK(layers.size() == masters.size(), "Fp8Linear::update_fp8_weights: ", layers.size(),
              " layers but ", masters.size(), " masters");
  if (layers.empty()) return;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> values;
  values.reserve(masters.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    auto* layer = layers[i];
    TORCH_CHECK(layer != nullptr && layer->options.fp8_params(),
                "Fp8Linear::update_fp8_weights: every layer must be an Fp8Linear built with "
                "fp8_params");
    TORCH_CHECK(masters[i].defined() && masters[i].sizes() == layer->weight.sizes(),
                "Fp8Linear::update_fp8_weights: masters[", i, "] must have shape ",
                layer->weight.sizes(), ", got ",
                masters[i].defined() ? masters[i].sizes() : at::IntArrayRef{});
    auto v = masters[i].detach().to(layer->weight_scale_inv.device());
    if (v.scalar_type() != at::kFloat && v.scalar_type() != at::kBFloat16 &&
        v.scalar_type() != at::kHalf) {
      v = v.to(at::kFloat);
    }
    values.push_back(v.contiguous());
  }
  // max|master| of every layer at once (a NaN propagates).
  const auto amaxes = compute_amax_many(values);
  const auto scales = compute_current_scale(amaxes, Fp8Format::kE4M3);
  for (size_t i = 0; i < layers.size(); ++i) {
    auto& weight = layers[i]->weight;
    const auto scale = scales.narrow(0, static_cast<int64_t>(i), 1);
    if (weight.scalar_type() == at::kFloat8_e4m3fn && weight.is_contiguous()) {
      quantize(values[i], scale, Fp8Format::kE4M3, {}, false, weight);
    } else {
      weight.set_data(quantize(values[i], scale, Fp8Format::kE4M3).data);
    }
  }
  fp8_weights_written(layers, amaxes, scales.reciprocal());
}

void Fp8LinearImpl::fp8_weights_written(const std::vector<Fp8LinearImpl*>& layers,
                                        const torch::Tensor& amaxes,
                                        const torch::Tensor& scale_invs) {
  std::vector<Fp8Meta*> metas;
  metas.reserve(layers.size());
  for (auto* layer : layers) metas.push_back(layer ? layer->fp8_meta().get() : nullptr);
  Fp8Meta::weights_written(metas, amaxes, scale_invs, "Fp8Linear::fp8_weights_written");
}

void Fp8LinearImpl::set_high_precision_weight(const torch::Tensor& values) {
  TORCH_CHECK(options.fp8_params(),
              "Fp8Linear::set_high_precision_weight: the module was not built with fp8_params");
  update_fp8_weight(values);
  torch::NoGradGuard no_grad;
  high_precision_init_val_ =
      values.detach().to(weight_scale_inv.device(), at::kFloat, /*non_blocking=*/false,
                         /*copy=*/true);
}

void Fp8LinearImpl::zero_main_grad(bool set_to_none) { meta_->main_grad().zero(set_to_none); }

void Fp8LinearImpl::set_main_grad_buffer(torch::Tensor buffer) {
  TORCH_CHECK(options.fp8_params(),
              "Fp8Linear::set_main_grad_buffer: the module has no fp8_params (its weight has an "
              "autograd gradient)");
  meta_->main_grad().bind(std::move(buffer), weight.device());
}

}  // namespace amp8
