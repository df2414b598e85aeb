// Names native threads so a rank's threads can be told apart in top -H, gdb,
// py-spy and /proc/<pid>/task/*/comm.
#pragma once

namespace reccl {

// Names the calling thread; Linux keeps the first 15 characters.
void nameThisThread(const char* name);

}  // namespace reccl
