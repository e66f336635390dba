#include "plugin/checkpoint.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace amp8 {
namespace {

std::string system_error() { return std::strerror(errno); }

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
  try {
    archive.save_to(temporary);
    fsync_path(temporary, /*directory=*/false);
  } catch (...) {
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
  std::error_code error;
  TORCH_CHECK(std::filesystem::is_regular_file(path, error), "checkpoint ", path,
              " does not exist or is not a file");
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint ", path, " is not a readable archive: ", e.what_without_backtrace());
  }
}

}  // namespace amp8
