// Fuzzes the --data loader: any bytes as a text file, then batches of every shape it accepts.
#include "recipes/gpt/data.cc"  // the loader under test, instrumented
#include "recipes/data/mapped_read.cc"  // its SIGBUS guard

#include <cstdint>
#include <fstream>
#include <string>

#include "fuzz_scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = amp8::fuzz::scratch_file("text", ".txt");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const auto dataset = amp8::recipes::ByteDataset::from_file(path);
    if (dataset.size() != static_cast<int64_t>(size)) __builtin_trap();
    for (int64_t seq : {int64_t{1}, dataset.size() - 1, dataset.size(), int64_t{7}}) {
      try {
        auto [inputs, targets] = dataset.batch(size, 3, 1, 2, seq, torch::kCPU);
        // targets are the inputs shifted by one byte, all tokens in [0, 256)
        if (!inputs.narrow(1, 1, seq - 1).equal(targets.narrow(1, 0, seq - 1))) __builtin_trap();
        if (inputs.min().item<int64_t>() < 0 || inputs.max().item<int64_t>() > 255) __builtin_trap();
      } catch (const c10::Error&) {
        if (seq <= dataset.size() - 1) __builtin_trap();  // only a too-long seq may be refused
      }
    }
  } catch (const c10::Error&) {
    if (size >= 2) __builtin_trap();  // from_file refuses only files under 2 bytes
  }
  return 0;
}
