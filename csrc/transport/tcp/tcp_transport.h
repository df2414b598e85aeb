// The TCP transport: one acceptor per local NIC, the dialer, the supervisor and
// the link monitor. It makes listeners and connections; the core does the rest.
#pragma once

#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/recv_connection.h"
#include "core/send_connection.h"
#include "core/supervisor.h"
#include "core/topology.h"
#include "transport/acceptor.h"
#include "transport/bonded_transport.h"
#include "transport/handle.h"
#include "transport/job_threads.h"
#include "transport/link_monitor.h"
#include "transport/listener.h"
#include "transport/same_host.h"
#include "transport/tcp/tcp_path.h"

namespace reccl {

class TcpTransport : public BondedTransport {
 public:
  explicit TcpTransport(Config config);
  ~TcpTransport() override;
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  const char* kind() const override { return "tcp"; }

 private:
  struct PartialPath {
    HelloBody hello{};
    std::string peer;
    Fd control;
    std::vector<Fd> data;
    std::shared_ptr<const PeerMemory> peerMemory;  // the control socket's offer was taken
    size_t have = 0;
    Clock::time_point deadline;
  };

  // Drops the paths whose first sockets did not all arrive by their deadline
  // (a dialer that gave up half way, a listener that went in between).
  class PartialSweep : public Serviced {
   public:
    explicit PartialSweep(TcpTransport* transport) : transport_(transport) {}
    void service() override { transport_->dropExpiredPartials(); }
    bool quiet() override { return true; }  // woken by wakeBy() at each partial's deadline

   private:
    TcpTransport* const transport_;
  };

  // Each NIC's own address and acceptor port.
  std::vector<HandleEndpoint> listenEndpoints() const override;
  std::string remoteNicAddress(const ListenHandle& handle, size_t index) const override {
    return handle.nics[index].address;
  }
  void runDialJob(std::function<void()> job) override { dials_.run(std::move(job)); }
  void dropExpiredPartials();
  Acceptor::Verdict authenticate(int nic, const HelloBody& hello);
  void admit(int nic, const HelloBody& hello, const Acceptor::Verdict& verdict, Fd socket,
             const std::string& peer);
  // Whether a control socket's same-host offer can be taken (the probe).
  bool takeSameHostOffer(const HelloBody& hello);
  void deliver(PartialPath partial, int nic);
  std::shared_ptr<Path> dialPath(const ListenHandle& handle, uint64_t connectionId, int pathIndex,
                                 PathCandidate nics, PathFailure* failure) override;

  std::shared_ptr<PartialSweep> partialSweep_;  // serviced by supervisor_ (it holds a weak_ptr)
  std::vector<std::unique_ptr<Acceptor>> acceptors_;
  std::unique_ptr<LinkMonitor> linkMonitor_;
  uint64_t healthToken_ = 0;

  std::mutex mutex_;
  using PathKey =
      std::tuple<uint64_t, uint64_t, uint8_t, uint64_t>;  // listen, connection, index, nonce
  std::map<PathKey, PartialPath> partial_;  // dropped at their deadline by partialSweep_
  // Receiving paths that started before all their data sockets arrived.
  std::map<PathKey, std::weak_ptr<TcpPath>> growing_;
  size_t growingSweepAt_ = 64;
  JobThreads dials_;
  bool stopping_ = false;
  // Set once a peer's payload could not be read though its token could: offers are refused from
  // then on.
  const std::shared_ptr<std::atomic<bool>> sameHostUnreadable_ =
      std::make_shared<std::atomic<bool>>(false);
  std::atomic<bool> sameHostRefusalLogged_{false};
};

}  // namespace reccl
