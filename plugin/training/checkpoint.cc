#include "plugin/training/checkpoint.h"

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <regex>
#include <unordered_map>
#include <vector>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "plugin/training/files.h"

namespace amp8 {
namespace {

std::string system_error() { return std::strerror(errno); }

constexpr char kMagic[8] = {'A', 'M', 'P', '8', 'C', 'K', 'P', 'T'};
constexpr size_t kTrailerBytes = 8 + 4 + 8 + 8;

// A 64-bit checksum over a byte stream fed in pieces of any size: 8-byte little-endian words
// mixed into the state (multiply, rotate, xor), a length-dependent finish. Not cryptographic;
// catches flipped bits and torn data.
class Checksum {
 public:
  void update(const uint8_t* data, size_t size) {
    length_ += size;
    while (size > 0 && pending_ > 0) {
      word_[pending_++] = *data++;
      --size;
      if (pending_ == 8) {
        mix(load(word_));
        pending_ = 0;
      }
    }
    for (; size >= 8; data += 8, size -= 8) mix(load(data));
    while (size-- > 0) word_[pending_++] = *data++;
  }
  uint64_t finish() const {
    uint64_t tail = 0;
    for (size_t i = 0; i < pending_; ++i) tail |= static_cast<uint64_t>(word_[i]) << (8 * i);
    uint64_t h = state_ ^ (tail * 0x9E3779B97F4A7C15ULL) ^ (length_ * 0xC2B2AE3D27D4EB4FULL);
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 33);
  }

 private:
  static uint64_t load(const uint8_t* p) {
    uint64_t w = 0;
    for (int i = 0; i < 8; ++i) w |= static_cast<uint64_t>(p[i]) << (8 * i);
    return w;
  }
  void mix(uint64_t w) {
    state_ ^= w * 0x87C37B91114253D5ULL;
    state_ = ((state_ << 31) | (state_ >> 33)) * 0x4CF5AD432745937FULL + 0x52DCE729;
  }
  uint64_t state_ = 0x1234567890ABCDEFULL, length_ = 0;
  uint8_t word_[8] = {};
  size_t pending_ = 0;
};

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(p[i]) << (8 * i);
  return value;
}

std::string make_trailer(uint64_t length, uint64_t checksum) {
  std::string trailer(kMagic, sizeof(kMagic));
  put_le(trailer, kCheckpointFormatVersion, 4);
  put_le(trailer, length, 8);
  put_le(trailer, checksum, 8);
  return trailer;
}

// Writes all of `data`; returns "" or the system error.
std::string write_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n == 0 ? std::string("write returned 0") : system_error();
    p += n;
    size -= static_cast<size_t>(n);
  }
  return "";
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TORCH_CHECK(fd >= 0, "save_atomically: cannot open ", path, " to sync it: ", system_error());
  const int rc = ::fsync(fd);
  const std::string error = rc == 0 ? "" : system_error();
  ::close(fd);
  TORCH_CHECK(rc == 0, "save_atomically: fsync of ", path, " failed: ", error);
}

// The archive's bytes in memory, as LibTorch's zip reader reads them.
class MemoryReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  MemoryReadAdapter(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    const size_t count = std::min<uint64_t>(n, size_ - pos);
    std::memcpy(buf, data_ + pos, count);
    return count;
  }

 private:
  const uint8_t* data_;
  size_t size_;
};

}  // namespace

std::string checkpoint_trailer(const void* archive, size_t length) {
  Checksum checksum;
  checksum.update(static_cast<const uint8_t*>(archive), length);
  return make_trailer(length, checksum.finish());
}

namespace {

// Bytes per element of the storage classes LibTorch pickles (torch.<Name>); 0 if unknown.
int64_t storage_element_size(const std::string& name) {
  static const std::pair<const char*, int64_t> kSizes[] = {
      {"DoubleStorage", 8},   {"FloatStorage", 4},          {"HalfStorage", 2},
      {"BFloat16Storage", 2}, {"LongStorage", 8},           {"IntStorage", 4},
      {"ShortStorage", 2},    {"CharStorage", 1},           {"ByteStorage", 1},
      {"BoolStorage", 1},     {"Float8_e4m3fnStorage", 1},  {"Float8_e5m2Storage", 1},
      {"ComplexFloatStorage", 8}, {"ComplexDoubleStorage", 16}};
  for (const auto& [type, bytes] : kSizes) {
    if (name == type) return bytes;
  }
  return 0;
}

}  // namespace

void check_pickle_bounds(const uint8_t* data, size_t size, const std::string& what,
                         const std::function<int64_t(const std::string& key)>& storage_record_bytes) {
  size_t pos = 0, at = 0, memo_entries = 0;  // at: the current opcode's offset
  // What the top of the unpickler's stack is, as far as the storage check cares: a string or a
  // GLOBAL (LibTorch's pickler memoizes both and repeats them with BINGET: after the first
  // tensor, "storage", "torch\nFloatStorage" and "cpu" come from the memo), or anything else.
  struct Value {
    enum Kind { kOther, kString, kGlobal } kind = kOther;
    std::string text;  // the string, or the GLOBAL's module + '\n' + name (at most 256 bytes each)
  };
  Value top;
  std::unordered_map<uint64_t, Value> memo;  // memo id -> a string or GLOBAL stored there
  // The persistent id being read: from its "storage" string to BINPERSID ('Q').
  struct StorageId {
    bool open = false;
    std::string type;
    std::vector<std::string> strings;  // key, location
    std::optional<int64_t> numel;
  } storage;
  auto string_at = [&](size_t begin, size_t length) {
    return std::string(reinterpret_cast<const char*>(data + begin), std::min<size_t>(length, 256));
  };
  auto on_value = [&](const Value& value) {  // a string or GLOBAL pushed, read or from the memo
    top = value;
    if (value.kind == Value::kString) {
      if (value.text == "storage") {
        storage = StorageId();
        storage.open = true;
      } else if (storage.open) {
        storage.strings.push_back(value.text);
      }
    } else if (value.kind == Value::kGlobal && storage.open && value.text.rfind("torch\n", 0) == 0) {
      storage.type = value.text.substr(6);
    }
  };
  auto on_int = [&](int64_t value) {
    if (storage.open) storage.numel = value;
  };
  auto on_persistent_id = [&] {
    const bool complete = storage.open && storage.strings.size() == 2 && storage.numel.has_value();
    const int64_t element = complete ? storage_element_size(storage.type) : 0;
    if (storage_record_bytes && element > 0) {
      const std::string& key = storage.strings[0];
      const int64_t numel = *storage.numel;
      const int64_t record = storage_record_bytes(key);
      TORCH_CHECK(numel >= 0 && numel <= (int64_t{1} << 50) / element, what, ": storage ", key,
                  " has ", numel, " elements");
      TORCH_CHECK(numel == 0 || (record >= 0 && numel * element <= record), what, ": storage ", key,
                  " (", storage.type, ") claims ", numel, " elements = ", numel * element,
                  " bytes, but its record ", record < 0 ? std::string("is missing")
                  : "holds " + std::to_string(record) + " bytes");
    }
    storage = StorageId();
  };
  auto need = [&](size_t n, const char* opcode) {
    TORCH_CHECK(n <= size - pos, what, ": ", opcode, " at byte ", at, " needs ", n,
                " more bytes, the pickle ends after ", size - pos);
  };
  // A length-prefixed operand: returns where its bytes begin (they end at pos).
  auto skip_counted = [&](int count_bytes, const char* opcode) {
    need(count_bytes, opcode);
    const uint64_t n = get_le(data + pos, count_bytes);
    pos += count_bytes;
    need(n, opcode);
    const size_t begin = pos;
    pos += n;
    return begin;
  };
  auto put = [&](int id_bytes, const char* opcode) {
    need(id_bytes, opcode);
    const uint64_t id = get_le(data + pos, id_bytes);
    TORCH_CHECK(id <= memo_entries, what, ": ", opcode, " at byte ", at, " stores memo id ",
                id, ", but only ", memo_entries, " memo entries precede it (a pickler numbers "
                "them 0, 1, 2, ...; LibTorch would allocate ", id + 1, " entries)");
    if (id == memo_entries) ++memo_entries;
    if (top.kind == Value::kOther) memo.erase(id);
    else memo[id] = top;
    pos += id_bytes;
  };
  auto get = [&](int id_bytes, const char* opcode) {
    need(id_bytes, opcode);
    const auto found = memo.find(get_le(data + pos, id_bytes));
    pos += id_bytes;
    if (found != memo.end()) on_value(found->second);
    else top = Value();
  };
  while (pos < size) {
    at = pos++;
    const uint8_t opcode = data[at];
    switch (opcode) {
      case '.':  // STOP
        return;
      case 'q': put(1, "BINPUT"); break;
      case 'r': put(4, "LONG_BINPUT"); break;
      case 'h': get(1, "BINGET"); break;
      case 'j': get(4, "LONG_BINGET"); break;
      case 'K':  // BININT1
        need(1, "BININT1");
        on_int(data[pos]);
        pos += 1;
        break;
      case 0x80:  // PROTO
        need(1, "PROTO");
        pos += 1;
        break;
      case 'M':  // BININT2
        need(2, "BININT2");
        on_int(static_cast<int64_t>(get_le(data + pos, 2)));
        pos += 2;
        break;
      case 'J':  // BININT
        need(4, "BININT");
        on_int(static_cast<int32_t>(get_le(data + pos, 4)));
        pos += 4;
        break;
      case 'G':  // BINFLOAT
        need(8, "BINFLOAT");
        pos += 8;
        break;
      case 0x8a: {  // LONG1: a little-endian two's-complement integer of n bytes
        const size_t begin = skip_counted(1, "LONG1");
        if (pos - begin == 8) on_int(static_cast<int64_t>(get_le(data + begin, 8)));
        else storage.open = false;  // not LibTorch's form: leave this id to LibTorch
        break;
      }
      case 'X':     // BINUNICODE
      case 0x8c:    // SHORT_BINUNICODE
      case 0x8d: {  // BINUNICODE8
        const int count = opcode == 'X' ? 4 : opcode == 0x8c ? 1 : 8;
        const size_t begin = skip_counted(count, opcode == 'X' ? "BINUNICODE" : opcode == 0x8c ? "SHORT_BINUNICODE" : "BINUNICODE8");
        on_value({Value::kString, string_at(begin, pos - begin)});
        break;
      }
      case 'C': skip_counted(1, "SHORT_BINBYTES"); break;
      case 'B': skip_counted(4, "BINBYTES"); break;
      case 0x8e: skip_counted(8, "BINBYTES8"); break;
      case 0x96: skip_counted(8, "BYTEARRAY8"); break;
      case 'c': {  // GLOBAL: module and name, each ended by a newline
        std::string lines[2];
        for (auto& line : lines) {
          const auto* end = static_cast<const uint8_t*>(std::memchr(data + pos, '\n', size - pos));
          TORCH_CHECK(end != nullptr, what, ": GLOBAL at byte ", at, " is not ended by a newline");
          line = string_at(pos, static_cast<size_t>(end - data) - pos);
          pos = static_cast<size_t>(end - data) + 1;
        }
        on_value({Value::kGlobal, lines[0] + "\n" + lines[1]});
        break;
      }
      case 'Q':  // BINPERSID
        on_persistent_id();
        break;
      case '(': case ']': case ')': case '}': case 'N': case 't': case 'a': case 'e': case 'l':
      case 'd': case 's': case 'u': case 'b': case 'R': case '0': case '1': case '2':
      case 0x81: case 0x85: case 0x86: case 0x87: case 0x88: case 0x89:
        break;  // no operand
      default:
        return;  // an opcode this walk does not know: LibTorch's unpickler names it
    }
    // What this opcode left on top of the stack, unless it pushed a string or GLOBAL (or is a
    // PUT, which leaves the stack as it was).
    const bool keeps_top = opcode == 'q' || opcode == 'r' || opcode == 'h' || opcode == 'j' ||
                           opcode == 'X' || opcode == 0x8c || opcode == 0x8d || opcode == 'c' ||
                           opcode == 0x80;
    if (!keeps_top) top = Value();
  }
}

void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path, bool trailer) {
  namespace fs = std::filesystem;
  TORCH_CHECK(!path.empty(), "save_atomically: path must not be empty");
  const fs::path target(path);
  const fs::path folder = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code error;
  TORCH_CHECK(fs::is_directory(folder, error), "save_atomically: folder ", folder.string(),
              " of ", path, " does not exist or is not a folder");
  TORCH_CHECK(!fs::is_directory(target, error), "save_atomically: ", path,
              " is a folder, expected a file path");
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  // Marked as being written until it is in place: remove_stale_temporaries leaves it be.
  FileBeingWritten file = [&] {
    try {
      return FileBeingWritten(temporary);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "save_atomically: ", e.what_without_backtrace());
    }
  }();
  const int fd = file.fd();
  // LibTorch's zip writer calls this writer from inside miniz: an exception thrown through it
  // aborts the process (a full disk once ended in std::terminate). The first failure is kept,
  // the rest of the archive is only counted (so the message can say how much was needed), and
  // the error is thrown once save_to has returned.
  std::string write_error;
  uint64_t length = 0, written = 0;
  Checksum checksum;
  archive.save_to([&](const void* data, size_t size) -> size_t {
    if (write_error.empty()) {
      write_error = write_all(fd, data, size);
      if (write_error.empty()) written += size;
    }
    checksum.update(static_cast<const uint8_t*>(data), size);
    length += size;
    return size;
  });
  const std::string tail = trailer ? make_trailer(length, checksum.finish()) : std::string();
  if (write_error.empty() && !tail.empty()) write_error = write_all(fd, tail.data(), tail.size());
  if (write_error.empty() && ::fsync(fd) != 0) write_error = "fsync failed: " + system_error();
  if (!write_error.empty()) {
    std::remove(temporary.c_str());
    const auto space = fs::space(folder, error);
    TORCH_CHECK(false, "save_atomically: writing ", path, " failed (", write_error, "): the checkpoint needs ",
                length + tail.size(), " bytes, ", written, " were written before the failure",
                error ? std::string() : ", the folder " + folder.string() + " has " +
                                            std::to_string(space.available) + " bytes free",
                "; the temporary file was removed and ", path, " is unchanged");
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string message = system_error();
    std::remove(temporary.c_str());
    TORCH_CHECK(false, "save_atomically: cannot rename ", temporary, " to ", path, ": ", message);
  }
  // Closed after the rename (the mark holds until the file is in place) and after the fsync,
  // which has written every byte: a failure here is still reported.
  const std::string closed = file.close();
  TORCH_CHECK(closed.empty(), "save_atomically: closing ", path, " after it was written, synced and renamed "
              "into place failed (", closed, "); its trailer's checksum tells on load whether it is whole");
  fsync_path(folder.string(), /*directory=*/true);
}

std::vector<std::string> remove_stale_temporaries(const std::string& folder) {
  namespace fs = std::filesystem;
  static const std::regex pattern(R"(.+\.tmp\.\d+)");
  std::vector<std::string> removed;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(folder, error)) {
    std::smatch match;
    const auto name = entry.path().filename().string();
    if (!entry.is_regular_file(error) || !std::regex_match(name, match, pattern)) continue;
    if (remove_unless_being_written(entry.path().string())) removed.push_back(entry.path().string());
  }
  return removed;
}

namespace {

// A checkpoint file mapped read-only, its trailer and checksum checked.
struct VerifiedCheckpoint {
  std::unique_ptr<void, std::function<void(void*)>> mapping;
  const uint8_t* bytes = nullptr;
  size_t length = 0;  // of the archive, without the trailer
};

VerifiedCheckpoint map_and_verify(const std::string& path) {
  const auto problem = regular_file_problem(path, "checkpoint");
  TORCH_CHECK(problem.empty(), problem);
  struct stat st {};
  // O_NONBLOCK: a FIFO swapped in after the stat must not block the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    if (fd >= 0) ::close(fd);
    TORCH_CHECK(false, "checkpoint ", path, " does not exist or is not a regular file");
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size < kTrailerBytes) {
    ::close(fd);
    TORCH_CHECK(false, "checkpoint ", path, " is not an amp8 checkpoint (", size,
                " bytes, shorter than its trailer)");
  }
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  TORCH_CHECK(mapped != MAP_FAILED, "checkpoint ", path, " cannot be mapped: ", system_error());
  VerifiedCheckpoint file;
  file.mapping = std::unique_ptr<void, std::function<void(void*)>>(mapped, [size](void* p) { ::munmap(p, size); });
  const auto* bytes = static_cast<const uint8_t*>(mapped);
  const uint8_t* trailer = bytes + size - kTrailerBytes;
  TORCH_CHECK(std::memcmp(trailer, kMagic, sizeof(kMagic)) == 0, "checkpoint ", path,
              " is not an amp8 checkpoint or is truncated (no AMP8CKPT trailer at its end)");
  const auto version = static_cast<uint32_t>(get_le(trailer + 8, 4));
  const uint64_t length = get_le(trailer + 12, 8), stored = get_le(trailer + 20, 8);
  TORCH_CHECK(version == kCheckpointFormatVersion, "checkpoint ", path, " has format version ",
              version, ", this amp8 reads version ", kCheckpointFormatVersion);
  TORCH_CHECK(length == size - kTrailerBytes, "checkpoint ", path, " is truncated or padded: the "
              "trailer records ", length, " bytes of archive, the file holds ", size - kTrailerBytes);
  Checksum checksum;
  checksum.update(bytes, length);
  TORCH_CHECK(checksum.finish() == stored, "checkpoint ", path,
              " is corrupt: checksum mismatch (the file's bytes changed after it was written)");
  file.bytes = bytes;
  file.length = length;
  return file;
}

}  // namespace

std::string checkpoint_file_problem(const std::string& path) {
  try {
    map_and_verify(path);
    return "";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

void load_archive(torch::serialize::InputArchive& archive, const std::string& path) {
  const auto file = map_and_verify(path);
  const uint8_t* bytes = file.bytes;
  const size_t length = file.length;
  try {
    auto adapter = std::make_shared<MemoryReadAdapter>(bytes, length);
    {
      caffe2::serialize::PyTorchStreamReader reader(adapter);
      for (const auto& name : reader.getAllRecords()) {
        // LibTorch allocates a record's declared (uncompressed) size before reading it; no
        // record of an archive it wrote is larger than the whole archive (tensors are stored
        // uncompressed, and the deflated code records are a few hundred bytes).
        const size_t declared = reader.getRecordSize(name);
        TORCH_CHECK(declared <= length, "record ", name, " declares ", declared,
                    " bytes, more than the whole archive (", length, " bytes)");
        if (name.size() < 3 || name.compare(name.size() - 3, 3, "pkl") != 0) continue;
        const auto [record, record_size] = reader.getRecord(name);
        // LibTorch reads the storages of data.pkl from data/<key>, those of constants.pkl from
        // constants/<key>.
        const std::string folder = name == "constants.pkl" ? "constants/" : "data/";
        check_pickle_bounds(static_cast<const uint8_t*>(record.get()), record_size, "record " + name,
                            [&reader, &folder](const std::string& key) -> int64_t {
                              const std::string record_name = folder + key;
                              if (!reader.hasRecord(record_name)) return -1;
                              return static_cast<int64_t>(reader.getRecordSize(record_name));
                            });
      }
    }
    archive.load_from(
        [adapter](uint64_t pos, void* buf, size_t n) -> size_t { return adapter->read(pos, buf, n, ""); },
        [length]() -> size_t { return length; });
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint ", path, " is not a readable archive: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    // LibTorch's archive reader also throws std::runtime_error (found by fuzz_checkpoint_load:
    // a valid trailer around a mutated archive); callers expect a c10::Error naming the file.
    TORCH_CHECK(false, "checkpoint ", path, " is not a readable archive: ", e.what());
  }
}

}  // namespace amp8
