#pragma once

#include <string>

namespace amp8 {

/// "" when `path` is a regular file (following links); otherwise why not, starting with
/// `<what> <path>`: "does not exist", "is a FIFO, not a regular file", ... Looks with stat(),
/// never open(), so a FIFO or a device cannot block or be read by the check.
std::string regular_file_problem(const std::string& path, const std::string& what);

/// A folder held by one process at a time (an advisory lock on `<folder>/.lock`, flock(2), which
/// also works across the processes of one machine and is released when the process dies, even
/// by kill -9). The lock file records the holder's pid, so a refusal can name it.
class FolderLock {
 public:
  /// Creates `folder` when needed and locks it. Throws c10::Error naming the folder and the pid
  /// of the process that holds it, or why the lock file cannot be made.
  explicit FolderLock(const std::string& folder);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  FolderLock(FolderLock&& other) noexcept;
  FolderLock& operator=(FolderLock&& other) noexcept;

  const std::string& folder() const { return folder_; }

 private:
  std::string folder_;
  int fd_ = -1;
};

/// Marks a file that this process is writing (a temporary one, before its rename into place) as
/// in use, until destroyed: an exclusive flock(2) on it through a descriptor of its own, which
/// holds across a rename and which the kernel drops when the process dies, even by kill -9. So
/// file_in_use tells a write in progress from the leftover of a killed one whatever pid the
/// file's name records (pids are reused, and a restarted container's trainer often has the
/// same one). Throws c10::Error naming the file when it cannot be opened or locked.
class FileInUse {
 public:
  explicit FileInUse(const std::string& path);
  ~FileInUse();
  FileInUse(const FileInUse&) = delete;
  FileInUse& operator=(const FileInUse&) = delete;

 private:
  int fd_ = -1;
};

/// Whether a process (this one included) holds a FileInUse on `path`; false for a file that is
/// not there or cannot be opened.
bool file_in_use(const std::string& path);

}  // namespace amp8
