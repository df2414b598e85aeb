// What TcpTransport and IbTransport share, as Gloo's transport::Context holds
// what its transports share: the NIC table and the NICs' health ids, the
// supervisor of their connections, the listeners and the ids that name them,
// and listen() and connect() themselves. A transport supplies only what
// differs: the endpoints its handles list, how a dial job runs and how one
// path is dialed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/connection.h"
#include "core/supervisor.h"
#include "core/topology.h"
#include "transport/handle.h"
#include "transport/listener.h"
#include "transport/nic_pair_liveness.h"
#include "transport/random_bytes.h"
#include "transport/transport.h"

namespace reccl {

class BondedTransport : public Transport {
 public:
  const Config& config() const override { return config_; }
  const std::vector<NicInfo>& nics() const override { return nics_; }
  int healthId(int nic) const override { return healthIds_.at(nic); }

  // A listener on `nic` whose handle lists listenEndpoints().
  std::shared_ptr<Listener> listen(int nic) override;
  // A bonded connection to the listener behind `handle`: its paths are
  // planned over both ends' NICs and each is dialed by dialPath() as a job
  // run by runDialJob().
  using Transport::connect;
  std::shared_ptr<SendConnection> connect(int nic, const std::vector<uint8_t>& handle,
                                          uint64_t tag) override;

 protected:
  // `nicNoun` names the NICs in errors ("NICs", "RDMA devices"). The derived
  // constructor fills nics_ and healthIds_; its destructor stops its dial
  // jobs and resets supervisor_ before its own members go.
  BondedTransport(Config config, std::string nicNoun)
      : config_(std::move(config)),
        supervisor_(std::make_unique<Supervisor>()),
        nicNoun_(std::move(nicNoun)) {}

  // Throws ConfigError unless `nic` is one of ours.
  void checkNic(int nic) const { checkNicIndex(nic, nics_.size(), nicNoun_); }
  ConnectionEnv connectionEnv(const std::string& peer);
  // The HELLO that opens a path of connection `connectionId` to the listener
  // behind `handle`: its listen id, secret and tag, the NIC pair, a fresh
  // nonce and this transport's id. The caller sets the socket kind and count.
  HelloBody pathHello(const ListenHandle& handle, uint64_t connectionId, int pathIndex,
                      PathCandidate nics);

  // Where a peer dials each of our NICs, in NIC order (the handle's list).
  virtual std::vector<HandleEndpoint> listenEndpoints() const = 0;
  // How the remote NIC `index` of `handle` is named in events and stats.
  virtual std::string remoteNicAddress(const ListenHandle& handle, size_t index) const = 0;
  // Runs `job` on this transport's dial threads.
  virtual void runDialJob(std::function<void()> job) = 0;
  // The dialing half of a path's setup, on a dial thread; nullptr and `failure` on failure.
  virtual std::shared_ptr<Path> dialPath(const ListenHandle& handle, uint64_t connectionId,
                                         int pathIndex, PathCandidate nics,
                                         PathFailure* failure) = 0;

  const Config config_;
  std::vector<NicInfo> nics_;
  std::vector<int> healthIds_;
  std::unique_ptr<Supervisor> supervisor_;
  RandomIds ids_;
  // Names this transport in handshakes, so both ends group their paths by NIC pair.
  const uint64_t transportId_ = ids_.next();
  NicPairTable pairs_;
  ListenerTable listeners_;

 private:
  const std::string nicNoun_;
};

}  // namespace reccl
