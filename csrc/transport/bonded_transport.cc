#include "transport/bonded_transport.h"

#include <cstring>

#include "transport/job_dialer.h"
#include "transport/path_plan.h"

namespace reccl {

ConnectionEnv BondedTransport::connectionEnv(const std::string& peer) {
  return makeConnectionEnv(config_, supervisor_.get(), nics_, healthIds_, peer, this);
}

HelloBody BondedTransport::pathHello(const ListenHandle& handle, uint64_t connectionId,
                                     int pathIndex, PathCandidate nics) {
  HelloBody hello{};
  hello.version = kProtocolVersion;
  hello.pathIndex = static_cast<uint8_t>(pathIndex);
  hello.senderNic = static_cast<uint8_t>(nics.localNic);
  hello.receiverNic = static_cast<uint8_t>(nics.remoteNic);
  hello.listenId = handle.listenId;
  hello.connectionId = connectionId;
  hello.dialerTag = handle.dialerTag;
  hello.pathNonce = ids_.next();
  hello.dialerTransport = transportId_;
  std::memcpy(hello.secret, handle.secret, kSecretBytes);
  std::strncpy(hello.senderNicName, nics_.at(nics.localNic).name.c_str(), kNicNameBytes - 1);
  return hello;
}

std::shared_ptr<Listener> BondedTransport::listen(int nic) {
  checkNic(nic);
  return listeners_.create(nic, config_.backup ? nics_[nic].backup : -1,
                           static_cast<uint32_t>(config_.chunkBytes), listenEndpoints(),
                           ids_.next());
}

std::shared_ptr<SendConnection> BondedTransport::connect(int nic, const std::vector<uint8_t>& bytes,
                                                         uint64_t tag) {
  checkNic(nic);
  ListenHandle handle = decodeHandle(bytes.data(), bytes.size());
  handle.dialerTag = tag;
  std::vector<PathCandidate> candidates =
      planPaths(nic, nics_[nic].backup, static_cast<int>(nics_.size()), handle, config_.backup);
  uint64_t id = ids_.next();
  ConnectionEnv env = connectionEnv(handle.nics[handle.listenerNic].address);
  for (size_t i = 0; i < handle.nics.size(); ++i)
    env.remoteNicAddresses.push_back(remoteNicAddress(handle, i));
  auto connection = std::make_shared<SendConnection>(
      std::move(env), id, candidates,
      std::make_unique<JobDialer>([this](std::function<void()> job) { runDialJob(std::move(job)); },
                                  [this](const ListenHandle& h, uint64_t connectionId,
                                         int pathIndex, PathCandidate nics, PathFailure* failure) {
                                    return dialPath(h, connectionId, pathIndex, nics, failure);
                                  },
                                  handle, id),
      handle.chunkBytes);
  supervisor_->add(connection);
  connection->dialNow();
  return connection;
}

}  // namespace reccl
