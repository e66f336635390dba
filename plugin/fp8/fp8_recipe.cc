#include "plugin/fp8/fp8_recipe.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <ostream>

namespace amp8 {

void Fp8RecipeOptions::validate() const {
  TORCH_CHECK(fp8_ == "hybrid" || fp8_ == "e4m3", "fp8 must be \"hybrid\" or \"e4m3\", got \"",
              fp8_, "\"");
  TORCH_CHECK(fp8_margin_ >= 0 && fp8_margin_ <= 126, "fp8_margin must be in [0, 126], got ",
              fp8_margin_);
  // scale = fp8_max / amax / 2^margin maps the largest value to fp8_max / 2^margin. Below half
  // of E4M3's smallest subnormal (2^-9) even that rounds to zero: every forward input would be
  // zero and the run would learn nothing.
  const double largest = static_cast<double>(fp8_max(Fp8Format::kE4M3)) / std::ldexp(1.0, fp8_margin_);
  TORCH_CHECK(fp8_margin_ <= kMaxFp8Margin, "fp8_margin ", fp8_margin_,
              " would scale every tensor's largest value to 448 / 2^", fp8_margin_, " = ", largest,
              ", below half of E4M3's smallest subnormal (2^-9), so every FP8 forward input would be "
              "zero; use a margin in [0, ", kMaxFp8Margin, "] (NeMo's presets: 0)");
  TORCH_CHECK(fp8_amax_history_len_ >= 1 && fp8_amax_history_len_ <= (1 << 20),
              "fp8_amax_history_len must be in [1, 1048576], got ", fp8_amax_history_len_);
  amax_compute_algo_from_string(fp8_amax_compute_algo_, "fp8_amax_compute_algo");
  TORCH_CHECK(fp8_recipe_ != "mxfp8", "fp8_recipe \"mxfp8\" (MXFP8 block scaling, TE's "
              "MXFP8BlockScaling) needs GPUs with MXFP8 tensor cores: NVIDIA Blackwell (compute "
              "capability 10.0 or later); amp8 trains on Hopper: use \"delayed\", \"tensorwise\" or "
              "\"blockwise\"");
  TORCH_CHECK(fp8_recipe_ == "delayed" || fp8_recipe_ == "tensorwise" || fp8_recipe_ == "blockwise",
              "fp8_recipe must be \"delayed\", \"tensorwise\" or \"blockwise\", got \"", fp8_recipe_,
              "\"");
  // A knob of one recipe under another would be dropped: an error instead.
  const Fp8RecipeOptions defaults;
  TORCH_CHECK(fp8_recipe_ == "delayed" || (fp8_amax_history_len_ == defaults.fp8_amax_history_len() &&
                                           fp8_amax_compute_algo_ == defaults.fp8_amax_compute_algo()),
              "fp8_amax_history_len and fp8_amax_compute_algo apply to fp8_recipe \"delayed\" only; \"",
              fp8_recipe_, "\" scales every tensor by its own amax (got ", fp8_amax_history_len_, " and \"",
              fp8_amax_compute_algo_, "\"; leave them at ", defaults.fp8_amax_history_len(), " and \"",
              defaults.fp8_amax_compute_algo(), "\")");
  TORCH_CHECK(fp8_recipe_ != "blockwise" || fp8_margin_ == 0, "fp8_margin applies to fp8_recipe \"delayed\" and "
              "\"tensorwise\"; \"blockwise\" scales each tile and block by fp8_max / its amax, as a power of two, "
              "without a margin (got ", fp8_margin_, ")");
}

Fp8Recipe Fp8RecipeOptions::resolve() const {
  validate();
  Fp8Recipe recipe;
  recipe.forward_format = Fp8Format::kE4M3;
  recipe.backward_format = fp8_ == "e4m3" ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
  recipe.margin = fp8_margin_;
  recipe.amax_history_len = fp8_amax_history_len_;
  recipe.amax_compute_algo = amax_compute_algo_from_string(fp8_amax_compute_algo_, "fp8_amax_compute_algo");
  recipe.scaling = fp8_recipe_ == "delayed"      ? Fp8Scaling::kDelayed
                   : fp8_recipe_ == "tensorwise" ? Fp8Scaling::kTensorwise
                                                 : Fp8Scaling::kBlockwise;
  return recipe;
}

std::ostream& operator<<(std::ostream& os, const Fp8RecipeOptions& r) {
  return os << "Fp8Recipe(fp8=" << r.fp8() << ", fp8_recipe=" << r.fp8_recipe()
            << ", fp8_margin=" << r.fp8_margin()
            << ", fp8_amax_history_len=" << r.fp8_amax_history_len()
            << ", fp8_amax_compute_algo=" << r.fp8_amax_compute_algo() << ")";
}

}  // namespace amp8
