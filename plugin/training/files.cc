#include "plugin/training/files.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
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

namespace {

// Whether the descriptor and the path name the same file.
bool same_file(int fd, const std::string& path) {
  struct stat by_fd {}, by_path {};
  return ::fstat(fd, &by_fd) == 0 && ::stat(path.c_str(), &by_path) == 0 && by_fd.st_dev == by_path.st_dev &&
         by_fd.st_ino == by_path.st_ino;
}

}  // namespace

FileBeingWritten::FileBeingWritten(const std::string& path) : path_(path) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(fd_ >= 0, "cannot create ", path, ": ", std::strerror(errno));
    // Blocking: a remover's check holds its lock only for a moment.
    int locked;
    do {
      locked = ::flock(fd_, LOCK_EX);
    } while (locked != 0 && errno == EINTR);
    if (locked != 0) {
      const int lock_error = errno;
      ::close(fd_);
      fd_ = -1;
      std::remove(path.c_str());
      TORCH_CHECK(false, "cannot mark ", path, " as being written: ", std::strerror(lock_error));
    }
    if (same_file(fd_, path)) return;
    ::close(fd_);  // removed as a leftover before the mark: made again
    fd_ = -1;
  }
  TORCH_CHECK(false, "cannot create ", path, ": it was removed 100 times before it could be marked");
}

FileBeingWritten::~FileBeingWritten() {
  if (fd_ >= 0) ::close(fd_);
}

std::string FileBeingWritten::close() {
  if (fd_ < 0) return "";
  const int closed = ::close(std::exchange(fd_, -1));
  return closed == 0 ? "" : std::strerror(errno);
}

bool remove_unless_being_written(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  // A shared lock conflicts with the writer's exclusive one (this process's too, but on NFS).
  const bool removed = ::flock(fd, LOCK_SH | LOCK_NB) == 0 && same_file(fd, path) && ::unlink(path.c_str()) == 0;
  ::close(fd);  // and its lock
  return removed;
}

}  // namespace amp8
