#include "plugin/training/files.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

namespace amp8 {
namespace {

const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

}  // namespace

std::string regular_file_problem(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return what + " " + path + (errno == ENOENT ? " does not exist" : " cannot be read: " + std::string(std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return what + " " + path + " is " + file_type_name(st.st_mode) + ", not a regular file";
  return "";
}

FolderLock::FolderLock(const std::string& folder) : folder_(folder) {
  std::error_code error;
  std::filesystem::create_directories(folder, error);
  TORCH_CHECK(std::filesystem::is_directory(folder), "folder ", folder, " cannot be created",
              error ? ": " + error.message() : std::string());
  const std::string path = (std::filesystem::path(folder) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot create the lock file ", path, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int lock_error = errno;
    char holder[32] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof(holder) - 1, 0);
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(lock_error != EWOULDBLOCK, "folder ", folder, " is in use by another run (process ",
                n > 0 ? std::string(holder, static_cast<size_t>(n)) : std::string("unknown"),
                " holds ", path, "); wait for it to finish or use another folder");
    TORCH_CHECK(false, "cannot lock ", path, ": ", std::strerror(lock_error));
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    // The pid is only for the message of a refused run; the lock itself holds.
  }
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

FolderLock::FolderLock(FolderLock&& other) noexcept
    : folder_(std::move(other.folder_)), fd_(std::exchange(other.fd_, -1)) {}

FolderLock& FolderLock::operator=(FolderLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    folder_ = std::move(other.folder_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

FileInUse::FileInUse(const std::string& path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TORCH_CHECK(fd_ >= 0, "cannot open ", path, " to mark it in use: ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int lock_error = errno;
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(false, "cannot mark ", path, " in use: ",
                lock_error == EWOULDBLOCK ? std::string("another writer holds it") : std::strerror(lock_error));
  }
}

FileInUse::~FileInUse() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

bool file_in_use(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  // A lock of its own on another open file description: it conflicts with every FileInUse,
  // this process's too.
  const bool in_use = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // and releases the lock it may have taken
  return in_use;
}

}  // namespace amp8
