#pragma once
// FP8 recipes for tests that run every recipe.

#include <string>

#include "plugin/fp8/fp8_recipe.h"

namespace amp8::testing {

/// The recipe `kind`, with a 4-step amax history where it has one (delayed scaling; the other
/// recipes refuse history knobs), so that a test's buffers stay small.
inline Fp8RecipeOptions recipe_of(const std::string& kind) {
  auto recipe = Fp8RecipeOptions().fp8_recipe(kind);
  if (kind == "delayed") recipe.fp8_amax_history_len(4);
  return recipe;
}

}  // namespace amp8::testing
