#include "recipes/data/mapped_read.h"

#include <setjmp.h>
#include <signal.h>

#include <mutex>

namespace amp8::recipes {

namespace detail {
namespace {

thread_local sigjmp_buf* t_bus_error_jump = nullptr;
struct sigaction g_previous_bus_action;

extern "C" void on_bus_error(int signal, siginfo_t* info, void* context) {
  if (t_bus_error_jump != nullptr) siglongjmp(*t_bus_error_jump, 1);
  // Not ours: whoever handled SIGBUS before, or the default action.
  if (g_previous_bus_action.sa_flags & SA_SIGINFO) {
    g_previous_bus_action.sa_sigaction(signal, info, context);
  } else if (g_previous_bus_action.sa_handler != SIG_IGN && g_previous_bus_action.sa_handler != SIG_DFL) {
    g_previous_bus_action.sa_handler(signal);
  } else {
    ::signal(signal, SIG_DFL);
    ::raise(signal);
  }
}

}  // namespace

bool copy_mapped(const std::function<void()>& copy) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction action {};
    action.sa_sigaction = on_bus_error;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_SIGINFO;
    ::sigaction(SIGBUS, &action, &g_previous_bus_action);
  });
  sigjmp_buf jump;
  if (sigsetjmp(jump, /*savemask=*/1) != 0) {
    t_bus_error_jump = nullptr;
    return false;
  }
  t_bus_error_jump = &jump;
  try {
    copy();
  } catch (...) {  // disarmed first: no later SIGBUS may jump into this frame
    t_bus_error_jump = nullptr;
    throw;
  }
  t_bus_error_jump = nullptr;
  return true;
}

}  // namespace detail

}  // namespace amp8::recipes
