// The process's file-descriptor table, grown once, early and off the caller's
// thread. Linux grows the table by doubling (64, 128, 256, ...) when an fd
// beyond it is opened, and in a multi-threaded process each growth waits for
// an RCU grace period: 10-45 ms measured on our VMs, stalling whichever dial
// or accept opened that fd (docs/scale.md, "Set-up"). Growing it once to
// 4096 entries (or the RLIMIT_NOFILE soft limit, if lower) takes that wait on
// a thread of its own, before the sockets need it.
#pragma once

namespace reccl {

// Starts growing the table, once per process (pid): `import torch_reccl` does,
// long before the sockets come, and the first group's creation again in a
// process forked after the import. Never blocks the caller and never throws; a
// failure leaves the table to grow as before.
void reserveDescriptorTable();

}  // namespace reccl
