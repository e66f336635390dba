#pragma once

#include <c10/core/ScalarType.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace amp8::recipes {

/// Megatron-Core's indexed dataset (megatron/core/datasets/indexed_dataset.py, written by
/// `IndexedDatasetBuilder` and tools/preprocess_data.py), read-only: `<prefix>.bin` holds the
/// token ids of every sequence back to back, `<prefix>.idx` says where each sequence starts.
///
/// The .idx layout, little-endian, no padding:
///   magic "MMIDIDX\0\0" (9 bytes), version uint64 (always 1), dtype code uint8 (Megatron's
///   DType: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16),
///   sequence count uint64 (S), document count uint64 (D, the number of entries of the document
///   indices, one more than the number of documents), then int32 sequence_lengths[S] (tokens),
///   int64 sequence_pointers[S] (byte offsets into the .bin), int64 document_indices[D] (the
///   sequence index each document starts at, then the end), and, in multimodal datasets only,
///   int8 sequence_modes[S] (accepted, not read).
///
/// Both files are checked when opened, so reads never leave the .bin: each must be a regular
/// file (stat() first, so a FIFO is refused rather than blocking), the magic, version and dtype
/// code must be Megatron's, the .idx must be exactly as long as its counts say, every sequence
/// must lie inside the .bin, and the document indices must rise from 0 to S. Every failure is a
/// c10::Error naming the file and what was expected.
///
/// The .bin is memory-mapped; the three index arrays are copied into memory (12 bytes per
/// sequence plus 8 per document: they are not aligned in the .idx).
class IndexedDataset {
 public:
  /// Opens `<path_prefix>.idx` and `<path_prefix>.bin`.
  explicit IndexedDataset(const std::string& path_prefix);

  const std::string& path_prefix() const { return path_prefix_; }
  std::string idx_path() const { return path_prefix_ + ".idx"; }
  std::string bin_path() const { return path_prefix_ + ".bin"; }

  /// The token type stored in the .bin (torch::kUInt16 for GPT-2-sized vocabularies, kInt32
  /// past 65536 tokens).
  c10::ScalarType dtype() const { return dtype_; }
  /// Megatron's DType code of `dtype()` (8 for uint16, 4 for int32).
  int dtype_code() const { return dtype_code_; }

  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  /// The number of documents: document_indices().size() - 1.
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }

  /// Tokens per sequence.
  const std::vector<int32_t>& sequence_lengths() const { return sequence_lengths_; }
  /// Byte offset of each sequence in the .bin.
  const std::vector<int64_t>& sequence_pointers() const { return sequence_pointers_; }
  /// Document d holds sequences [document_indices()[d], document_indices()[d + 1]).
  const std::vector<int64_t>& document_indices() const { return document_indices_; }

  /// Megatron's `IndexedDataset.get(sequence_index, offset, length)`: `length` tokens of the
  /// sequence from token `offset` on (length -1: to its end), as an int64 tensor [length].
  /// Throws naming the .bin when the sequence index or the token range is out of bounds.
  torch::Tensor get(int64_t sequence_index, int64_t offset = 0, int64_t length = -1) const;

 private:
  std::string path_prefix_;
  c10::ScalarType dtype_ = c10::ScalarType::Undefined;
  int dtype_code_ = 0;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> sequence_pointers_;
  std::vector<int64_t> document_indices_;
  std::shared_ptr<const uint8_t> bin_bytes_;  // the mapped .bin (null when empty)
  int64_t bin_size_ = 0;
};

}  // namespace amp8::recipes
