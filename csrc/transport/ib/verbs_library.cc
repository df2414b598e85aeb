#include "transport/ib/verbs_library.h"

#if __has_include(<infiniband/verbs.h>)
#define RECCL_HAVE_VERBS_HEADERS 1
#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#endif

#include "core/error.h"
#include "core/log.h"

namespace reccl {

bool needsForkInit(ForkState state, const char* rdmavForkSafe, const char* ibvForkSafe) {
  if (rdmavForkSafe != nullptr || ibvForkSafe != nullptr) return false;
  return state == ForkState::kUnknown || state == ForkState::kDisabled;
}

#ifdef RECCL_HAVE_VERBS_HEADERS

namespace {

// The ibv_* entry points we call by symbol. post_send, post_recv, poll_cq and
// req_notify_cq are inline in the header (they go through the context's ops
// table).
struct Functions {
  void* handle = nullptr;
  decltype(&::ibv_get_device_list) getDeviceList = nullptr;
  decltype(&::ibv_free_device_list) freeDeviceList = nullptr;
  decltype(&::ibv_get_device_name) getDeviceName = nullptr;
  decltype(&::ibv_open_device) openDevice = nullptr;
  decltype(&::ibv_close_device) closeDevice = nullptr;
  decltype(&::ibv_alloc_pd) allocPd = nullptr;
  decltype(&::ibv_dealloc_pd) deallocPd = nullptr;
  decltype(&::ibv_reg_mr) regMr = nullptr;
  decltype(&::ibv_dereg_mr) deregMr = nullptr;
  decltype(&::ibv_create_cq) createCq = nullptr;
  decltype(&::ibv_destroy_cq) destroyCq = nullptr;
  decltype(&::ibv_create_comp_channel) createCompChannel = nullptr;
  decltype(&::ibv_destroy_comp_channel) destroyCompChannel = nullptr;
  decltype(&::ibv_get_cq_event) getCqEvent = nullptr;
  decltype(&::ibv_ack_cq_events) ackCqEvents = nullptr;
  decltype(&::ibv_create_qp) createQp = nullptr;
  decltype(&::ibv_modify_qp) modifyQp = nullptr;
  decltype(&::ibv_destroy_qp) destroyQp = nullptr;
  decltype(&::ibv_query_port) queryPort = nullptr;
  decltype(&::ibv_query_gid) queryGid = nullptr;
  decltype(&::ibv_get_async_event) getAsyncEvent = nullptr;
  decltype(&::ibv_ack_async_event) ackAsyncEvent = nullptr;
  // Optional (rdma-core v34+): typed here, so older headers build too.
  using RegDmaBufMr = ibv_mr* (*)(ibv_pd*, uint64_t offset, size_t length, uint64_t iova, int fd,
                                  int access);
  RegDmaBufMr regDmaBufMr = nullptr;
  // Optional (rdma-core v29+): what ibv_reg_mr becomes with optional access flags.
  using RegMrIova2 = ibv_mr* (*)(ibv_pd*, void* address, size_t length, uint64_t iova,
                                 unsigned int access);
  RegMrIova2 regMrIova2 = nullptr;
  // Optional (rdma-core v30+): _ibv_query_gid_table / _ibv_query_gid_ex, the
  // symbols behind the inline ibv_query_gid_table / ibv_query_gid_ex.
  using QueryGidTable = ssize_t (*)(ibv_context*, void* entries, size_t maxEntries, uint32_t flags,
                                    size_t entrySize);
  using QueryGidEx = int (*)(ibv_context*, uint32_t port, uint32_t index, void* entry,
                             uint32_t flags, size_t entrySize);
  QueryGidTable queryGidTable = nullptr;
  QueryGidEx queryGidEx = nullptr;

  ~Functions() {
    if (handle != nullptr) dlclose(handle);
  }
};

template <typename T>
bool bind(void* handle, const char* name, T* out, std::string* missing) {
  *out = reinterpret_cast<T>(dlsym(handle, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

std::string errnoText(const char* call, int code) {
  return std::string(call) + " failed: " + std::strerror(code);
}

WcStatus statusOf(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return WcStatus::kSuccess;
    case IBV_WC_LOC_LEN_ERR: return WcStatus::kLocalLengthError;
    case IBV_WC_LOC_PROT_ERR: return WcStatus::kLocalProtection;
    case IBV_WC_WR_FLUSH_ERR: return WcStatus::kFlushed;
    case IBV_WC_REM_ACCESS_ERR: return WcStatus::kRemoteAccess;
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_INV_REQ_ERR: return WcStatus::kRemoteOperation;
    case IBV_WC_RETRY_EXC_ERR: return WcStatus::kRetryExceeded;
    case IBV_WC_RNR_RETRY_EXC_ERR: return WcStatus::kRnrRetryExceeded;
    default: return WcStatus::kOther;
  }
}

WcOpcode opcodeOf(ibv_wc_opcode opcode) {
  switch (opcode) {
    case IBV_WC_SEND: return WcOpcode::kSend;
    case IBV_WC_RDMA_WRITE: return WcOpcode::kRdmaWrite;
    case IBV_WC_RDMA_READ: return WcOpcode::kRdmaRead;
    case IBV_WC_RECV: return WcOpcode::kRecv;
    case IBV_WC_RECV_RDMA_WITH_IMM: return WcOpcode::kRecvRdmaWithImm;
    default: return WcOpcode::kOther;
  }
}

// struct ibv_gid_entry (rdma-core v30+), spelled out so older headers build.
struct GidTableEntry {
  uint8_t gid[16];
  uint32_t gidIndex;
  uint32_t portNumber;
  uint32_t gidType;  // enum ibv_gid_type: 0 IB, 1 RoCE v1, 2 RoCE v2
  uint32_t netdevIndex;
};
static_assert(sizeof(GidTableEntry) == 32, "ibv_gid_entry's size, which the library is told");

GidType gidTypeOf(uint32_t type) {
  switch (type) {
    case 0: return GidType::kIb;
    case 1: return GidType::kRoceV1;
    case 2: return GidType::kRoceV2;
    default: return GidType::kUnknown;
  }
}

class SystemMemoryRegion : public VerbsMemoryRegion {
 public:
  SystemMemoryRegion(std::shared_ptr<Functions> fn, ibv_mr* mr) : fn_(std::move(fn)), mr_(mr) {}
  ~SystemMemoryRegion() override { fn_->deregMr(mr_); }
  uint32_t lkey() const override { return mr_->lkey; }
  uint32_t rkey() const override { return mr_->rkey; }

 private:
  std::shared_ptr<Functions> fn_;
  ibv_mr* mr_;
};

class SystemCompletionQueue : public VerbsCompletionQueue {
 public:
  explicit SystemCompletionQueue(std::shared_ptr<Functions> fn) : fn_(std::move(fn)) {}
  ~SystemCompletionQueue() override {
    if (cq_ != nullptr) fn_->destroyCq(cq_);
  }
  // Set once ibv_create_cq returned: the CQ's context (what ibv_get_cq_event
  // hands back) is this object, so it exists before the CQ.
  void attach(ibv_cq* cq) { cq_ = cq; }
  int poll(WorkCompletion* out, int max) override {
    ibv_wc wcs[32];
    int got = ibv_poll_cq(cq_, std::min(max, 32), wcs);
    if (got < 0) throw Error("ibv_poll_cq failed (returned " + std::to_string(got) + ")");
    for (int i = 0; i < got; ++i) {
      WorkCompletion& wc = out[i];
      wc.wrId = wcs[i].wr_id;
      wc.status = statusOf(wcs[i].status);
      wc.opcode = opcodeOf(wcs[i].opcode);
      wc.byteLength = wcs[i].byte_len;
      wc.hasImmediate = (wcs[i].wc_flags & IBV_WC_WITH_IMM) != 0;
      wc.immediate = wc.hasImmediate ? ntohl(wcs[i].imm_data) : 0;
      wc.vendorError = wcs[i].vendor_err;
      wc.qpNumber = wcs[i].qp_num;
    }
    return got;
  }
  void requestNotify() override {
    int rc = ibv_req_notify_cq(cq_, 0);
    if (rc != 0) throw Error(errnoText("ibv_req_notify_cq", rc));
  }
  ibv_cq* get() const { return cq_; }

 private:
  std::shared_ptr<Functions> fn_;
  ibv_cq* cq_;
};

class SystemCompletionChannel : public VerbsCompletionChannel {
 public:
  SystemCompletionChannel(std::shared_ptr<Functions> fn, ibv_comp_channel* channel)
      : fn_(std::move(fn)), channel_(channel) {}
  ~SystemCompletionChannel() override { fn_->destroyCompChannel(channel_); }
  int fd() const override { return channel_->fd; }
  VerbsCompletionQueue* takeEvent() override {
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    // The fd is non-blocking: EAGAIN when no event waits.
    if (fn_->getCqEvent(channel_, &cq, &context) != 0) return nullptr;
    fn_->ackCqEvents(cq, 1);
    return static_cast<SystemCompletionQueue*>(context);
  }
  ibv_comp_channel* get() const { return channel_; }

 private:
  std::shared_ptr<Functions> fn_;
  ibv_comp_channel* channel_;
};

class SystemQueuePair : public VerbsQueuePair {
 public:
  SystemQueuePair(std::shared_ptr<Functions> fn, ibv_qp* qp) : fn_(std::move(fn)), qp_(qp) {}
  ~SystemQueuePair() override { fn_->destroyQp(qp_); }
  uint32_t qpNumber() const override { return qp_->qp_num; }

  void toInit(int port) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = static_cast<uint8_t>(port);
    attr.qp_access_flags =
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    modify(&attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
  }
  void toReadyToReceive(const QpPeer& peer, int port, int gidIndex, int mtu,
                        const QpRoute& route) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = static_cast<ibv_mtu>(mtu);
    attr.dest_qp_num = peer.qpNumber;
    attr.rq_psn = peer.packetSequence;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = 12;
    attr.ah_attr.dlid = peer.lid;
    attr.ah_attr.port_num = static_cast<uint8_t>(port);
    attr.ah_attr.sl = route.serviceLevel;
    if (peer.global) {
      attr.ah_attr.is_global = 1;
      std::memcpy(attr.ah_attr.grh.dgid.raw, peer.gid.data(), 16);
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(gidIndex);
      attr.ah_attr.grh.hop_limit = 255;
      attr.ah_attr.grh.traffic_class = route.trafficClass;
    }
    modify(&attr,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
           "RTR");
  }
  void toReadyToSend(uint32_t packetSequence, int timeout, int retryCount) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = packetSequence;
    attr.timeout = static_cast<uint8_t>(timeout);
    attr.retry_cnt = static_cast<uint8_t>(retryCount);
    attr.rnr_retry = 7;  // unbounded: a control SEND waits for the peer to repost
    attr.max_rd_atomic = 1;
    modify(&attr,
           IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
               IBV_QP_MAX_QP_RD_ATOMIC,
           "RTS");
  }
  void toError() override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    modify(&attr, IBV_QP_STATE, "ERR");
  }
  bool postSend(const SendRequest& request, std::string* error) override {
    ibv_sge sge{request.sge.address, request.sge.length, request.sge.lkey};
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    wr.wr_id = request.wrId;
    wr.sg_list = &sge;
    wr.num_sge = request.sge.length > 0 ? 1 : 0;
    wr.send_flags = request.signaled ? IBV_SEND_SIGNALED : 0;
    switch (request.op) {
      case SendRequest::Op::kSend: wr.opcode = IBV_WR_SEND; break;
      case SendRequest::Op::kWrite: wr.opcode = IBV_WR_RDMA_WRITE; break;
      case SendRequest::Op::kWriteWithImmediate:
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(request.immediate);
        break;
      case SendRequest::Op::kRead: wr.opcode = IBV_WR_RDMA_READ; break;
    }
    wr.wr.rdma.remote_addr = request.remoteAddress;
    wr.wr.rdma.rkey = request.rkey;
    int rc = ibv_post_send(qp_, &wr, &bad);
    if (rc != 0) *error = errnoText("ibv_post_send", rc);
    return rc == 0;
  }
  bool postRecv(const RecvRequest& request, std::string* error) override {
    ibv_sge sge{request.sge.address, request.sge.length, request.sge.lkey};
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = request.wrId;
    wr.sg_list = &sge;
    wr.num_sge = request.sge.length > 0 ? 1 : 0;
    int rc = ibv_post_recv(qp_, &wr, &bad);
    if (rc != 0) *error = errnoText("ibv_post_recv", rc);
    return rc == 0;
  }

 private:
  void modify(ibv_qp_attr* attr, int mask, const char* state) {
    int rc = fn_->modifyQp(qp_, attr, mask);
    if (rc == 0) return;
    const std::string what = std::string("ibv_modify_qp to ") + state + ": " + std::strerror(rc);
    if (rc == ETIMEDOUT) throw ModifyQpTimedOut(what);
    throw Error(what);
  }

  std::shared_ptr<Functions> fn_;
  ibv_qp* qp_;
};

class SystemDevice : public VerbsDevice {
 public:
  SystemDevice(std::shared_ptr<Functions> fn, std::string name, ibv_context* context, ibv_pd* pd)
      : fn_(std::move(fn)),
        name_(std::move(name)),
        context_(context),
        pd_(pd),
        interrupt_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (interrupt_ < 0) {
      const int error = errno;
      fn_->deallocPd(pd_);
      fn_->closeDevice(context_);
      throw Error("eventfd for " + name_ + "'s async events: " + std::strerror(error));
    }
  }
  ~SystemDevice() override {
    ::close(interrupt_);
    fn_->deallocPd(pd_);
    fn_->closeDevice(context_);
  }
  SystemDevice(const SystemDevice&) = delete;
  SystemDevice& operator=(const SystemDevice&) = delete;
  std::string name() const override { return name_; }
  std::string pciPath() const override {
    char resolved[PATH_MAX];
    const std::string link = "/sys/class/infiniband/" + name_ + "/device";
    return ::realpath(link.c_str(), resolved) != nullptr ? std::string(resolved) : std::string();
  }

  PortAttributes queryPort(int port) override {
    ibv_port_attr attr{};
    int rc = fn_->queryPort(context_, static_cast<uint8_t>(port),
                            reinterpret_cast<_compat_ibv_port_attr*>(&attr));
    if (rc != 0) throw Error(errnoText("ibv_query_port", rc));
    PortAttributes out;
    out.active = attr.state == IBV_PORT_ACTIVE;
    out.ethernet = attr.link_layer == IBV_LINK_LAYER_ETHERNET;
    out.lid = attr.lid;
    out.activeMtu = attr.active_mtu;
    out.gidTableLength = attr.gid_tbl_len;
    out.speedMbps = portSpeedMbps(attr.active_speed, attr.active_width);
    return out;
  }
  bool queryGidTable(int port, std::vector<GidEntry>* out, std::string* why) override {
    if (fn_->queryGidTable == nullptr) {
      *why = "libibverbs.so.1 has no ibv_query_gid_table (rdma-core older than v30)";
      return false;
    }
    std::vector<GidTableEntry> entries(
        static_cast<size_t>(std::max(queryPort(port).gidTableLength, 1)) *
        4);  // every port's entries come back
    const ssize_t count =
        fn_->queryGidTable(context_, entries.data(), entries.size(), 0, sizeof(GidTableEntry));
    if (count < 0) {
      *why = errnoText("ibv_query_gid_table", static_cast<int>(-count));
      return false;
    }
    for (ssize_t i = 0; i < count; ++i) {
      if (entries[i].portNumber != static_cast<uint32_t>(port)) continue;
      GidEntry entry;
      std::memcpy(entry.gid.data(), entries[i].gid, 16);
      entry.type = gidTypeOf(entries[i].gidType);
      entry.index = static_cast<int>(entries[i].gidIndex);
      out->push_back(entry);
    }
    return true;
  }
  GidEntry queryGid(int port, int index) override {
    GidEntry entry;
    entry.index = index;
    if (fn_->queryGidEx != nullptr) {
      GidTableEntry raw{};
      const int rc = fn_->queryGidEx(context_, static_cast<uint32_t>(port),
                                     static_cast<uint32_t>(index), &raw, 0, sizeof(raw));
      if (rc == ENODATA) return entry;  // an empty entry: all-zero, unused
      if (rc != 0) throw Error(errnoText("ibv_query_gid_ex", rc));
      std::memcpy(entry.gid.data(), raw.gid, 16);
      entry.type = gidTypeOf(raw.gidType);
      return entry;
    }
    ibv_gid gid{};
    int rc = fn_->queryGid(context_, static_cast<uint8_t>(port), index, &gid);
    if (rc != 0) throw Error(errnoText("ibv_query_gid", rc));
    std::memcpy(entry.gid.data(), gid.raw, 16);
    // The GID type lives in sysfs ("IB/RoCE v1" or "RoCE v2"); where sysfs
    // does not say (hidden in a container) it stays kUnknown, never chosen.
    std::ifstream type("/sys/class/infiniband/" + name_ + "/ports/" + std::to_string(port) +
                       "/gid_attrs/types/" + std::to_string(index));
    std::string text;
    std::getline(type, text);
    if (text == "RoCE v2") {
      entry.type = GidType::kRoceV2;
    } else if (text == "IB/RoCE v1") {
      entry.type = GidType::kRoceV1;  // on an IB port every GID is IB: the type is not read there
    }
    return entry;
  }
  std::unique_ptr<VerbsMemoryRegion> registerMemory(void* address, size_t bytes, bool remoteWrite,
                                                    bool relaxedOrdering) override {
    int access = IBV_ACCESS_LOCAL_WRITE | (remoteWrite ? IBV_ACCESS_REMOTE_WRITE : 0);
    ibv_mr* mr = regMr(address, bytes, access, relaxedOrdering);
    if (mr == nullptr) throw Error(errnoText("ibv_reg_mr", errno));
    return std::make_unique<SystemMemoryRegion>(fn_, mr);
  }
  bool supportsRelaxedOrdering() const override { return fn_->regMrIova2 != nullptr; }
  std::unique_ptr<VerbsMemoryRegion> registerPeerMemory(void* address, size_t bytes,
                                                        bool relaxedOrdering) override {
    ibv_mr* mr = regMr(address, bytes,
                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
                       relaxedOrdering);
    if (mr == nullptr) {
      throw Error(errnoText("ibv_reg_mr of GPU memory", errno) +
                  " (needs the nvidia-peermem module, or use dma-buf)");
    }
    return std::make_unique<SystemMemoryRegion>(fn_, mr);
  }
  bool supportsDmaBuf(std::string* why) const override {
    if (fn_->regDmaBufMr == nullptr) {
      *why = "libibverbs.so.1 has no ibv_reg_dmabuf_mr (rdma-core older than v34)";
      return false;
    }
    // Probe with an invalid fd: a kernel or provider without dma-buf support
    // answers EOPNOTSUPP / EPROTONOSUPPORT, one with it EBADF.
    errno = 0;
    ibv_mr* probe = fn_->regDmaBufMr(pd_, 0, 0, 0, -1, 0);
    if (probe != nullptr) {
      fn_->deregMr(probe);
      return true;
    }
    if (errno == EOPNOTSUPP || errno == EPROTONOSUPPORT) {
      *why = name_ + ": the kernel driver does not support dma-buf registration (" +
             std::strerror(errno) + ")";
      return false;
    }
    return true;
  }
  std::unique_ptr<VerbsMemoryRegion> registerDmaBuf(int fd, uint64_t offset, size_t bytes,
                                                    uint64_t iova, bool relaxedOrdering) override {
    std::string why;
    if (!supportsDmaBuf(&why)) throw Error("dma-buf registration on " + name_ + ": " + why);
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (relaxedOrdering && supportsRelaxedOrdering()) access |= kRelaxedOrdering;
    ibv_mr* mr = fn_->regDmaBufMr(pd_, offset, bytes, iova, fd, access);
    if (mr == nullptr) throw Error(errnoText("ibv_reg_dmabuf_mr", errno));
    return std::make_unique<SystemMemoryRegion>(fn_, mr);
  }
  std::unique_ptr<VerbsCompletionChannel> createCompletionChannel() override {
    ibv_comp_channel* channel = fn_->createCompChannel(context_);
    if (channel == nullptr) throw Error(errnoText("ibv_create_comp_channel", errno));
    auto owned = std::make_unique<SystemCompletionChannel>(fn_, channel);
    // Served by an event loop: ibv_get_cq_event must never block it.
    const int flags = ::fcntl(channel->fd, F_GETFL);
    if (flags < 0 || ::fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) != 0) {
      throw Error(errnoText("fcntl(O_NONBLOCK) on a completion channel", errno));
    }
    return owned;
  }
  std::unique_ptr<VerbsCompletionQueue> createCompletionQueue(
      int depth, VerbsCompletionChannel* channel) override {
    ibv_comp_channel* events = nullptr;
    if (channel != nullptr) {
      auto* system = dynamic_cast<SystemCompletionChannel*>(channel);
      if (system == nullptr) throw Error("a completion channel of another provider");
      events = system->get();
    }
    auto owned = std::make_unique<SystemCompletionQueue>(fn_);
    ibv_cq* cq = fn_->createCq(context_, depth, owned.get(), events, 0);
    if (cq == nullptr) throw Error(errnoText("ibv_create_cq", errno));
    owned->attach(cq);
    return owned;
  }
  std::unique_ptr<VerbsQueuePair> createQueuePair(VerbsCompletionQueue* sendCq,
                                                  VerbsCompletionQueue* recvCq, int maxSend,
                                                  int maxRecv) override {
    auto* send = dynamic_cast<SystemCompletionQueue*>(sendCq);
    auto* recv = dynamic_cast<SystemCompletionQueue*>(recvCq);
    if (send == nullptr || recv == nullptr) throw Error("completion queues of another provider");
    ibv_qp_init_attr init{};
    init.send_cq = send->get();
    init.recv_cq = recv->get();
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = static_cast<uint32_t>(maxSend);
    init.cap.max_recv_wr = static_cast<uint32_t>(maxRecv);
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    ibv_qp* qp = fn_->createQp(pd_, &init);
    if (qp == nullptr) throw Error(errnoText("ibv_create_qp", errno));
    return std::make_unique<SystemQueuePair>(fn_, qp);
  }
  bool waitAsyncEvent(AsyncEvent* event, Millis timeout) override {
    pollfd fds[2] = {{context_->async_fd, POLLIN, 0}, {interrupt_, POLLIN, 0}};
    if (::poll(fds, 2, static_cast<int>(timeout.count())) <= 0) return false;
    if (fds[1].revents != 0 || (fds[0].revents & POLLIN) == 0)
      return false;  // interrupted (it stays readable)
    ibv_async_event raw{};
    if (fn_->getAsyncEvent(context_, &raw) != 0) return false;
    switch (raw.event_type) {
      case IBV_EVENT_PORT_ACTIVE: event->type = AsyncEventType::kPortActive; break;
      case IBV_EVENT_PORT_ERR: event->type = AsyncEventType::kPortError; break;
      case IBV_EVENT_GID_CHANGE: event->type = AsyncEventType::kGidChange; break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR: event->type = AsyncEventType::kQpFatal; break;
      case IBV_EVENT_DEVICE_FATAL: event->type = AsyncEventType::kDeviceFatal; break;
      case IBV_EVENT_CQ_ERR: event->type = AsyncEventType::kCqError; break;
      default: event->type = AsyncEventType::kOther; break;
    }
    bool portEvent = raw.event_type == IBV_EVENT_PORT_ACTIVE ||
                     raw.event_type == IBV_EVENT_PORT_ERR || raw.event_type == IBV_EVENT_GID_CHANGE;
    event->port = portEvent ? raw.element.port_num : 0;
    fn_->ackAsyncEvent(&raw);
    return true;
  }
  void interruptAsyncWait() override {
    const uint64_t one = 1;
    ssize_t written = ::write(interrupt_, &one, sizeof(one));
    (void)written;  // only fails when the counter is full: interrupted already
  }

 private:
  // IBV_ACCESS_RELAXED_ORDERING (IBV_ACCESS_OPTIONAL_FIRST), spelled out for older headers.
  static constexpr int kRelaxedOrdering = 1 << 20;

  // ibv_reg_mr as the header's macro makes it: with an optional flag it is
  // ibv_reg_mr_iova2 (iova = the address); the plain symbol would reject it.
  ibv_mr* regMr(void* address, size_t bytes, int access, bool relaxedOrdering) {
    if (relaxedOrdering && fn_->regMrIova2 != nullptr) {
      return fn_->regMrIova2(pd_, address, bytes, reinterpret_cast<uint64_t>(address),
                             static_cast<unsigned int>(access | kRelaxedOrdering));
    }
    return fn_->regMr(pd_, address, bytes, access);
  }

  std::shared_ptr<Functions> fn_;
  std::string name_;
  ibv_context* context_;
  ibv_pd* pd_;
  const int interrupt_;  // an eventfd: readable once interruptAsyncWait() ran
};

class SystemVerbs : public VerbsApi {
 public:
  explicit SystemVerbs(std::shared_ptr<Functions> fn) : fn_(std::move(fn)) {}
  std::string describe() const override { return "libibverbs.so.1"; }
  bool peerMemoryLoaded(std::string* why) const override {
    // Where NCCL looks too: the module's version file.
    for (const char* path :
         {"/sys/kernel/mm/memory_peers/nv_mem/version",
          "/sys/kernel/mm/memory_peers/nv_mem_nc/version", "/sys/module/nvidia_peermem/version"}) {
      if (::access(path, F_OK) == 0) return true;
    }
    *why = "no peer-memory module (nvidia-peermem: /sys/module/nvidia_peermem) is loaded";
    return false;
  }
  std::vector<std::string> deviceNames() override {
    std::vector<std::string> names;
    int count = 0;
    ibv_device** list = fn_->getDeviceList(&count);
    if (list == nullptr) return names;
    for (int i = 0; i < count; ++i) names.push_back(fn_->getDeviceName(list[i]));
    fn_->freeDeviceList(list);
    return names;
  }
  std::shared_ptr<VerbsDevice> open(const std::string& name) override {
    int count = 0;
    ibv_device** list = fn_->getDeviceList(&count);
    ibv_context* context = nullptr;
    bool found = false;
    std::string known;
    for (int i = 0; list != nullptr && i < count; ++i) {
      std::string candidate = fn_->getDeviceName(list[i]);
      known += (known.empty() ? "" : ", ") + candidate;
      if (candidate == name && !found) {
        found = true;
        context = fn_->openDevice(list[i]);
      }
    }
    int openError = errno;
    if (list != nullptr) fn_->freeDeviceList(list);
    if (context == nullptr) {
      if (!found) {
        throw ConfigError("no RDMA device '" + name +
                          "'; devices: " + (known.empty() ? "(none)" : known));
      }
      throw Error(errnoText("ibv_open_device", openError));
    }
    ibv_pd* pd = fn_->allocPd(context);
    if (pd == nullptr) {
      fn_->closeDevice(context);
      throw Error(errnoText("ibv_alloc_pd", errno));
    }
    return std::make_shared<SystemDevice>(fn_, name, context, pd);
  }

 private:
  std::shared_ptr<Functions> fn_;
};

// Before any other libibverbs call that allocates (ibv_fork_init's rule).
void initForkProtection(void* handle) {
  ForkState state = ForkState::kUnknown;
  // ibv_is_fork_initialized (rdma-core v35+) returns enum ibv_fork_status:
  // 0 disabled, 1 enabled, 2 unneeded; typed here so older headers build too.
  if (auto isForkInitialized =
          reinterpret_cast<int (*)()>(dlsym(handle, "ibv_is_fork_initialized"))) {
    const int status = isForkInitialized();
    state = status == 1   ? ForkState::kEnabled
            : status == 2 ? ForkState::kUnneeded
                          : ForkState::kDisabled;
  }
  if (!needsForkInit(state, std::getenv("RDMAV_FORK_SAFE"), std::getenv("IBV_FORK_SAFE"))) return;
  auto forkInit = reinterpret_cast<int (*)()>(dlsym(handle, "ibv_fork_init"));
  const int rc = forkInit != nullptr ? forkInit() : ENOSYS;
  if (rc != 0) {
    RECCL_LOG(kWarn, std::string("ibv_fork_init failed: ") + std::strerror(rc) +
                         "; a process that forks after registering memory (DataLoader workers) "
                         "may corrupt registered buffers (set RDMAV_FORK_SAFE=1)");
  }
}

}  // namespace

bool verbsHeadersCompiledIn() { return true; }

std::shared_ptr<VerbsApi> loadSystemVerbs(std::string* error) {
  auto fn = std::make_shared<Functions>();
  fn->handle = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (fn->handle == nullptr) {
    const char* why = dlerror();
    *error = std::string("cannot load libibverbs.so.1: ") + (why ? why : "unknown error") +
             " (install rdma-core / libibverbs1)";
    return nullptr;
  }
  std::string missing;
  void* h = fn->handle;
  bind(h, "ibv_get_device_list", &fn->getDeviceList, &missing);
  bind(h, "ibv_free_device_list", &fn->freeDeviceList, &missing);
  bind(h, "ibv_get_device_name", &fn->getDeviceName, &missing);
  bind(h, "ibv_open_device", &fn->openDevice, &missing);
  bind(h, "ibv_close_device", &fn->closeDevice, &missing);
  bind(h, "ibv_alloc_pd", &fn->allocPd, &missing);
  bind(h, "ibv_dealloc_pd", &fn->deallocPd, &missing);
  bind(h, "ibv_reg_mr", &fn->regMr, &missing);
  bind(h, "ibv_dereg_mr", &fn->deregMr, &missing);
  bind(h, "ibv_create_cq", &fn->createCq, &missing);
  bind(h, "ibv_destroy_cq", &fn->destroyCq, &missing);
  bind(h, "ibv_create_comp_channel", &fn->createCompChannel, &missing);
  bind(h, "ibv_destroy_comp_channel", &fn->destroyCompChannel, &missing);
  bind(h, "ibv_get_cq_event", &fn->getCqEvent, &missing);
  bind(h, "ibv_ack_cq_events", &fn->ackCqEvents, &missing);
  bind(h, "ibv_create_qp", &fn->createQp, &missing);
  bind(h, "ibv_modify_qp", &fn->modifyQp, &missing);
  bind(h, "ibv_destroy_qp", &fn->destroyQp, &missing);
  bind(h, "ibv_query_port", &fn->queryPort, &missing);
  bind(h, "ibv_query_gid", &fn->queryGid, &missing);
  bind(h, "ibv_get_async_event", &fn->getAsyncEvent, &missing);
  bind(h, "ibv_ack_async_event", &fn->ackAsyncEvent, &missing);
  if (!missing.empty()) {
    *error = "libibverbs.so.1 lacks " + missing;
    return nullptr;
  }
  fn->regDmaBufMr = reinterpret_cast<Functions::RegDmaBufMr>(dlsym(h, "ibv_reg_dmabuf_mr"));
  fn->regMrIova2 = reinterpret_cast<Functions::RegMrIova2>(dlsym(h, "ibv_reg_mr_iova2"));
  fn->queryGidTable = reinterpret_cast<Functions::QueryGidTable>(dlsym(h, "_ibv_query_gid_table"));
  fn->queryGidEx = reinterpret_cast<Functions::QueryGidEx>(dlsym(h, "_ibv_query_gid_ex"));
  initForkProtection(h);
  return std::make_shared<SystemVerbs>(fn);
}

#else  // built without <infiniband/verbs.h>

bool verbsHeadersCompiledIn() { return false; }

std::shared_ptr<VerbsApi> loadSystemVerbs(std::string* error) {
  *error =
      "this build of reccl has no verbs support: it was compiled without the libibverbs "
      "headers (install libibverbs-dev and rebuild)";
  return nullptr;
}

#endif

}  // namespace reccl
