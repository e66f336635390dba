#pragma once

#include <iosfwd>

namespace amp8::recipes {

/// The gpt_pretrain command line (recipes/gpt_pretrain.cc is `return gpt_pretrain_main(...)`):
/// parses the flags with CLI11, runs the recipe, prints errors to `err`. Returns the process
/// exit code: 0 on success, non-zero for bad flags or a failed run (nothing is written when a
/// setting is rejected).
int gpt_pretrain_main(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace amp8::recipes
