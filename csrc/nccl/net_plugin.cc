#include "nccl/net_plugin.h"

#include <cstring>
#include <deque>
#include <optional>

#include "core/error.h"
#include "core/log.h"
#include "gpu/cuda_driver.h"
#include "transport/handle.h"
#include "transport/make_transport.h"

namespace reccl {

namespace {

constexpr int kPluginDataSockets = 2;  // RECCL_NSOCKS=0 in the plugin

struct ListenComm {
  std::shared_ptr<Listener> listener;
};
struct PluginRequest;
struct SendComm {
  std::shared_ptr<SendConnection> connection;
  // NVL sends whose copy to the host mirror is queued, in isend order: each
  // goes to the connection once its copy finished and every earlier one went.
  std::deque<PluginRequest*> staging;
};
struct RecvComm {
  std::shared_ptr<RecvConnection> connection;
};
// What regMr / regMrDmaBuf registered: the transport's registration (IB:
// every device; direct placement), or for a GPU buffer without GPUDirect the
// NVL region whose pinned mirror stages it; neither for host memory on TCP.
struct MemoryRegion {
  std::unique_ptr<Nvl::Region> gpu;                   // NVL only
  std::unique_ptr<MemoryRegistration> registration;  // host, peer-memory or dma-buf
};
// Where a request NCCL holds stands; test() moves it forward, never back.
enum class RequestPhase {
  kStagingToHost,  // a GPU send: its copy to the host mirror runs; the connection has nothing yet
  kOnTransport,  // the connection moves the bytes
  kDeliveringToGpu,  // a GPU receive: the bytes are in the mirror; their copy to the GPU buffer
                     // runs
};

struct PluginRequest {
  RequestPhase phase = RequestPhase::kOnTransport;
  std::shared_ptr<Request>
      request;  // the connection's; a staged send gets it when postStagedSends hands it over
  uint64_t bytes = 0;
  // NVL: the region and its copy between the GPU buffer and the host mirror.
  Nvl::Region* region = nullptr;
  std::optional<DeviceStager::Transfer> copy;
  // A staged send, until the connection has it.
  SendComm* sendComm = nullptr;
  uint8_t* hostData = nullptr;
  size_t size = 0;
  // A staged receive: copied from the mirror into the GPU buffer on completion.
  uint8_t* deviceData = nullptr;
  std::shared_ptr<RecvConnection> connection;
};

// Hands the connection every staged send at the head of the queue whose copy
// to the host finished. Throws Error when the connection failed.
void postStagedSends(SendComm& comm) {
  while (!comm.staging.empty()) {
    PluginRequest* head = comm.staging.front();
    if (!head->region->finished(*head->copy)) return;
    try {
      head->request = comm.connection->isend(head->hostData, head->size);
    } catch (const Error&) {
      if (!comm.connection->error().empty()) throw;
      return;  // too many in flight: the next test() tries again
    }
    comm.staging.pop_front();
  }
}

Nvl::Region* gpuRegion(void* mhandle) {
  return mhandle == nullptr ? nullptr : static_cast<MemoryRegion*>(mhandle)->gpu.get();
}

// The registration to pass with [data, data + size), or nullptr. Host memory
// outside its handle's registration is simply staged; device memory cannot
// be, so that is an error.
const MemoryRegistration* registrationFor(void* mhandle, const void* data, size_t size) {
  if (mhandle == nullptr) return nullptr;
  const MemoryRegistration* registration = static_cast<MemoryRegion*>(mhandle)->registration.get();
  if (registration == nullptr) return nullptr;
  if (size == 0 || registration->covers(reinterpret_cast<uint64_t>(data), size))
    return registration;
  if (registration->hostAccessible()) return nullptr;
  throw ConfigError("GPU buffer [" + std::to_string(reinterpret_cast<uint64_t>(data)) + ", +" +
                    std::to_string(size) + ") lies outside the memory handle's registration [" +
                    std::to_string(registration->address()) + ", +" +
                    std::to_string(registration->bytes()) + ")");
}

// NCCL calls connect() again with the same handle until it returns a comm; the
// pending connection rides in the handle's unused tail, as NCCL's own socket
// transport keeps its connection stage in the handle.
constexpr size_t kPendingMarkerOffset = 112;
constexpr size_t kPendingPointerOffset = 120;
constexpr uint64_t kPendingMarker = 0x474E494E45505243ull;  // "CRPENING"
static_assert(kPendingPointerOffset + sizeof(void*) <= RECCL_NCCL_NET_HANDLE_MAXSIZE, "tail fits");
static_assert(kPendingMarkerOffset >= kHandleWireBytes, "the tail lies after the encoded handle");

}  // namespace

NetPlugin& NetPlugin::instance() {
  static NetPlugin* plugin = new NetPlugin();  // leaked: NCCL may call it during exit
  return *plugin;
}

void NetPlugin::warn(const std::string& message) {
  if (logger_ != nullptr) {
    logger_(NCCL_LOG_WARN, RECCL_NCCL_NET_LOG_FLAG, __FILE__, __LINE__, "ReCCL: %s",
            message.c_str());
  } else {
    RECCL_LOG(kWarn, message);
  }
}

void NetPlugin::info(const std::string& message) {
  if (logger_ != nullptr) {
    logger_(NCCL_LOG_INFO, RECCL_NCCL_NET_LOG_FLAG, __FILE__, __LINE__, "ReCCL: %s",
            message.c_str());
  }
}

Transport* NetPlugin::transport() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!transport_) throw Error("plugin used before init()");
  return transport_.get();
}

ncclResult_t NetPlugin::init(ncclDebugLogger_t logger) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (logger != nullptr) logger_ = logger;
  if (transport_) return ncclSuccess;  // NCCL calls init once per communicator
  try {
    Config config = Config::fromProcessEnv();
    config.applyLogLevel();
    // NCCL's buffers may be device or driver-mapped memory another process
    // cannot read, and NCCL moves same-host traffic over P2P/SHM itself.
    config.sameHostReads = false;
    // NCCL runs two or more channels per NIC, a connection each: two data
    // sockets per path fill the NIC, more only add flows into its queue, and
    // losses there with them (docs/transport.md).
    if (config.socketsPerPath == 0) config.socketsPerPath = kPluginDataSockets;
    transport_ = makeTransport(config, verbs_);
    const bool ib = std::string(transport_->kind()) == "ib";
    std::string nics;
    for (const auto& nic : transport_->nics()) {
      names_.push_back(nic.name);
      nics += " " + nic.name + "(" + (ib ? "bootstrap " : "") + nic.address + ", backup " +
              (nic.backup >= 0 ? transport_->nics()[nic.backup].name : std::string("none")) + ")";
    }
    info(std::string("failover net plugin over ") + transport_->kind() + " using" + nics);
    std::vector<int> healthIds;
    for (size_t nic = 0; nic < transport_->nics().size(); ++nic) {
      healthIds.push_back(transport_->healthId(static_cast<int>(nic)));
    }
    // GPU memory is claimed only where a NIC can really register it: by
    // dma-buf where the NICs and the GPUs both support it, or by pointer where
    // a peer-memory module is loaded (as NCCL decides).
    std::shared_ptr<CudaApi> cuda = cuda_;
    if (transport_->supportsDmaBuf(&dmaBufWhy_)) {
      std::string why;
      if (!cuda) cuda = CudaDriver::load(&why);
      try {
        dmaBuf_ = cuda && cuda->supportsDmaBuf(&why);
      } catch (const Error& error) {
        why = error.what();
      }
      if (!dmaBuf_) dmaBufWhy_ = "the GPUs cannot export dma-bufs: " + why;
    }
    peerMemory_ = transport_->supportsPeerMemory(&peerMemoryWhy_);
    info(dmaBuf_ ? std::string("GPUDirect RDMA by dma-buf registration: GPU buffers are written "
                               "by the NIC directly (unverified on hardware, docs/ib.md)")
                 : "no dma-buf GPUDirect: " + dmaBufWhy_);
    info(peerMemory_ ? std::string("GPUDirect RDMA by GPU pointer (peer memory)")
                     : "no GPUDirect by GPU pointer: " + peerMemoryWhy_);
    std::string why;
    nvl_ = Nvl::create(config, transport_->nics(), std::move(healthIds), cuda, &why);
    if (nvl_) {
      info("RECCL_NVL=on: GPU buffers staged in reccl's own CUDA contexts (docs/nvl.md); " +
           nvl_->describe());
    } else {
      info(std::string(dmaBuf_ || peerMemory_ ? "NVL off: " : "NVL off, host buffers only: ") +
           why);
    }
    return ncclSuccess;
  } catch (const std::exception& error) {
    std::string message = std::string("ReCCL plugin disabled: ") + error.what();
    if (logger_ != nullptr) {
      logger_(NCCL_LOG_WARN, RECCL_NCCL_NET_LOG_FLAG, __FILE__, __LINE__, "%s", message.c_str());
    } else {
      RECCL_LOG(kWarn, message);
    }
    return ncclInternalError;
  }
}

void NetPlugin::useVerbs(std::shared_ptr<VerbsApi> verbs) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (transport_) {
    throw Error(std::string("the plugin already runs over ") + transport_->kind() +
                "; install a verbs provider before its init()");
  }
  verbs_ = std::move(verbs);
}

void NetPlugin::useCuda(std::shared_ptr<CudaApi> cuda) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (transport_)
    throw Error("the plugin is already initialised; install a CUDA emulation before its init()");
  cuda_ = std::move(cuda);
}

std::string NetPlugin::transportKind() {
  std::lock_guard<std::mutex> lock(mutex_);
  return transport_ ? transport_->kind() : "";
}

ncclResult_t NetPlugin::devices(int* count) {
  return guard("devices", [&] {
    *count = static_cast<int>(transport()->nics().size());
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::properties(int dev, NetDeviceProps* props) {
  return guard("getProperties", [&] {
    Transport* t = transport();
    if (dev < 0 || dev >= static_cast<int>(t->nics().size())) {
      warn("getProperties: device " + std::to_string(dev) + " out of range");
      return ncclInvalidArgument;
    }
    const NicInfo& nic = t->nics()[dev];
    props->name = names_[dev].c_str();
    props->pciPath = nic.pciPath.empty() ? nullptr : nic.pciPath.c_str();
    props->guid = static_cast<uint64_t>(dev);
    props->speedMbps = nic.speedMbps;
    props->ptrSupport = RECCL_NCCL_PTR_HOST |
                        (nvl_ || dmaBuf_ || peerMemory_ ? RECCL_NCCL_PTR_CUDA : 0) |
                        (dmaBuf_ ? RECCL_NCCL_PTR_DMABUF : 0);
    props->maxComms = 65536;
    props->maxRecvs = kMaxRecvs;
    props->maxTransferBytes = kMaxTransferBytes;
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::listen(int dev, void* handle, void** listenComm) {
  return guard("listen", [&] {
    auto listener = transport()->listen(dev);
    const std::vector<uint8_t>& bytes = listener->handle();
    std::memset(handle, 0, RECCL_NCCL_NET_HANDLE_MAXSIZE);
    std::memcpy(handle, bytes.data(), std::min<size_t>(bytes.size(), kPendingMarkerOffset));
    *listenComm = new ListenComm{std::move(listener)};
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::connect(int dev, void* handle, void** sendComm) {
  return guard("connect", [&] {
    *sendComm = nullptr;
    auto* bytes = static_cast<uint8_t*>(handle);
    uint64_t marker = 0;
    std::memcpy(&marker, bytes + kPendingMarkerOffset, sizeof(marker));
    SendComm* pending = nullptr;
    if (marker == kPendingMarker) {
      std::memcpy(&pending, bytes + kPendingPointerOffset, sizeof(pending));
    } else {
      std::vector<uint8_t> wire(bytes, bytes + kPendingMarkerOffset);
      wire.resize(RECCL_NCCL_NET_HANDLE_MAXSIZE, 0);
      pending = new SendComm{transport()->connect(dev, wire), {}};
      std::memcpy(bytes + kPendingMarkerOffset, &kPendingMarker, sizeof(kPendingMarker));
      std::memcpy(bytes + kPendingPointerOffset, &pending, sizeof(pending));
    }
    if (pending->connection->ready()) {
      std::memset(bytes + kPendingMarkerOffset, 0, sizeof(kPendingMarker));
      RECCL_LOG(kTrace, "plugin connect dev " + std::to_string(dev) + ": connection " +
                            std::to_string(pending->connection->id()));
      *sendComm = pending;
      return ncclSuccess;
    }
    std::string error = pending->connection->error();
    if (!error.empty()) {
      std::memset(bytes + kPendingMarkerOffset, 0, sizeof(kPendingMarker));
      delete pending;
      warn("connect failed: " + error);
      return ncclSystemError;
    }
    return ncclSuccess;  // not yet: NCCL calls again
  });
}

ncclResult_t NetPlugin::accept(void* listenComm, void** recvComm) {
  return guard("accept", [&] {
    auto* listen = static_cast<ListenComm*>(listenComm);
    auto connection = listen->listener->accept(Millis(0));
    if (connection) {
      RECCL_LOG(kTrace, "plugin accept nic " + std::to_string(listen->listener->nic()) +
                            ": connection " + std::to_string(connection->id()));
    }
    *recvComm = connection ? new RecvComm{std::move(connection)} : nullptr;
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::regMr(void*, void* data, size_t size, int type, void** mhandle) {
  return guard("regMr", [&] {
    *mhandle = nullptr;
    Transport* t = transport();
    auto region = std::make_unique<MemoryRegion>();
    if (type == RECCL_NCCL_PTR_HOST) {
      // IB: registered on every device for direct placement; TCP: nothing.
      // A refusal (e.g. RLIMIT_MEMLOCK) only costs the zero copy: staged then.
      try {
        if (size > 0) region->registration = t->registerMemory(data, size);
      } catch (const Error& error) {
        warn(std::string("regMr: host buffer not registered, it will be staged: ") + error.what());
      }
      *mhandle = region.release();
      return ncclSuccess;
    }
    if (type != RECCL_NCCL_PTR_CUDA || (!nvl_ && !dmaBuf_ && !peerMemory_)) {
      const bool ib = std::string(t->kind()) == "ib";
      warn("regMr: memory type " + std::to_string(type) + " is not supported; valid: host" +
           (nvl_ || dmaBuf_ || peerMemory_
                ? std::string(", cuda")
                : " (GPU buffers need RECCL_NVL)" +
                      (ib ? "; no GPUDirect: " + dmaBufWhy_ + "; " + peerMemoryWhy_
                          : std::string())));
      return ncclInternalError;
    }
    // A GPU buffer NCCL could not give us as a dma-buf: GPUDirect by pointer
    // (peer memory) first, as GDR wins over NVL; NVL where that is refused.
    std::string peerError = peerMemoryWhy_;
    if (peerMemory_) {
      try {
        region->registration = t->registerDeviceMemory(data, size);
      } catch (const Error& error) {
        peerError = error.what();
      }
    }
    if (!region->registration) {
      if (!nvl_) {
        warn("regMr: GPU buffer without dma-buf: " + peerError);
        return ncclInternalError;
      }
      if (!peerError.empty()) info("regMr: GPU buffer staged by NVL: " + peerError);
      region->gpu = nvl_->registerRegion(data, size);
    }
    *mhandle = region.release();
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::regMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t offset,
                                    int fd, void** mhandle) {
  if (fd < 0) return regMr(comm, data, size, type, mhandle);  // NCCL: no dma-buf for this one
  return guard("regMrDmaBuf", [&] {
    *mhandle = nullptr;
    Transport* t = transport();
    if (!dmaBuf_) {
      warn("regMrDmaBuf: dma-buf registration is not supported: " + dmaBufWhy_);
      return ncclInternalError;
    }
    if (type != RECCL_NCCL_PTR_CUDA && type != RECCL_NCCL_PTR_HOST) {
      warn("regMrDmaBuf: memory type " + std::to_string(type) +
           " is not supported; valid: host, cuda");
      return ncclInternalError;
    }
    auto region = std::make_unique<MemoryRegion>();
    region->registration = t->registerDmaBuf(fd, offset, size, reinterpret_cast<uint64_t>(data));
    *mhandle = region.release();
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::deregMr(void*, void* mhandle) {
  delete static_cast<MemoryRegion*>(mhandle);
  return ncclSuccess;
}

ncclResult_t NetPlugin::isend(void* sendComm, void* data, size_t size, void* mhandle,
                              void** request) {
  return guard("isend", [&] {
    auto* comm = static_cast<SendComm*>(sendComm);
    *request = nullptr;
    Nvl::Region* region = gpuRegion(mhandle);
    uint8_t* bytes = static_cast<uint8_t*>(data);
    if (region != nullptr) {
      // Queue the copy to the host and return: the connection gets the bytes
      // from test() once they are there, so the proxy thread never waits.
      std::optional<DeviceStager::Transfer> copy =
          region->startSend(bytes, size, comm->connection->activeLocalNic());
      if (!copy) return ncclSuccess;  // every copy slot busy: NCCL retries
      auto* pending = new PluginRequest();
      pending->phase = RequestPhase::kStagingToHost;
      pending->region = region;
      pending->copy = *copy;
      pending->sendComm = comm;
      pending->hostData = region->hostCopy(bytes, size, "isend");
      pending->size = size;
      comm->staging.push_back(pending);
      *request = pending;
      RECCL_LOG(kTrace, "plugin isend connection " + std::to_string(comm->connection->id()) +
                            " bytes " + std::to_string(size) + " staged from GPU " +
                            std::to_string(region->gpu()));
      postStagedSends(*comm);
      return ncclSuccess;
    }
    const MemoryRegistration* registration = registrationFor(mhandle, data, size);
    try {
      auto sent = comm->connection->isend(bytes, size, registration);
      RECCL_LOG(kTrace, "plugin isend connection " + std::to_string(comm->connection->id()) +
                            " seq " + std::to_string(sent->seq()) + " bytes " +
                            std::to_string(size));
      auto* pending = new PluginRequest();
      pending->request = std::move(sent);
      *request = pending;
    } catch (const Error&) {
      // Too many in flight: a NULL request tells NCCL to retry later. A failed
      // connection says so through error().
      if (!comm->connection->error().empty()) throw;
    }
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::irecv(void* recvComm, int n, void** data, const size_t* sizes,
                              void** mhandles, void** request) {
  return guard("irecv", [&] {
    if (n != kMaxRecvs) {
      warn("irecv: " + std::to_string(n) + " grouped receives; this plugin reports maxRecvs=1");
      return ncclInvalidArgument;
    }
    auto* comm = static_cast<RecvComm*>(recvComm);
    *request = nullptr;
    Nvl::Region* region = gpuRegion(mhandles == nullptr ? nullptr : mhandles[0]);
    uint8_t* bytes = static_cast<uint8_t*>(data[0]);
    if (region != nullptr) bytes = region->hostCopy(bytes, sizes[0], "irecv");
    const MemoryRegistration* registration =
        region ? nullptr
               : registrationFor(mhandles == nullptr ? nullptr : mhandles[0], data[0], sizes[0]);
    try {
      auto posted = comm->connection->irecv(bytes, sizes[0], registration);
      RECCL_LOG(kTrace,
                "plugin irecv connection " + std::to_string(comm->connection->id()) + " seq " +
                    std::to_string(posted->seq()) + " bytes " + std::to_string(sizes[0]) +
                    (region ? " into GPU " + std::to_string(region->gpu()) : std::string()));
      auto* pending = new PluginRequest();
      pending->request = std::move(posted);
      if (region != nullptr) {
        pending->region = region;
        pending->deviceData = static_cast<uint8_t*>(data[0]);
        pending->connection = comm->connection;
      }
      *request = pending;
    } catch (const Error&) {
      if (!comm->connection->error().empty()) throw;
    }
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::iflush(void* recvComm, int n, void** data, const int* sizes,
                               void** mhandles, void** request) {
  // Host memory needs no flush, and an NVL-staged GPU receive completes only
  // after its copy into the GPU buffer finished. A receive the NIC placed in
  // GPU memory gets what NCCL's own IB transport does: a 1-byte RDMA READ from
  // the buffer over a loopback QP on each NIC that wrote part of it, done here (bounded)
  // before NCCL lets the kernel read (docs/ib.md: unverified on hardware).
  return guard("iflush", [&] {
    *request = nullptr;
    if (data == nullptr || sizes == nullptr || mhandles == nullptr) return ncclSuccess;
    auto* comm = static_cast<RecvComm*>(recvComm);
    // Every NIC that placed data since the last flush: after a failover in the
    // middle of a receive, the old NIC's writes need ordering too.
    const uint64_t writers = comm->connection->takePlacedNics();
    for (int i = 0; i < n; ++i) {
      if (sizes[i] <= 0) continue;
      const size_t size = static_cast<size_t>(sizes[i]);
      const MemoryRegistration* registration = registrationFor(mhandles[i], data[i], size);
      if (registration == nullptr || registration->hostAccessible()) continue;
      transport()->flushDeviceWrites(*registration, reinterpret_cast<uint64_t>(data[i]), writers);
    }
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::test(void* request, int* done, int* sizes) {
  return guard("test", [&] {
    auto* pending = static_cast<PluginRequest*>(request);
    *done = 0;
    if (pending->phase == RequestPhase::kStagingToHost) {
      if (pending->request == nullptr) postStagedSends(*pending->sendComm);
      if (pending->request == nullptr)
        return ncclSuccess;  // its copy, or an earlier one, still runs
      pending->phase = RequestPhase::kOnTransport;
    }
    if (pending->phase == RequestPhase::kOnTransport) {
      std::string error;
      if (!pending->request->test(&pending->bytes, &error)) return ncclSuccess;
      if (!error.empty()) {
        delete pending;
        warn("operation failed: " + error);
        return ncclRemoteError;
      }
      if (pending->deviceData != nullptr) pending->phase = RequestPhase::kDeliveringToGpu;
    }
    if (pending->phase == RequestPhase::kDeliveringToGpu) {
      if (!pending->copy) {
        pending->copy = pending->region->startDeliver(pending->deviceData, pending->bytes,
                                                      pending->connection->activeLocalNic());
        if (!pending->copy)
          return ncclSuccess;  // every copy slot busy: the next test() tries again
      }
      if (!pending->region->finished(*pending->copy)) return ncclSuccess;
    }
    *done = 1;
    if (sizes != nullptr) *sizes = static_cast<int>(pending->bytes);
    delete pending;
    return ncclSuccess;
  });
}

ncclResult_t NetPlugin::closeSend(void* sendComm) {
  auto* comm = static_cast<SendComm*>(sendComm);
  comm->connection->close();
  delete comm;
  return ncclSuccess;
}

ncclResult_t NetPlugin::closeRecv(void* recvComm) {
  auto* comm = static_cast<RecvComm*>(recvComm);
  comm->connection->close();
  delete comm;
  return ncclSuccess;
}

ncclResult_t NetPlugin::closeListen(void* listenComm) {
  auto* comm = static_cast<ListenComm*>(listenComm);
  comm->listener->close();
  delete comm;
  return ncclSuccess;
}

}  // namespace reccl
