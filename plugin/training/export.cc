#include "plugin/training/export.h"

#include <torch/serialize/output-archive.h>

#include "plugin/training/checkpoint.h"

namespace amp8 {
namespace {

// amp8's own modules (Fp8Linear, Fp8LayerNorm, Fp8LayerNormLinear, ...): Module::name() is the
// demangled class name.
bool is_amp8_module(const torch::nn::Module& module) { return module.name().rfind("amp8::", 0) == 0; }

// Module::save's layout: the module's own parameters and buffers, then one nested archive per
// serializable child, under the child's name.
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
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::OutputArchive child_archive(archive.compilation_unit());
    write_module(*child.value(), plugin, child_archive);
    archive.write(child.key(), child_archive);
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
