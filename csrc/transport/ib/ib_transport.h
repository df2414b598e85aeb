// The IB verbs / RoCE transport: one RC QP per path on the chosen RDMA
// devices, set up through a TCP bootstrap socket (HELLO with the listener's
// secret, then the QP exchange), as NCCL does. It makes listeners and
// connections; the core (SendConnection / RecvConnection) does the rest,
// unchanged. One thread per device turns async port events into NIC health,
// so a port error fails over every connection on that NIC at once.
#pragma once

#include <condition_variable>
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
#include "transport/ib/ib_endpoint.h"
#include "transport/ib/ib_flusher.h"
#include "transport/ib/ib_registration.h"
#include "transport/ib/verbs_api.h"
#include "transport/job_threads.h"
#include "transport/listener.h"

namespace reccl {

class IbTransport : public BondedTransport {
 public:
  // `verbs`: the system library or an emulation. Devices: RECCL_IB_HCA, else
  // every device `verbs` lists; their order is the rail order. The bootstrap
  // sockets use `bootstrapAddress` (a local IPv4 address on the management
  // network), never the RDMA NICs themselves.
  IbTransport(Config config, std::shared_ptr<VerbsApi> verbs, std::string bootstrapAddress);
  ~IbTransport() override;
  IbTransport(const IbTransport&) = delete;
  IbTransport& operator=(const IbTransport&) = delete;

  const char* kind() const override { return "ib"; }
  // nics(): one entry per device: name (the NIC name in health, stats and
  // events), backup, link state, port speed, sysfs PCI path where there is one.
  const std::string& bootstrapAddress() const { return bootstrapAddress_; }
  // Memory regions on every device (RECCL_IB_ZERO_COPY=on; nullptr when off).
  std::unique_ptr<MemoryRegistration> registerMemory(void* base, uint64_t bytes) override;
  std::unique_ptr<MemoryRegistration> registerDeviceMemory(void* address, uint64_t bytes) override;
  bool supportsDmaBuf(std::string* why) const override;
  bool supportsPeerMemory(std::string* why) const override;
  // An RDMA READ of one byte through a loopback QP (IbFlusher) on each NIC in
  // `writers` that is usable, and on one other usable NIC for those that are not.
  void flushDeviceWrites(const MemoryRegistration& registration, uint64_t address,
                         uint64_t writers) override;
  std::unique_ptr<MemoryRegistration> registerDmaBuf(int fd, uint64_t offset, uint64_t bytes,
                                                     uint64_t address) override;

 private:
  // Every device is reached through the one bootstrap endpoint; the HELLO
  // names the device (receiverNic).
  std::vector<HandleEndpoint> listenEndpoints() const override {
    return std::vector<HandleEndpoint>(nics_.size(), {bootstrapAddress_, acceptor_->port()});
  }
  // The handle lists one bootstrap address for every device: the index tells them apart.
  std::string remoteNicAddress(const ListenHandle& handle, size_t index) const override {
    return handle.nics[index].address + "#" + std::to_string(index);
  }
  void runDialJob(std::function<void()> job) override { jobs_.run(std::move(job)); }
  Acceptor::Verdict authenticate(const HelloBody& hello);
  // The receiving half of a path's setup, on a job thread.
  void acceptPath(const HelloBody& hello, Fd socket, const std::string& peer);
  std::shared_ptr<Path> dialPath(const ListenHandle& handle, uint64_t connectionId, int pathIndex,
                                 PathCandidate nics, PathFailure* failure) override;
  void watchEvents(int nic);
  // After IBV_EVENT_DEVICE_FATAL: the context is dead for good. Opens the
  // device again once it is back (retrying with backoff until the transport
  // stops), registers every live registration on it, then reports the NIC
  // up, so connections fail back onto it.
  void reopen(int nic);
  // The device of NIC `nic` now (reopen() replaces a dead one).
  std::shared_ptr<VerbsDevice> device(int nic) const;
  std::vector<std::shared_ptr<VerbsDevice>> devices() const;

  // RECCL_IB_TC / RECCL_IB_SL, for every QP this transport connects.
  QpRoute route() const {
    return {static_cast<uint8_t>(config_.ibTrafficClass),
            static_cast<uint8_t>(config_.ibServiceLevel)};
  }
  const GidPolicy gidPolicy_;  // RECCL_IB_GID_INDEX, RECCL_IB_ADDR_RANGE
  const std::shared_ptr<VerbsApi> verbs_;
  const std::string bootstrapAddress_;
  mutable std::mutex devicesMutex_;  // guards devices_ and, with stopping_, a reopen's wait
  std::condition_variable stopWait_;
  std::vector<std::shared_ptr<VerbsDevice>> devices_;
  // Held while registering and while a reopen swaps a device and registers
  // again, so no registration misses the reopened device.
  std::mutex registerMutex_;
  const std::shared_ptr<IbRegistrationTable> registrations_ =
      std::make_shared<IbRegistrationTable>();
  std::unique_ptr<Acceptor> acceptor_;
  uint64_t healthToken_ = 0;
  std::atomic<bool> stopping_{false};
  std::vector<std::thread> eventThreads_;
  JobThreads jobs_;
  std::mutex flushMutex_;
  std::vector<std::unique_ptr<IbFlusher>> flushers_;  // by NIC, made on first use
};

}  // namespace reccl
