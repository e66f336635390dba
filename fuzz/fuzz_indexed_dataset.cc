// Fuzzes Megatron's indexed-dataset reader (recipes/data/indexed_dataset.cc): any bytes as the
// .idx beside a fixed .bin, then every sequence read whole and in part. What it asserts: a file
// is either refused with c10::Error when opened, or every read it then allows stays inside the
// .bin and returns what the index says. The one read that may still be refused is a sequence of a
// float32/float64 dataset whose .bin bytes are not integral token ids (the reader checks tokens
// when it widens them, so that refusal depends on the .bin, not on the .idx).
#include "recipes/data/indexed_dataset.cc"  // the reader under test, instrumented
#include "recipes/data/mapped_read.cc"  // its SIGBUS guard

#include <cstdint>
#include <fstream>
#include <string>

#include "fuzz_scratch.h"

namespace {

constexpr int64_t kBinBytes = 8192;  // larger than the seeds' .bin files (tests/data/megatron_indexed/)

void write_file(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string idx_path = amp8::fuzz::scratch_file("indexed", ".idx");
  static const std::string bin_path = amp8::fuzz::scratch_file("indexed", ".bin");
  static const std::string prefix = idx_path.substr(0, idx_path.size() - 4);  // the reader opens prefix.idx, prefix.bin
  static const bool bin_written = [] {
    std::string bin(kBinBytes, '\0');
    for (int64_t i = 0; i < kBinBytes; ++i) bin[i] = static_cast<char>(i * 131 % 251);
    write_file(bin_path, bin.data(), bin.size());
    return true;
  }();
  (void)bin_written;
  write_file(idx_path, data, size);
  std::optional<amp8::recipes::IndexedDataset> dataset;
  try {
    dataset.emplace(prefix);
  } catch (const c10::Error&) {
    return 0;  // refused when opened: the expected outcome for almost every input
  }
  const auto& lengths = dataset->sequence_lengths();
  const auto& pointers = dataset->sequence_pointers();
  const int64_t item = static_cast<int64_t>(c10::elementSize(dataset->dtype()));
  // Opening promised every sequence inside the .bin and document indices rising from 0 to S.
  for (int64_t s = 0; s < dataset->num_sequences(); ++s) {
    if (lengths[s] < 0 || pointers[s] < 0 || pointers[s] + lengths[s] * item > kBinBytes) __builtin_trap();
  }
  const auto& documents = dataset->document_indices();
  if (documents.empty() || documents.front() != 0 || documents.back() != dataset->num_sequences()) __builtin_trap();
  const bool float_tokens = c10::isFloatingType(dataset->dtype());
  for (int64_t s = 0; s < std::min<int64_t>(dataset->num_sequences(), 64); ++s) {
    torch::Tensor whole;
    try {
      whole = dataset->get(s);
    } catch (const c10::Error&) {
      if (!float_tokens) __builtin_trap();  // an integer dataset's reads inside the .bin never fail
      continue;
    }
    if (whole.numel() != lengths[s]) __builtin_trap();
    if (lengths[s] >= 2) {
      const auto part = dataset->get(s, 1, lengths[s] - 1);
      if (!part.equal(whole.narrow(0, 1, lengths[s] - 1))) __builtin_trap();
    }
    try {
      dataset->get(s, 0, static_cast<int64_t>(lengths[s]) + 1);  // one token past the end
      __builtin_trap();
    } catch (const c10::Error&) {
    }
  }
  return 0;
}
