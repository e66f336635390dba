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

/// A file this process writes and then renames into place (a temporary file), marked as being
/// written while it is open: an exclusive flock(2) on the writing descriptor, which holds across
/// the rename and which the kernel drops when the process dies, even by kill -9. So
/// remove_unless_being_written tells a write in progress from the leftover of a killed one,
/// whatever pid the file's name records (pids are reused; a restarted container's trainer often
/// has the same one). On NFS, where Linux turns flock into POSIX record locks, the mark holds
/// between processes (hosts) but not between two descriptors of one process.
class FileBeingWritten {
 public:
  /// Creates (or truncates) `path` for writing and marks it. A remover that took the file away
  /// between its creation and the mark is noticed (the path no longer names the descriptor's
  /// file) and the file is made again. Throws c10::Error naming the file when it cannot be
  /// created or marked.
  explicit FileBeingWritten(const std::string& path);
  ~FileBeingWritten();
  FileBeingWritten(const FileBeingWritten&) = delete;
  FileBeingWritten& operator=(const FileBeingWritten&) = delete;

  int fd() const { return fd_; }
  /// Closes the file, which ends the mark: "" or what close(2) said.
  std::string close();

 private:
  std::string path_;
  int fd_ = -1;
};

/// Removes `path` unless a FileBeingWritten marks it (the check and the removal under a lock of
/// its own, and only while the path still names the file it locked). Whether it removed it.
bool remove_unless_being_written(const std::string& path);

}  // namespace amp8
