#include "plugin/modules/convert_module.h"

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "plugin/fp8/fp8_gemm_choice.h"
#include "plugin/modules/fp8_layer_norm.h"
#include "plugin/modules/fp8_linear.h"

namespace amp8 {
namespace {

bool multiple_of_16(int64_t n) { return n % 16 == 0; }

bool eligible_linear(const torch::nn::Module& module) {
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module)) {
    return multiple_of_16(linear->options.in_features()) &&
           multiple_of_16(linear->options.out_features());
  }
  if (const auto* fp8 = dynamic_cast<const Fp8LinearImpl*>(&module)) return fp8->fp8_eligible();
  return false;
}

bool contains_eligible_linear(const torch::nn::Module& module) {
  if (eligible_linear(module)) return true;
  for (const auto& child : module.children()) {
    if (contains_eligible_linear(*child)) return true;
  }
  return false;
}

std::vector<std::shared_ptr<torch::nn::Module>> container_children(const torch::nn::Module& module) {
  if (dynamic_cast<const torch::nn::SequentialImpl*>(&module) ||
      dynamic_cast<const torch::nn::ModuleListImpl*>(&module)) {
    return module.children();
  }
  return {};
}

// The units num_layers_at_start/end_in_bf16 count: the children (with a linear layer) of the
// largest Sequential/ModuleList, else the eligible linear layers themselves, in order.
std::vector<const torch::nn::Module*> model_layers(const torch::nn::Module& model) {
  std::vector<const torch::nn::Module*> best;
  std::vector<const torch::nn::Module*> linears;
  std::vector<const torch::nn::Module*> stack{&model};
  // Pre-order walk (children pushed in reverse so they pop in registration order).
  while (!stack.empty()) {
    const auto* module = stack.back();
    stack.pop_back();
    std::vector<const torch::nn::Module*> layers;
    for (const auto& child : container_children(*module)) {
      if (contains_eligible_linear(*child)) layers.push_back(child.get());
    }
    if (layers.size() > best.size()) best = layers;
    if (eligible_linear(*module)) linears.push_back(module);
    const auto children = module->children();
    for (auto it = children.rbegin(); it != children.rend(); ++it) stack.push_back(it->get());
  }
  return best.empty() ? linears : best;
}

// Points the parent's registry (and, for containers, the list it calls) at `replacement`.
bool replace_child(torch::nn::Module& parent, const std::string& name,
                   const std::shared_ptr<torch::nn::Module>& old,
                   const std::shared_ptr<torch::nn::Module>& replacement,
                   const torch::nn::AnyModule& any_replacement) {
  parent.replace_module(name, replacement);
  if (auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
    for (auto& entry : *sequential) {
      if (entry.ptr() == old) entry = any_replacement;  // every slot holding it
    }
    return true;
  }
  if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent)) {
    for (auto& entry : *list) {
      if (entry == old) entry = replacement;
    }
    return true;
  }
  if (auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(&parent)) {
    for (auto& entry : *dict) {
      if (entry.value() == old) entry.value() = replacement;
    }
    return true;
  }
  return false;
}

// The new parameter takes the old one's storage (and requires_grad), so nothing is copied.
void adopt(torch::Tensor& target, const torch::Tensor& source, Fp8Conversion& result) {
  if (!source.defined()) return;
  target.set_data(source.detach());
  target.set_requires_grad(source.requires_grad());
  result.replaced_params.emplace_back(source, target);
}

class Converter {
 public:
  Converter(const torch::nn::Module& model, const Fp8ConversionOptions& options,
            std::unordered_set<const torch::nn::Module*> kept)
      : options_(options), kept_layers_(std::move(kept)) {
    count_registrations(model);
  }

  void visit(torch::nn::Module& parent, const std::string& prefix, bool keep) {
    const auto children = parent.named_children();
    const bool sequential = dynamic_cast<const torch::nn::SequentialImpl*>(&parent) != nullptr;
    for (size_t i = 0; i < children.size(); ++i) {
      const std::string& name = children[i].key();
      const std::shared_ptr<torch::nn::Module> child = children[i].value();
      const std::string path = prefix.empty() ? name : prefix + "." + name;
      const bool keep_child = keep || kept_layers_.count(child.get()) > 0;
      if (const auto done = replacements_.find(child.get()); done != replacements_.end()) {
        replace_child(parent, name, child, done->second.first, done->second.second);
        continue;
      }
      if (sequential && !keep && options_.fuse_modules()) {
        if (const size_t length = fusable_run(children, i)) {
          fuse(parent, children, i, length, path);
          i += length - 1;
          continue;
        }
      }
      if (auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(child)) {
        if (!eligible_linear(*linear)) {
          result_.kept_in_high_precision.push_back(path + " (shape " +
                                                   std::to_string(linear->options.out_features()) +
                                                   "x" + std::to_string(linear->options.in_features()) +
                                                   " not a multiple of 16)");
        } else if (keep_child) {
          result_.kept_in_high_precision.push_back(path + " (bf16 layer)");
        } else {
          auto replacement = convert_linear(*linear);
          record(parent, name, path, child, replacement.ptr(), torch::nn::AnyModule(replacement));
          ++result_.fp8_linear_count;
        }
      } else if (auto norm = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(child)) {
        if (keep_child) {
          result_.kept_in_high_precision.push_back(path + " (bf16 layer)");
        } else {
          auto replacement = convert_layer_norm(*norm);
          record(parent, name, path, child, replacement.ptr(), torch::nn::AnyModule(replacement));
        }
      } else if (auto fp8 = std::dynamic_pointer_cast<Fp8LinearImpl>(child)) {
        // The model's own FP8 layers follow the same knobs as the swapped-in ones; one the model
        // itself keeps in high precision stays so. The amax history is resized now, not at the
        // first FP8 GEMM: a checkpoint of its buffers must load into a model just connected.
        const bool kept_by_model = fp8->options.keep_in_high_precision();
        fp8->options.fp8_min_gemm_size(options_.fp8_min_gemm_size()).keep_in_high_precision(keep_child || kept_by_model)
            .fp8_amax_history_len(options_.fp8_amax_history_len());
        fp8->fp8_meta()->ensure_history_len(options_.fp8_amax_history_len());
        if (kept_by_model && !keep_child) {
          result_.kept_in_high_precision.push_back(path + " (keep_in_high_precision)");
        } else if (keep_child) {
          // Megatron builds its bf16 layers outside the FP8 init context: a kept layer whose
          // weight lives only in FP8 would train a dequantized FP8 weight, not a bf16 one.
          TORCH_CHECK(!fp8->options.fp8_params(), "convert_to_fp8: ", path,
                      " is in a layer kept in bf16 (num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16) "
                      "but holds its weight only in FP8: it was built under an amp8::Fp8ModelInit guard. Give "
                      "the guard the same num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 and build "
                      "each layer inside an Fp8ModelInit::Layer scope, or set fp8_params(false)");
          result_.kept_in_high_precision.push_back(path + " (bf16 layer)");
        } else if (fp8->fp8_eligible()) {
          ++result_.fp8_linear_count;
          if (options_.fp8_params() && !fp8->options.fp8_params()) without_fp8_params_.push_back(path);
        }
      } else {
        visit(*child, path, keep_child);
      }
    }
  }

  Fp8Conversion take() { return std::move(result_); }
  /// The model's own Fp8Linear modules that run FP8 GEMMs on high-precision weights although
  /// fp8_params is set (they were built outside an Fp8ModelInit guard).
  const std::vector<std::string>& without_fp8_params() const { return without_fp8_params_; }

 private:
  // Built as options_.fp8_params says (inside Fp8ModelInit: FP8 weights).
  template <typename Module, typename Options>
  Module build(const Options& options) {
    std::optional<Fp8ModelInit> model_init;
    if (options_.fp8_params()) model_init.emplace(true, /*preserve_high_precision_init_val=*/true);
    return Module(options);
  }

  Fp8Linear convert_linear(torch::nn::LinearImpl& old) {
    auto fp8 = build<Fp8Linear>(Fp8LinearOptions(old.options.in_features(), old.options.out_features())
                                    .bias(old.options.bias())
                                    .fp8_amax_history_len(options_.fp8_amax_history_len())
                                    .fp8_min_gemm_size(options_.fp8_min_gemm_size()));
    fp8->to(old.weight.device());
    take_parameters(*fp8, old);
    return fp8;
  }

  Fp8LayerNorm convert_layer_norm(torch::nn::LayerNormImpl& old) {
    Fp8LayerNorm norm(Fp8LayerNormOptions(old.options.normalized_shape())
                          .eps(old.options.eps())
                          .elementwise_affine(old.options.elementwise_affine()));
    if (old.weight.defined()) {
      norm->to(old.weight.device());
      take_parameters(*norm, old);
    }
    return norm;
  }

  void take_parameters(Fp8LinearImpl& fp8, torch::nn::LinearImpl& old) {
    if (options_.fp8_params()) {
      fp8.set_high_precision_weight(old.weight.detach());
      result_.replaced_params.emplace_back(old.weight, fp8.weight);
    } else {
      adopt(fp8.weight, old.weight, result_);
    }
    if (old.options.bias()) adopt(fp8.bias, old.bias, result_);
  }

  void take_parameters(Fp8LayerNormImpl& norm, torch::nn::LayerNormImpl& old) {
    adopt(norm.weight, old.weight, result_);
    adopt(norm.bias, old.bias, result_);
  }

  // The length of the run of `children` from `first` that one fused module computes (see
  // convert_to_fp8): 4 for LayerNorm → Linear → GELU(tanh) → Linear, 2 for LayerNorm → Linear,
  // 0 for none.
  size_t fusable_run(const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& children,
                     size_t first) const {
    const auto at = [&](size_t i) { return i < children.size() ? children[i].value().get() : nullptr; };
    // A module the model holds in two places (or one kept in bf16) is converted on its own:
    // fused, its other place would become a pass-through or run the whole fused module.
    const auto kept = [&](size_t i) {
      const auto* module = at(i);
      const auto held = registrations_.find(module);
      return kept_layers_.count(module) > 0 || (held != registrations_.end() && held->second > 1);
    };
    const auto* norm = dynamic_cast<const torch::nn::LayerNormImpl*>(at(first));
    const auto* fc1 = dynamic_cast<const torch::nn::LinearImpl*>(at(first + 1));
    if (norm == nullptr || fc1 == nullptr || kept(first) || kept(first + 1)) return 0;
    const auto& shape = norm->options.normalized_shape();
    if (shape.size() != 1 || !norm->options.elementwise_affine() || fc1->options.in_features() != shape[0] ||
        !eligible_linear(*fc1)) {
      return 0;
    }
    const auto* gelu = dynamic_cast<const torch::nn::GELUImpl*>(at(first + 2));
    const auto* fc2 = dynamic_cast<const torch::nn::LinearImpl*>(at(first + 3));
    const bool mlp = gelu != nullptr && fc2 != nullptr && !kept(first + 2) && !kept(first + 3) &&
                     gelu->options.approximate() == "tanh" && eligible_linear(*fc2) &&
                     fc2->options.in_features() == fc1->options.out_features() &&
                     fc2->options.out_features() == shape[0] && fc2->options.bias() == fc1->options.bias();
    return mlp ? 4 : 2;
  }

  // Puts the fused module of the run children[first, first + length) into the first slot and
  // FusedSlot modules into the others.
  void fuse(torch::nn::Module& parent,
            const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& children,
            size_t first, size_t length, const std::string& path) {
    auto& norm = *children[first].value()->as<torch::nn::LayerNormImpl>();
    auto& fc1 = *children[first + 1].value()->as<torch::nn::LinearImpl>();
    const int64_t hidden = fc1.options.in_features();
    const auto device = fc1.weight.device();
    std::shared_ptr<torch::nn::Module> fused;
    torch::nn::AnyModule any;
    std::vector<std::string> sources;  // per slot, the fused module's part holding its parameters
    // The options both fused modules take from the run and from the conversion.
    const auto from_run = [&](auto fused_options) {
      fused_options.eps(norm.options.eps())
          .bias(fc1.options.bias())
          .fp8_amax_history_len(options_.fp8_amax_history_len())
          .fp8_min_gemm_size(options_.fp8_min_gemm_size());
      return fused_options;
    };
    if (length == 4) {
      auto& fc2 = *children[first + 3].value()->as<torch::nn::LinearImpl>();
      auto mlp = build<Fp8LayerNormMLP>(
          from_run(Fp8LayerNormMLPOptions(hidden, fc1.options.out_features())));
      mlp->to(device);
      take_parameters(*mlp->ln_fc1->layer_norm, norm);
      take_parameters(*mlp->ln_fc1->linear, fc1);
      take_parameters(*mlp->fc2, fc2);
      sources = {"ln_fc1.layer_norm", "ln_fc1.linear", "", "fc2"};
      result_.fp8_linear_count += 2;
      fused = mlp.ptr();
      any = torch::nn::AnyModule(mlp);
    } else {
      auto norm_linear = build<Fp8LayerNormLinear>(
          from_run(Fp8LayerNormLinearOptions(hidden, fc1.options.out_features())));
      norm_linear->to(device);
      take_parameters(*norm_linear->layer_norm, norm);
      take_parameters(*norm_linear->linear, fc1);
      sources = {"layer_norm", "linear"};
      result_.fp8_linear_count += 1;
      fused = norm_linear.ptr();
      any = torch::nn::AnyModule(norm_linear);
    }
    record(parent, children[first].key(), path, children[first].value(), fused, std::move(any));
    for (size_t i = 1; i < length; ++i) {
      std::ostringstream replaced;
      children[first + i].value()->pretty_print(replaced);
      FusedSlot placeholder(replaced.str(), static_cast<int64_t>(i), sources[i], i == 1 ? sources[0] : "");
      replace_child(parent, children[first + i].key(), children[first + i].value(), placeholder.ptr(),
                    torch::nn::AnyModule(placeholder));
    }
  }

  void record(torch::nn::Module& parent, const std::string& name, const std::string& path,
              const std::shared_ptr<torch::nn::Module>& old,
              const std::shared_ptr<torch::nn::Module>& replacement, torch::nn::AnyModule any) {
    const bool in_container = replace_child(parent, name, old, replacement, any);
    result_.modules.push_back({path, replacement, in_container, old});
    replacements_.emplace(old.get(), std::make_pair(replacement, std::move(any)));
  }

  // How many places of the tree hold each module (a module registered twice is visited once
  // below each place).
  void count_registrations(const torch::nn::Module& module) {
    for (const auto& child : module.children()) {
      if (++registrations_[child.get()] == 1) count_registrations(*child);
    }
  }
  std::unordered_map<const torch::nn::Module*, int> registrations_;

  // Modules already swapped, by the module they replaced: a module the model holds in two
  // places gets one replacement in both (converting it twice would train a copy that never runs).
  std::unordered_map<const torch::nn::Module*, std::pair<std::shared_ptr<torch::nn::Module>, torch::nn::AnyModule>>
      replacements_;

  Fp8ConversionOptions options_;
  std::unordered_set<const torch::nn::Module*> kept_layers_;
  Fp8Conversion result_;
  std::vector<std::string> without_fp8_params_;
};

}  // namespace

void FusedSlotImpl::pretty_print(std::ostream& stream) const {
  stream << "amp8::FusedSlot(" << replaced << (part.empty() ? "" : " -> " + part) << ")";
}

Fp8Conversion convert_to_fp8(torch::nn::Module& model, const Fp8ConversionOptions& options) {
  const int64_t at_start = options.num_layers_at_start_in_bf16();
  const int64_t at_end = options.num_layers_at_end_in_bf16();
  TORCH_CHECK(at_start >= 0, "num_layers_at_start_in_bf16 must be >= 0, got ", at_start);
  TORCH_CHECK(at_end >= 0, "num_layers_at_end_in_bf16 must be >= 0, got ", at_end);
  TORCH_CHECK(options.fp8_amax_history_len() >= 1, "fp8_amax_history_len must be >= 1, got ",
              options.fp8_amax_history_len());
  check_fp8_min_gemm_size(options.fp8_min_gemm_size(), "convert_to_fp8: fp8_min_gemm_size");

  const auto layers = model_layers(model);
  const auto num_layers = static_cast<int64_t>(layers.size());
  TORCH_CHECK(at_start + at_end <= num_layers,
              "num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = ", at_start + at_end,
              " exceeds the model's ", num_layers, " layers with a linear layer");
  std::unordered_set<const torch::nn::Module*> kept;
  for (int64_t i = 0; i < num_layers; ++i) {
    if (i < at_start || i >= num_layers - at_end) kept.insert(layers[i]);
  }
  if (eligible_linear(model)) {
    TORCH_CHECK(false, "convert_to_fp8: the model itself is a linear layer; wrap it in a module "
                       "(e.g. torch::nn::Sequential) so it can be swapped");
  }
  Converter converter(model, options, std::move(kept));
  converter.visit(model, "", false);
  std::string own_modules;
  for (const auto& path : converter.without_fp8_params()) own_modules += (own_modules.empty() ? "" : ", ") + path;
  TORCH_CHECK(own_modules.empty(), "fp8_params is set, but the model's own Fp8Linear modules ", own_modules,
              " hold high-precision weights: fp8_params reaches the modules convert_to_fp8 swaps in, and "
              "those built inside an amp8::Fp8ModelInit guard (TE's fp8_model_init). Build the model "
              "inside one, or set fp8_params(false)");
  auto result = converter.take();
  TORCH_CHECK(result.fp8_linear_count > 0,
              "fp8 is on but the model has no linear layer FP8 can run: FP8 needs a "
              "torch::nn::Linear or amp8::Fp8Linear with in_features and out_features divisible "
              "by 16 outside the layers kept by num_layers_at_start_in_bf16 / "
              "num_layers_at_end_in_bf16 (kept or ineligible: ",
              result.kept_in_high_precision.size(), "); set fp8 to \"none\" for this model");
  return result;
}

}  // namespace amp8
