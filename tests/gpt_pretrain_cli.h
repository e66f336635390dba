// gpt_pretrain's entry point run in-process, and its metrics file read back: for the tests of
// the recipe's command line.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "recipes/gpt/cli.h"

namespace amp8::testing {

struct CliRun {
  int code;
  std::string out, err;
};

/// gpt_pretrain_main with `args` (without the program name), its output captured.
inline CliRun gpt_pretrain(std::vector<std::string> args) {
  args.insert(args.begin(), "gpt_pretrain");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int code = recipes::gpt_pretrain_main(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

/// The lines of <dir>/metrics.jsonl, parsed.
inline std::vector<nlohmann::json> metrics(const std::filesystem::path& dir) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

}  // namespace amp8::testing
