#include "transport/ib/ib_transport.h"

#include <climits>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"
#include "core/thread_name.h"
#include "transport/hello_dial.h"
#include "transport/ib/ib_path.h"
#include "transport/ib/ib_registration.h"
#include "transport/ib/qp_exchange.h"

namespace reccl {

namespace {
// The async event watcher sleeps until an event or shutdown; this only bounds it.
constexpr Millis kAsyncWaitBound(60000);
// Reopening a device after a fatal error: the first try after this, then
// twice as long each time up to the cap (a firmware reset takes seconds).
constexpr Millis kReopenFirstWait(50);
constexpr Millis kReopenMaxWait(2000);

// PCI facts that let chooseBackups() apply the distance cost (docs/design.md §3); devices
// without a PCI path pair with the next one in order.
void readDeviceTopology(const VerbsDevice& device, NicInfo& nic) {
  nic.pciPath = device.pciPath();
  if (nic.pciPath.empty()) return;
  std::ifstream numa(nic.pciPath + "/numa_node");
  int node = -1;
  if (numa >> node) nic.numaNode = node;
}

// Reads exactly `length` bytes of the bootstrap exchange within `timeout`.
void exchangeRead(int fd, uint8_t* out, size_t length, Millis timeout, const char* what) {
  IoWatch watch;
  watch.stallLimit = timeout;
  IoResult result = recvAll(fd, out, length, watch, timeout);
  if (!result.ok()) throw Error(std::string("reading the ") + what + ": " + result.describe());
}

void exchangeWrite(int fd, const uint8_t* bytes, size_t length, Millis timeout, const char* what) {
  IoWatch watch;
  watch.stallLimit = timeout;
  IoResult result = sendAll(fd, bytes, length, watch);
  if (!result.ok()) throw Error(std::string("writing the ") + what + ": " + result.describe());
}

// The peer's half must describe regions this build can use.
void checkPeerRegions(const QpExchange& peer, uint64_t chunkBytes) {
  if (peer.slotCount != IbEndpoint::kDataSlots) {
    throw ProtocolError("QP exchange: " + std::to_string(peer.slotCount) +
                        " staging slots; this build uses " +
                        std::to_string(IbEndpoint::kDataSlots));
  }
  if (peer.role == QpExchange::Role::kReceiver &&
      peer.slotBytes < IbEndpoint::kDataHeadBytes + chunkBytes) {
    throw ProtocolError("QP exchange: staging slots of " + std::to_string(peer.slotBytes) +
                        " bytes cannot hold chunks of " + std::to_string(chunkBytes));
  }
}

}  // namespace

IbTransport::IbTransport(Config config, std::shared_ptr<VerbsApi> verbs,
                         std::string bootstrapAddress)
    : BondedTransport(std::move(config), "RDMA devices"),
      gidPolicy_{config_.ibGidIndex,
                 config_.ibAddressRange.empty()
                     ? std::nullopt
                     : std::optional<AddressRange>(AddressRange::parse(config_.ibAddressRange))},
      verbs_(std::move(verbs)),
      bootstrapAddress_(std::move(bootstrapAddress)) {
  if (!verbs_) throw ConfigError("the IB transport needs a verbs provider");
  std::vector<std::string> names =
      config_.ibDevices.empty() ? verbs_->deviceNames() : config_.ibDevices;
  if (names.empty()) {
    throw ConfigError("no RDMA devices found through " + verbs_->describe() +
                      "; the IB transport needs at least one (RECCL_IB_HCA selects them)");
  }
  // Named devices stay in the order given, up or down (a backup that is down
  // now may come up). Listed ones, as NCCL takes them: only those whose port
  // is active, ordered by PCI path, so that rail i is the same slot on every
  // host whatever order the kernel registered the devices in.
  std::vector<std::pair<std::shared_ptr<VerbsDevice>, PortAttributes>> opened;
  for (const auto& name : names) {
    std::shared_ptr<VerbsDevice> device = verbs_->open(name);  // throws naming the valid ones
    PortAttributes port = device->queryPort(IbEndpoint::kPort);
    if (!config_.ibDevices.empty() || port.active) opened.emplace_back(std::move(device), port);
  }
  if (config_.ibDevices.empty()) {
    if (opened.empty()) {
      throw ConfigError(
          "no RDMA device listed by " + verbs_->describe() +
          " has an active port; RECCL_IB_HCA names devices to use whatever their state");
    }
    std::stable_sort(opened.begin(), opened.end(), [](const auto& a, const auto& b) {
      return a.first->pciPath() < b.first->pciPath();
    });
  }
  if (opened.size() > kMaxHandleNics) {
    throw ConfigError("reccl supports at most " + std::to_string(kMaxHandleNics) +
                      " NICs per process; " + std::to_string(opened.size()) +
                      " RDMA devices selected (RECCL_IB_HCA names fewer)");
  }
  NicHealth& health = NicHealth::instance();
  for (auto& [device, port] : opened) {
    const std::string name = device->name();
    NicInfo nic;
    nic.name = name;
    nic.interface = name;
    nic.address = bootstrapAddress_;
    nic.linkUp = port.active;
    // NicInfo's default stands when the port does not say (NCCL needs a rate).
    if (port.speedMbps > 0) nic.speedMbps = port.speedMbps;
    readDeviceTopology(*device, nic);
    int id = health.registerNic(name, port.active);
    health.setLinkUp(id, port.active, port.active ? Reason::kLinkUp : Reason::kLinkDown);
    healthIds_.push_back(id);
    devices_.push_back(std::move(device));
    nics_.push_back(std::move(nic));
  }
  chooseBackups(nics_);
  acceptor_ = std::make_unique<Acceptor>(
      bootstrapAddress_, "ib-bootstrap", transportId_, Millis(config_.connectTimeoutMs),
      [this](const HelloBody& hello) { return authenticate(hello); },
      [this](const HelloBody& hello, const Acceptor::Verdict&, Fd socket, const std::string& peer) {
        auto held = std::make_shared<Fd>(std::move(socket));
        jobs_.run([this, hello, held, peer] { acceptPath(hello, std::move(*held), peer); });
      });
  healthToken_ = forwardNicHealth(supervisor_.get(), healthIds_);
  for (size_t i = 0; i < devices_.size(); ++i) {
    eventThreads_.emplace_back([this, i] { watchEvents(static_cast<int>(i)); });
  }
}

IbTransport::~IbTransport() {
  NicHealth::instance().removeListener(healthToken_);
  {
    std::lock_guard<std::mutex> lock(devicesMutex_);
    stopping_.store(true);
    for (auto& device : devices_) device->interruptAsyncWait();
  }
  stopWait_.notify_all();
  for (auto& thread : eventThreads_) thread.join();
  acceptor_.reset();
  jobs_.stopAndJoin();
  supervisor_.reset();
}

void IbTransport::watchEvents(int nic) {
  nameThisThread("reccl-ib-event");
  NicHealth& health = NicHealth::instance();
  while (!stopping_.load()) {
    AsyncEvent event;
    try {
      // Woken by an event or by the destructor's interrupt; the bound is a backstop.
      if (!device(nic)->waitAsyncEvent(&event, kAsyncWaitBound)) continue;
    } catch (const Error& error) {
      RECCL_LOG(kWarn, "async events of " + nics_[nic].name + ": " + error.what());
      std::this_thread::sleep_for(Millis(100));
      continue;
    }
    RECCL_LOG(kInfo, "async event on " + nics_[nic].name + ": " + asyncEventName(event.type));
    const bool portEvent =
        event.type == AsyncEventType::kPortError || event.type == AsyncEventType::kPortActive;
    if (portEvent && event.port != IbEndpoint::kPort) continue;  // a port we do not use
    switch (event.type) {
      case AsyncEventType::kPortError:
        // NIC-wide at once: every connection with a path on it fails over now.
        health.setLinkUp(healthIds_[nic], false, Reason::kLinkDown);
        break;
      case AsyncEventType::kDeviceFatal:
        // The same, and this context hears nothing more: reopen the device.
        health.setLinkUp(healthIds_[nic], false, Reason::kLinkDown);
        reopen(nic);
        break;
      case AsyncEventType::kPortActive:
        health.setLinkUp(healthIds_[nic], true, Reason::kLinkUp);
        break;
      case AsyncEventType::kCqError:
        // One CQ overran (its QPs are in ERR): the path owning it finds its
        // poll failing at its next turn (a heartbeat at the latest) and fails
        // over; the event does not say which, and the NIC itself is fine.
        RECCL_LOG(kWarn, "completion queue overrun on " + nics_[nic].name +
                             ": the path using it fails over and re-dials");
        break;
      default:
        // GID changes need nothing here: each new QP reads the table afresh.
        // A QP's own fatal error shows up as CQE errors on its path.
        break;
    }
  }
}

void IbTransport::reopen(int nic) {
  const std::string& name = nics_[nic].name;
  RECCL_LOG(kWarn, "fatal error on RDMA device " + name +
                       ": its paths fail over; reopening it once it is back");
  Millis wait = kReopenFirstWait;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(devicesMutex_);
      if (stopWait_.wait_for(lock, wait, [&] { return stopping_.load(); })) return;
    }
    wait = std::min(wait * 2, kReopenMaxWait);
    std::shared_ptr<VerbsDevice> fresh;
    PortAttributes port;
    try {
      fresh = verbs_->open(name);
      port = fresh->queryPort(IbEndpoint::kPort);
    } catch (const Error& error) {
      RECCL_LOG(kTrace, "reopening " + name + ": " + error.what());
      continue;
    }
    {
      std::lock_guard<std::mutex> registering(registerMutex_);
      {
        std::lock_guard<std::mutex> lock(devicesMutex_);
        if (stopping_.load()) return;
        devices_[nic] = fresh;
      }
      // The keys of the dead context are void; the NIC is still down, so no
      // path uses it before this is done.
      registrations_->reregisterAll(nic, fresh);
    }
    {
      std::lock_guard<std::mutex> lock(flushMutex_);
      if (static_cast<size_t>(nic) < flushers_.size()) flushers_[nic].reset();
    }
    RECCL_LOG(kWarn, "RDMA device " + name + " reopened after its fatal error; port " +
                         (port.active ? "active" : "down"));
    NicHealth::instance().setLinkUp(healthIds_[nic], port.active,
                                    port.active ? Reason::kLinkUp : Reason::kLinkDown);
    return;
  }
}

std::shared_ptr<VerbsDevice> IbTransport::device(int nic) const {
  std::lock_guard<std::mutex> lock(devicesMutex_);
  return devices_.at(static_cast<size_t>(nic));
}

std::vector<std::shared_ptr<VerbsDevice>> IbTransport::devices() const {
  std::lock_guard<std::mutex> lock(devicesMutex_);
  return devices_;
}

std::unique_ptr<MemoryRegistration> IbTransport::registerMemory(void* base, uint64_t bytes) {
  if (!config_.ibZeroCopy) return nullptr;
  std::lock_guard<std::mutex> registering(registerMutex_);
  return IbRegistration::host(this, registrations_, devices(), base, bytes,
                              config_.ibRelaxedOrdering);
}

std::unique_ptr<MemoryRegistration> IbTransport::registerDeviceMemory(void* address,
                                                                      uint64_t bytes) {
  if (!config_.ibZeroCopy) {
    throw Error(
        "GPU memory travels only by direct placement, which RECCL_IB_ZERO_COPY=off disables");
  }
  std::lock_guard<std::mutex> registering(registerMutex_);
  return IbRegistration::peer(this, registrations_, devices(), address, bytes,
                              config_.ibRelaxedOrdering);
}

void IbTransport::flushDeviceWrites(const MemoryRegistration& registration, uint64_t address,
                                    uint64_t writers) {
  const auto* memory = dynamic_cast<const IbRegistration*>(&registration);
  if (memory == nullptr || memory->hostAccessible()) return;
  NicHealth& health = NicHealth::instance();
  const int count = static_cast<int>(nics_.size());
  std::lock_guard<std::mutex> lock(flushMutex_);
  if (flushers_.size() != nics_.size()) flushers_.resize(nics_.size());
  std::string failures;
  // A read through `nic`; false (and why, in `failures`) when it is down,
  // holds no key for the memory or the read fails.
  auto flushThrough = [&](int nic) {
    if (!health.usable(healthIds_[nic])) return false;
    const std::optional<uint32_t> rkey = memory->rkey(nic);
    if (!rkey) return false;  // that device refused the registration: it wrote none of it
    std::unique_ptr<IbFlusher>& flusher = flushers_[static_cast<size_t>(nic)];
    try {
      if (!flusher) {
        flusher = std::make_unique<IbFlusher>(device(nic), gidPolicy_, config_.ibTimeout,
                                              config_.ibRetryCount);
      }
      flusher->flush(address, *rkey, Millis(config_.heartbeatMs));
      return true;
    } catch (const Error& error) {
      flusher.reset();  // its QP is in ERR (or was never made): a fresh one next time
      failures += (failures.empty() ? "" : "; ") + std::string(error.what());
      return false;
    }
  };
  // Through each NIC that wrote part of it. One that is down or fails the
  // read lost its port: its QPs are in ERR, so its writes ended there, and a
  // read through any other usable NIC stands in for it.
  bool flushed = false;
  for (int nic = 0; nic < count; ++nic) {
    if ((writers >> nic & 1) && flushThrough(nic)) flushed = true;
  }
  if (flushed) return;
  for (int nic = 0; nic < count; ++nic) {
    if (!(writers >> nic & 1) && flushThrough(nic)) return;
  }
  throw Error("GPU flush failed on every usable RDMA device" +
              (failures.empty() ? std::string(" (none is usable)") : ": " + failures));
}

bool IbTransport::supportsPeerMemory(std::string* why) const {
  if (!config_.ibZeroCopy) {
    *why = "RECCL_IB_ZERO_COPY=off (GPU memory travels only by direct placement)";
    return false;
  }
  return verbs_->peerMemoryLoaded(why);
}

bool IbTransport::supportsDmaBuf(std::string* why) const {
  if (!config_.ibZeroCopy) {
    *why = "RECCL_IB_ZERO_COPY=off (dma-buf memory travels only by direct placement)";
    return false;
  }
  for (const auto& device : devices()) {
    std::string reason;
    if (!device->supportsDmaBuf(&reason)) {
      *why = device->name() + ": " + reason;
      return false;
    }
  }
  return true;
}

std::unique_ptr<MemoryRegistration> IbTransport::registerDmaBuf(int fd, uint64_t offset,
                                                                uint64_t bytes, uint64_t address) {
  std::string why;
  if (!supportsDmaBuf(&why)) throw Error("dma-buf registration is not supported: " + why);
  std::lock_guard<std::mutex> registering(registerMutex_);
  return IbRegistration::dmaBuf(this, registrations_, devices(), fd, offset, bytes, address,
                                config_.ibRelaxedOrdering);
}

Acceptor::Verdict IbTransport::authenticate(const HelloBody& hello) {
  using Verdict = Acceptor::Verdict;
  Verdict verdict = listeners_.check(hello);
  if (verdict.kind != Verdict::kAdmit) return verdict;
  if (hello.receiverNic >= nics_.size()) {
    return {Verdict::kReject, "names RDMA device " + std::to_string(hello.receiverNic) + " of " +
                                  std::to_string(nics_.size())};
  }
  if (hello.socketKind != static_cast<uint8_t>(SocketKind::kControl)) {
    return {Verdict::kReject, "an IB path has one bootstrap socket, not data sockets"};
  }
  // A device that is down accepts nothing, as a dead link would; otherwise a
  // peer could fail back onto it.
  NicHealth& health = NicHealth::instance();
  if (!health.usable(healthIds_.at(hello.receiverNic)))
    return {Verdict::kDecline, "RDMA device is down"};
  if (health.blackholed(healthIds_.at(hello.receiverNic))) {
    return {Verdict::kDecline, "RDMA device is blackholed"};
  }
  return {};
}

void IbTransport::acceptPath(const HelloBody& hello, Fd socket, const std::string& peer) {
  const Millis timeout(config_.connectTimeoutMs);
  const int nic = hello.receiverNic;
  const std::string peerHost = peer.substr(0, peer.find(':'));
  std::shared_ptr<Path> path;
  try {
    uint8_t bytes[kQpExchangeBytes];
    exchangeRead(socket.get(), bytes, sizeof(bytes), timeout, "sender's QP description");
    QpExchange remote = decodeQpExchange(bytes, sizeof(bytes), QpExchange::Role::kSender);
    checkPeerRegions(remote, static_cast<uint64_t>(config_.chunkBytes));
    auto endpoint =
        std::make_unique<IbEndpoint>(device(nic), IbEndpoint::Role::kReceiver, config_.chunkBytes,
                                     static_cast<uint32_t>(ids_.next()));
    QpExchange local = endpoint->describe(gidPolicy_);
    std::vector<uint8_t> mine = encodeQpExchange(local);
    // Link layers that differ fail connect() below; the sender learns it from
    // our description (and names it) instead of from a closed socket.
    const bool mismatch = local.ethernet != remote.ethernet;
    if (mismatch) exchangeWrite(socket.get(), mine.data(), mine.size(), timeout, "QP description");
    endpoint->connect(remote, config_.ibTimeout, config_.ibRetryCount, route());
    exchangeWrite(socket.get(), mine.data(), mine.size(), timeout, "QP description");
    uint8_t ready = 0;
    exchangeRead(socket.get(), &ready, 1, timeout, "sender's ready byte");
    if (ready != kQpReadyByte) throw ProtocolError("QP exchange: bad ready byte");
    path = std::make_shared<IbPath>(
        std::move(endpoint), remote, nic, hello.senderNic, healthIds_.at(nic), peerHost,
        pairs_.join(healthIds_.at(nic), hello.dialerTransport, hello.senderNic), config_);
  } catch (const ProtocolError& error) {
    NicHealth::instance().countRejectedHandshake();
    RECCL_LOG(kWarn, "IB path from " + peer + " rejected: " + error.what());
    return;
  } catch (const Error& error) {
    RECCL_LOG(kInfo, "IB path from " + peer + " not set up: " + error.what());
    return;
  }
  std::shared_ptr<Listener> listener = listeners_.find(hello.listenId);
  if (!listener) return;
  PathCandidate nics{nic, hello.senderNic, hello.pathIndex < 2};
  listener->adoptPath(
      hello, nics, std::move(path), [&] { return connectionEnv(peerHost); }, config_.chunkBytes,
      supervisor_.get(), listener);
}

std::shared_ptr<Path> IbTransport::dialPath(const ListenHandle& handle, uint64_t connectionId,
                                            int pathIndex, PathCandidate nics,
                                            PathFailure* failure) {
  const Millis timeout(config_.connectTimeoutMs);
  const NicInfo& local = nics_.at(nics.localNic);
  const HandleEndpoint& remote = handle.nics.at(nics.remoteNic);
  if (!NicHealth::instance().usable(healthIds_.at(nics.localNic))) {
    *failure = {"local RDMA device " + local.name + " is down"};
    return nullptr;
  }
  HelloBody hello = pathHello(handle, connectionId, pathIndex, nics);
  hello.socketKind = static_cast<uint8_t>(SocketKind::kControl);
  hello.socketCount = 1;  // the bootstrap socket; the path itself is the QP
  uint64_t peerTransport = 0;
  Fd socket = dialWithHello(bootstrapAddress_, remote, hello, timeout, failure, &peerTransport);
  if (!socket.valid()) return nullptr;
  try {
    auto endpoint =
        std::make_unique<IbEndpoint>(device(nics.localNic), IbEndpoint::Role::kSender,
                                     handle.chunkBytes, static_cast<uint32_t>(ids_.next()));
    std::vector<uint8_t> mine = encodeQpExchange(endpoint->describe(gidPolicy_));
    exchangeWrite(socket.get(), mine.data(), mine.size(), timeout, "QP description");
    uint8_t bytes[kQpExchangeBytes];
    exchangeRead(socket.get(), bytes, sizeof(bytes), timeout, "receiver's QP description");
    QpExchange peer = decodeQpExchange(bytes, sizeof(bytes), QpExchange::Role::kReceiver);
    checkPeerRegions(peer, handle.chunkBytes);
    endpoint->connect(peer, config_.ibTimeout, config_.ibRetryCount, route());
    endpoint->probe(peer, timeout);
    exchangeWrite(socket.get(), &kQpReadyByte, 1, timeout, "ready byte");
    return std::make_shared<IbPath>(
        std::move(endpoint), peer, nics.localNic, nics.remoteNic, healthIds_.at(nics.localNic),
        remote.address + "#" + std::to_string(nics.remoteNic),
        pairs_.join(healthIds_.at(nics.localNic), peerTransport, nics.remoteNic), config_);
  } catch (const Error& e) {
    *failure = {"IB path " + local.name + "->" + remote.address + "#" +
                std::to_string(nics.remoteNic) + ": " + e.what()};
    return nullptr;
  }
}

}  // namespace reccl
