// recipes:gpt_pretrain — GPT pretraining in C++ with amp8. `--help` lists every flag.
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "recipes/gpt/cli.h"

int main(int argc, char** argv) {
  // Under `bazel run`, relative paths (--data, --save-dir) mean the caller's folder.
  if (const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY")) {
    if (::chdir(cwd) != 0) std::cerr << "gpt_pretrain: cannot enter " << cwd << std::endl;
  }
  return amp8::recipes::gpt_pretrain_main(argc, argv, std::cout, std::cerr);
}
