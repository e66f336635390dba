#include "plugin/training/export.h"

#include <torch/serialize/output-archive.h>

#include "plugin/modules/convert_module.h"
#include "plugin/training/checkpoint.h"

namespace amp8 {
namespace {

// amp8's own modules (Fp8Linear, Fp8LayerNorm, Fp8LayerNormLinear, ...): Module::name() is the
// demangled class name.
bool is_amp8_module(const torch::nn::Module& module) { return module.name().rfind("amp8::", 0) == 0; }

// Module::save's layout: the module's own parameters and buffers, then one nested archive per
// serializable child, under the child's name. A run of a Sequential that convert_to_fp8 fused
// is written as the modules it replaced: each slot as the fused module's part that holds its
// parameters (FusedSlot names them), an empty archive for a slot that had none (GELU).
void write_module(const torch::nn::Module& module, const PrecisionPlugin& plugin,
                  torch::serialize::OutputArchive& archive) {
  for (const auto& parameter : module.named_parameters(/*recurse=*/false)) {
    archive.write(parameter.key(), plugin.fp32_value(parameter.value()));
  }
  if (!is_amp8_module(module)) {
    for (const auto& buffer : module.named_buffers(/*recurse=*/false)) {
      archive.write(buffer.key(), buffer.value(), /*is_buffer=*/true);
    }
  }
  const auto children = module.named_children();
  // `path` inside the module at children[index]; null for an empty path (nothing to write).
  const auto part = [&](size_t index, const std::string& path) -> const torch::nn::Module* {
    if (path.empty()) return nullptr;
    const auto modules = children[index].value()->named_modules();
    const auto* found = modules.find(path);
    TORCH_CHECK(found != nullptr, "export_fp32_model: a FusedSlot names part ", path, ", which ",
                children[index].value()->name(), " does not have");
    return found->get();
  };
  for (size_t i = 0; i < children.size(); ++i) {
    const torch::nn::Module* child = children[i].value().get();
    if (!child->is_serializable()) continue;
    if (const auto* slot = dynamic_cast<const FusedSlotImpl*>(child)) {
      TORCH_CHECK(slot->fused_offset >= 1 && static_cast<size_t>(slot->fused_offset) <= i,
                  "export_fp32_model: the FusedSlot ", children[i].key(), " points ", slot->fused_offset,
                  " slots back, before the first");
      child = part(i - slot->fused_offset, slot->part);
    } else if (i + 1 < children.size()) {
      if (const auto* next = dynamic_cast<const FusedSlotImpl*>(children[i + 1].value().get())) {
        if (next->fused_offset == 1 && !next->fused_slot_part.empty()) child = part(i, next->fused_slot_part);
      }
    }
    torch::serialize::OutputArchive child_archive(archive.compilation_unit());
    if (child != nullptr) write_module(*child, plugin, child_archive);
    archive.write(children[i].key(), child_archive);
  }
}

}  // namespace

void export_fp32_model(const torch::nn::Module& model, const PrecisionPlugin& plugin, const std::string& path) {
  torch::NoGradGuard no_grad;
  torch::serialize::OutputArchive archive;
  write_module(model, plugin, archive);
  save_atomically(archive, path, /*trailer=*/false);
}

}  // namespace amp8
