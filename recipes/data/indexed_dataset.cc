#include "recipes/data/indexed_dataset.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <string_view>
#include <vector>

#include "recipes/data/mapped_read.h"

namespace amp8::recipes {
namespace {

static_assert(std::endian::native == std::endian::little,
              "Megatron's .idx/.bin files are little-endian; a big-endian reader must swap bytes");

constexpr std::string_view kIndexMagic("MMIDIDX\0\0", 9);
constexpr uint64_t kIndexVersion = 1;
// magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
constexpr int64_t kIndexHeaderBytes = 34;

struct MappedFile {
  std::shared_ptr<const uint8_t> bytes;  // null when the file is empty
  int64_t size = 0;
};

// stat() before open(), and fstat() after it, so a FIFO (or a file swapped for one in between)
// is refused instead of blocking the reader.
MappedFile map_regular_file(const std::string& path, const char* expected) {
  struct stat status {};
  TORCH_CHECK(::stat(path.c_str(), &status) == 0, "cannot open ", path, " (", std::strerror(errno),
              "): expected ", expected);
  TORCH_CHECK(S_ISREG(status.st_mode), path,
              " is not a regular file (a FIFO, device or directory): expected ", expected);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open ", path, " (", std::strerror(errno), "): expected ", expected);
  if (::fstat(fd, &status) != 0 || !S_ISREG(status.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, path, " is not a regular file: expected ", expected);
  }
  MappedFile file;
  file.size = static_cast<int64_t>(status.st_size);
  if (file.size > 0) {
    void* address = ::mmap(nullptr, static_cast<size_t>(file.size), PROT_READ, MAP_PRIVATE, fd, 0);
    const int mmap_errno = errno;
    ::close(fd);
    TORCH_CHECK(address != MAP_FAILED, "cannot memory-map ", path, " (", std::strerror(mmap_errno),
                "): expected ", expected);
    const auto length = static_cast<size_t>(file.size);
    file.bytes = std::shared_ptr<const uint8_t>(
        static_cast<const uint8_t*>(address),
        [length](const uint8_t* mapped) { ::munmap(const_cast<uint8_t*>(mapped), length); });
  } else {
    ::close(fd);
  }
  return file;
}

template <typename T>
T read_little_endian(const uint8_t* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(T));
  return value;
}

template <typename T>
std::vector<T> read_array(const uint8_t* bytes, int64_t count) {
  std::vector<T> values(static_cast<size_t>(count));
  if (count > 0) std::memcpy(values.data(), bytes, sizeof(T) * static_cast<size_t>(count));
  return values;
}

// Megatron's DType enum (indexed_dataset.py).
c10::ScalarType scalar_type_from_dtype_code(int code, const std::string& idx_path) {
  switch (code) {
    case 1:
      return c10::ScalarType::Byte;
    case 2:
      return c10::ScalarType::Char;
    case 3:
      return c10::ScalarType::Short;
    case 4:
      return c10::ScalarType::Int;
    case 5:
      return c10::ScalarType::Long;
    case 6:
      return c10::ScalarType::Double;
    case 7:
      return c10::ScalarType::Float;
    case 8:
      return c10::ScalarType::UInt16;
    default:
      break;
  }
  TORCH_CHECK(false, idx_path,
              ": expected a dtype code from 1 to 8 (uint8, int8, int16, int32, int64, float64, "
              "float32, uint16), got ",
              code);
}

template <typename Token>
void widen_tokens(const uint8_t* bytes, int64_t count, int64_t* out, const std::string& bin_path) {
  for (int64_t i = 0; i < count; ++i) {
    const Token token = read_little_endian<Token>(bytes + i * static_cast<int64_t>(sizeof(Token)));
    if constexpr (std::is_floating_point_v<Token>) {
      TORCH_CHECK(std::isfinite(token) && token == std::trunc(token) &&
                      std::fabs(static_cast<double>(token)) < 9.2e18,
                  bin_path, ": expected integral token ids, got ", token);
    }
    out[i] = static_cast<int64_t>(token);
  }
}

}  // namespace

IndexedDataset::IndexedDataset(const std::string& path_prefix) : path_prefix_(path_prefix) {
  const std::string idx = idx_path();
  const std::string bin = bin_path();

  // First, the .idx header.
  const MappedFile index = map_regular_file(idx, "the .idx of a Megatron indexed dataset");
  TORCH_CHECK(index.size >= kIndexHeaderBytes, idx, ": expected at least the ", kIndexHeaderBytes,
              "-byte header of a Megatron indexed dataset, got ", index.size, " bytes");
  const uint8_t* header = index.bytes.get();
  TORCH_CHECK(
      std::string_view(reinterpret_cast<const char*>(header), kIndexMagic.size()) == kIndexMagic,
      idx, R"(: expected the magic "MMIDIDX\x00\x00" of a Megatron indexed dataset)");
  const auto version = read_little_endian<uint64_t>(header + 9);
  TORCH_CHECK(version == kIndexVersion, idx, ": expected version ", kIndexVersion, ", got ",
              version);
  dtype_code_ = header[17];
  dtype_ = scalar_type_from_dtype_code(dtype_code_, idx);
  const auto sequence_count = read_little_endian<uint64_t>(header + 18);
  const auto document_count = read_little_endian<uint64_t>(header + 26);

  // Next, the counts against the file size (each count is bounded first, so nothing overflows).
  const auto file_size = static_cast<uint64_t>(index.size);
  TORCH_CHECK(sequence_count <= file_size && document_count <= file_size, idx,
              ": the header claims ", sequence_count, " sequences and ", document_count,
              " document indices, which cannot fit in its ", index.size, " bytes");
  const uint64_t expected_size = kIndexHeaderBytes +
                                 sequence_count * (sizeof(int32_t) + sizeof(int64_t)) +
                                 document_count * sizeof(int64_t);
  TORCH_CHECK(file_size == expected_size || file_size == expected_size + sequence_count, idx,
              ": expected ", expected_size, " bytes for ", sequence_count, " sequences and ",
              document_count, " document indices (or ", expected_size + sequence_count,
              " with multimodal sequence modes), got ", index.size);
  TORCH_CHECK(document_count >= 1, idx,
              ": expected at least one document index (the leading 0), got none");

  const auto num_sequences = static_cast<int64_t>(sequence_count);
  const uint8_t* lengths = header + kIndexHeaderBytes;
  const uint8_t* pointers = lengths + num_sequences * sizeof(int32_t);
  const uint8_t* documents = pointers + num_sequences * sizeof(int64_t);
  sequence_lengths_ = read_array<int32_t>(lengths, num_sequences);
  sequence_pointers_ = read_array<int64_t>(pointers, num_sequences);
  document_indices_ = read_array<int64_t>(documents, static_cast<int64_t>(document_count));

  // Finally, every sequence must lie inside the .bin, and documents must partition sequences.
  const MappedFile data = map_regular_file(bin, "the .bin of a Megatron indexed dataset");
  bin_bytes_ = data.bytes;
  bin_size_ = data.size;
  const int64_t token_bytes = static_cast<int64_t>(c10::elementSize(dtype_));
  for (int64_t sequence = 0; sequence < num_sequences; ++sequence) {
    const int64_t length = sequence_lengths_[sequence];
    const int64_t pointer = sequence_pointers_[sequence];
    TORCH_CHECK(length >= 0 && pointer >= 0 && pointer <= bin_size_ &&
                    length * token_bytes <= bin_size_ - pointer,
                bin, ": expected sequence ", sequence, " (", length, " tokens at byte ", pointer,
                ", per ", idx, ") to lie inside the .bin's ", bin_size_, " bytes");
  }
  TORCH_CHECK(document_indices_.front() == 0, idx,
              ": expected the document indices to start at 0, got ", document_indices_.front());
  for (size_t document = 1; document < document_indices_.size(); ++document) {
    TORCH_CHECK(document_indices_[document - 1] <= document_indices_[document] &&
                    document_indices_[document] <= num_sequences,
                idx, ": expected non-decreasing document indices within [0, ", num_sequences,
                "], got ", document_indices_[document], " after ", document_indices_[document - 1]);
  }
  TORCH_CHECK(document_indices_.back() == num_sequences, idx,
              ": expected the document indices to end at the sequence count ", num_sequences,
              ", got ", document_indices_.back());
}

torch::Tensor IndexedDataset::get(int64_t sequence_index, int64_t offset, int64_t length) const {
  const std::string bin = bin_path();
  TORCH_CHECK(sequence_index >= 0 && sequence_index < num_sequences(), bin,
              ": expected a sequence index in [0, ", num_sequences(), "), got ", sequence_index);
  const int64_t sequence_length = sequence_lengths_[sequence_index];
  TORCH_CHECK(offset >= 0 && offset <= sequence_length, bin, ": expected an offset in [0, ",
              sequence_length, "] for sequence ", sequence_index, ", got ", offset);
  if (length < 0) length = sequence_length - offset;
  TORCH_CHECK(length <= sequence_length - offset, bin, ": expected at most ",
              sequence_length - offset, " tokens from offset ", offset, " of sequence ",
              sequence_index, " (", sequence_length, " tokens), got ", length);

  torch::Tensor tokens = torch::empty({length}, torch::kLong);
  if (length == 0) return tokens;
  const int64_t token_bytes = static_cast<int64_t>(c10::elementSize(dtype_));
  // Copied out of the mapping under a SIGBUS guard first: a .bin truncated under the running
  // job (preprocess_data.py writing the prefix again) faults instead of reading.
  std::vector<uint8_t> raw(static_cast<size_t>(length * token_bytes));
  const uint8_t* mapped = bin_bytes_.get() + sequence_pointers_[sequence_index] + offset * token_bytes;
  TORCH_CHECK(detail::copy_mapped([&] { std::memcpy(raw.data(), mapped, raw.size()); }), bin,
              " could not be read (a bus error on its mapping: it was truncated or its storage failed "
              "while training); the run stops here");
  const uint8_t* first = raw.data();
  int64_t* out = tokens.data_ptr<int64_t>();
  switch (dtype_) {
    case c10::ScalarType::Byte:
      widen_tokens<uint8_t>(first, length, out, bin);
      break;
    case c10::ScalarType::Char:
      widen_tokens<int8_t>(first, length, out, bin);
      break;
    case c10::ScalarType::Short:
      widen_tokens<int16_t>(first, length, out, bin);
      break;
    case c10::ScalarType::Int:
      widen_tokens<int32_t>(first, length, out, bin);
      break;
    case c10::ScalarType::Long:
      widen_tokens<int64_t>(first, length, out, bin);
      break;
    case c10::ScalarType::Double:
      widen_tokens<double>(first, length, out, bin);
      break;
    case c10::ScalarType::Float:
      widen_tokens<float>(first, length, out, bin);
      break;
    case c10::ScalarType::UInt16:
      widen_tokens<uint16_t>(first, length, out, bin);
      break;
    default:
      TORCH_CHECK(false, bin, ": unsupported token type ", dtype_);
  }
  return tokens;
}

}  // namespace amp8::recipes
