#include "core/thread_name.h"

#include <pthread.h>

#include <cstring>

namespace reccl {

void nameThisThread(const char* name) {
  // pthread_setname_np refuses (ERANGE) a name longer than the kernel's 15
  // characters instead of truncating it.
  char truncated[16];
  std::strncpy(truncated, name, sizeof(truncated) - 1);
  truncated[sizeof(truncated) - 1] = '\0';
  pthread_setname_np(pthread_self(), truncated);
}

}  // namespace reccl
