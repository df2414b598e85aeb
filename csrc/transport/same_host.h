// Same-host reads: when a path's two ends are processes of one kernel, the
// receiver copies each payload straight out of the sender's memory
// (process_vm_readv) instead of both ends copying it through loopback TCP:
// one copy instead of two, and no TCP stack in between. Headers, control
// frames, heartbeats and failover stay on the path's sockets, so epochs,
// RESYNC and NIC faults work as on any TCP path.
//
// The offer rides in the control socket's HELLO: the dialer's host key, pid
// and the address of a random token word it keeps per path. The acceptor
// takes it only if the host key matches and it can read that token at that
// address in that pid: proof that the pid is the dialer and readable (a pid
// namespace, Yama ptrace scope or seccomp profile that forbids the read just
// leaves the path on plain TCP).
//
// The sender's buffers stay valid until the receiver acknowledges a message,
// except when the sending side gives up (a failed path, a closed or aborted
// connection). So the sender zeroes the token before anything of that path's
// requests is failed or freed, and the receiver reads the token again after
// each payload: only a payload read while the token still held lands.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace reccl {

// Chunks smaller than this go inline on the socket: two small syscalls for a
// reference cost more than copying them through it.
constexpr size_t kSameHostMinBytes = 16 << 10;

// This process's host key: equal keys share a kernel, a network namespace
// and a pid namespace (the pid in a HELLO then names the same process).
uint64_t sameHostKey();

// The sender's side: the token the receiver checks. Zeroed by revoke(); the
// object outlives the path's last DATA_REF (the path owns it).
class SameHostWindow {
 public:
  SameHostWindow();
  uint64_t tokenAddress() const { return reinterpret_cast<uint64_t>(&token_); }
  uint64_t token() const { return expected_; }
  void revoke() { token_.store(0); }

 private:
  const uint64_t expected_;
  std::atomic<uint64_t> token_;
};

// The receiver's side: reads from the sender's process.
class PeerMemory {
 public:
  // `unreadable` is set when a payload cannot be read though the token could
  // (memory another process may not read): the transport takes no more offers.
  PeerMemory(pid_t pid, uint64_t tokenAddress, uint64_t token,
             std::shared_ptr<std::atomic<bool>> unreadable)
      : pid_(pid), tokenAddress_(tokenAddress), token_(token), unreadable_(std::move(unreadable)) {}
  // Copies `bytes` from `address` in the sender into `into`; false and `why`
  // when the read fails or the sender revoked its window meanwhile.
  bool read(void* into, uint64_t address, size_t bytes, std::string* why) const;
  // Whether the sender's token reads as offered (the probe at the handshake).
  bool tokenHolds(std::string* why) const;

 private:
  const pid_t pid_;
  const uint64_t tokenAddress_;
  const uint64_t token_;
  const std::shared_ptr<std::atomic<bool>> unreadable_;
};

}  // namespace reccl
