#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace amp8::recipes {

/// Byte-level language-model data: every byte is a token (vocabulary 256). The text is either a
/// file, memory-mapped read-only, or a built-in deterministic corpus with real structure (simple
/// English sentences from a small grammar, with agreement and punctuation), so a default run
/// visibly learns. Batches are drawn from (seed, step, micro_batch) alone: a resumed run sees
/// exactly the batches the uninterrupted run would have.
class ByteDataset {
 public:
  /// Memory-maps `path`. Throws naming the path when it cannot be opened or mapped, or when it
  /// holds fewer than 2 bytes.
  static ByteDataset from_file(const std::string& path);
  /// The built-in corpus (`bytes` long, deterministic).
  static ByteDataset builtin(int64_t bytes = 1 << 20);

  /// (inputs, targets), both int64 [batch, seq] on `device`: windows starting at positions drawn
  /// uniformly from the text, targets shifted by one byte. Throws when the text is shorter than
  /// seq + 1 bytes.
  std::pair<torch::Tensor, torch::Tensor> batch(uint64_t seed, int64_t step, int64_t micro_batch,
                                                int64_t batch_size, int64_t seq,
                                                const torch::Device& device) const;

  int64_t size() const { return size_; }
  const std::string& source() const { return source_; }

 private:
  ByteDataset() = default;
  std::shared_ptr<const uint8_t> bytes_;  // mapped file or owned corpus
  int64_t size_ = 0;
  std::string source_;
};

}  // namespace amp8::recipes
