#include "plugin/checkpoint.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <memory>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

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

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "save_atomically: writing ", path, " failed: ", system_error());
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TORCH_CHECK(fd >= 0, "save_atomically: cannot open ", path, " to sync it: ", system_error());
  const int rc = ::fsync(fd);
  const std::string error = rc == 0 ? "" : system_error();
  ::close(fd);
  TORCH_CHECK(rc == 0, "save_atomically: fsync of ", path, " failed: ", error);
}

}  // namespace

void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
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
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "save_atomically: cannot create ", temporary, ": ", system_error());
  try {
    Checksum checksum;
    uint64_t length = 0;
    archive.save_to([&](const void* data, size_t size) -> size_t {
      write_all(fd, data, size, temporary);
      checksum.update(static_cast<const uint8_t*>(data), size);
      length += size;
      return size;
    });
    std::string trailer(kMagic, sizeof(kMagic));
    put_le(trailer, kCheckpointFormatVersion, 4);
    put_le(trailer, length, 8);
    put_le(trailer, checksum.finish(), 8);
    write_all(fd, trailer.data(), trailer.size(), temporary);
    TORCH_CHECK(::fsync(fd) == 0, "save_atomically: fsync of ", temporary, " failed: ", system_error());
    TORCH_CHECK(::close(fd) == 0, "save_atomically: closing ", temporary, " failed: ", system_error());
  } catch (...) {
    ::close(fd);
    std::remove(temporary.c_str());
    throw;
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string message = system_error();
    std::remove(temporary.c_str());
    TORCH_CHECK(false, "save_atomically: cannot rename ", temporary, " to ", path, ": ", message);
  }
  fsync_path(folder.string(), /*directory=*/true);
}

void load_archive(torch::serialize::InputArchive& archive, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    if (fd >= 0) ::close(fd);
    TORCH_CHECK(false, "checkpoint ", path, " does not exist or is not a file");
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
  std::unique_ptr<void, std::function<void(void*)>> unmap(mapped, [size](void* p) { ::munmap(p, size); });
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
  try {
    archive.load_from(
        [bytes, length](uint64_t pos, void* buf, size_t n) -> size_t {
          if (pos >= length) return 0;
          const size_t count = std::min<uint64_t>(n, length - pos);
          std::memcpy(buf, bytes + pos, count);
          return count;
        },
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
