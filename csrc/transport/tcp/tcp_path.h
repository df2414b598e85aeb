// A path over TCP: one control socket (CTS, ACK, ACTIVATE, RESYNC, heartbeats)
// and several data sockets, each with its own thread, so a large message is
// striped over all of them. Heartbeat silence or a stalled write fails the path.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/path.h"
#include "transport/tcp/socket.h"

namespace reccl {

class TcpPath : public Path {
 public:
  enum class Role { kSender, kReceiver };
  TcpPath(Role role, Fd control, std::vector<Fd> data, int localNic, int remoteNic, int healthId,
          std::string peer, const Config& config);
  ~TcpPath() override;

  void start(PathOwner* owner, uint64_t pathId) override;
  bool sendControl(const std::vector<uint8_t>& frame) override;
  void sendData(const DataChunk& chunk) override;
  void dropQueuedData() override;
  void shutdown() override;
  void stopAndJoin() override;
  int localNic() const override { return localNic_; }
  int remoteNic() const override { return remoteNic_; }
  std::string peer() const override { return peer_; }

 private:
  void controlLoop();
  void writerLoop(size_t index);
  void readerLoop(size_t index);
  void fail(Reason reason, const std::string& detail);
  IoWatch watch(Millis stallLimit);
  bool blackholed() const;

  const Role role_;
  Fd control_;
  std::vector<Fd> data_;
  const int localNic_;
  const int remoteNic_;
  const int healthId_;
  const std::string peer_;
  const Millis heartbeat_;
  // A data socket may stall under congestion while the control socket still
  // proves the peer alive; only a much longer stall fails the path on its own
  // (a dead NIC silences the control socket too, within one heartbeat).
  const Millis dataStallLimit_;
  PathOwner* owner_ = nullptr;
  uint64_t pathId_ = 0;

  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> lastHeardNs_{0};
  std::mutex controlWriteMutex_;
  std::mutex queueMutex_;
  std::condition_variable queueCv_;
  std::deque<DataChunk> queue_;
  std::mutex joinMutex_;  // concurrent stopAndJoin calls: one joins, the other waits
  std::vector<std::thread> threads_;
};

}  // namespace reccl
