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
  /// Memory-maps `path`. Throws naming the path when it is not a regular file (a FIFO, a
  /// device: checked without opening it), cannot be opened or mapped, or holds fewer than 2
  /// bytes. The file must not change while the dataset lives: batch() throws naming it when its
  /// size or modification time differ from those it had when opened (or when reading the mapping
  /// faults because it was truncated), instead of training on other data or dying of SIGBUS.
  static ByteDataset from_file(const std::string& path);
  /// The built-in corpus (`bytes` long, deterministic).
  static ByteDataset builtin(int64_t bytes = 1 << 20);

  /// (inputs, targets), both int64 [batch, seq] on `device`: windows starting at positions drawn
  /// uniformly from the text, targets shifted by one byte. Throws when the text is shorter than
  /// seq + 1 bytes.
  std::pair<torch::Tensor, torch::Tensor> batch(uint64_t seed, int64_t step, int64_t micro_batch,
                                                int64_t batch_size, int64_t seq,
                                                const torch::Device& device) const;

  /// (head, tail): the text cut where the last `fraction` of it begins, both views of the same
  /// bytes. gpt_pretrain trains on the head and validates on the tail (held-out text).
  std::pair<ByteDataset, ByteDataset> split_tail(double fraction) const;

  /// The data's identity for a resume check: its size and a hash of its first and last MiB
  /// (not its path: a moved file is the same data).
  std::string fingerprint() const;

  int64_t size() const { return size_; }
  const std::string& source() const { return source_; }

 private:
  ByteDataset() = default;
  struct FileIdentity {
    int fd;
    int64_t size, mtime_s, mtime_ns;
  };
  void check_unchanged() const;

  std::shared_ptr<const uint8_t> bytes_;  // mapped file or owned corpus
  std::shared_ptr<const FileIdentity> file_;  // the open file behind a mapping (none: built-in)
  int64_t size_ = 0;
  std::string source_;
};

/// `host` (a CPU tensor), contiguous, on `device`. To a GPU it goes through pinned memory and
/// returns without waiting for the device; the copy is ordered on the device's current stream.
torch::Tensor copy_to_device(const torch::Tensor& host, const torch::Device& device);

}  // namespace amp8::recipes
