#pragma once
// Reading a memory-mapped file that may be truncated under the reader.

#include <functional>

namespace amp8::recipes::detail {

/// Runs `copy`, which reads a memory-mapped file, and returns false instead of dying when a read
/// faults with SIGBUS (the file was truncated under the mapping): the fault jumps back here
/// (sigsetjmp/siglongjmp; `copy` must own nothing that needs destroying). An exception from
/// `copy` passes through. A SIGBUS anywhere else goes to the handler installed before, or kills
/// the process as usual.
bool copy_mapped(const std::function<void()>& copy);

}  // namespace amp8::recipes::detail
