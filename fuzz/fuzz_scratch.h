#pragma once
// The files a fuzz target writes its inputs to, and their removal when the fuzzer exits.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace amp8::fuzz {

// /tmp/amp8_fuzz_<name>_<pid><extension>, removed (std::atexit) when this process exits: libFuzzer
// ends a run with exit(), so a finished campaign leaves nothing in /tmp.
inline std::string scratch_file(const std::string& name, const std::string& extension) {
  static std::mutex mutex;
  static std::vector<std::string> files;
  const std::string path = "/tmp/amp8_fuzz_" + name + "_" + std::to_string(::getpid()) + extension;
  const std::lock_guard<std::mutex> lock(mutex);
  if (files.empty()) {
    std::atexit([] {
      for (const auto& file : files) std::remove(file.c_str());
    });
  }
  files.push_back(path);
  return path;
}

}  // namespace amp8::fuzz
