// The narrow slice of libibverbs the IB transport uses, as an interface with
// two implementations: the system library loaded at run time (verbs_library)
// and an in-process emulation with RC semantics (testing/verbs_emulation, in the
// test module torch_reccl._testing only). Each method
// stands for one ibv_* call (named in its comment) or a fixed short sequence.
// The types are our own, so nothing outside verbs_library.cc needs the
// libibverbs headers and the library builds and loads without them.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/error.h"

namespace reccl {

// ibv_modify_qp answered ETIMEDOUT: on RoCE the kernel did not resolve the
// peer's MAC address (neighbour discovery) in time. The QP keeps its state, so
// the same transition may be tried again (IbEndpoint::connect does).
class ModifyQpTimedOut : public Error {
 public:
  using Error::Error;
};

enum class WcStatus : uint8_t {
  kSuccess,
  kLocalLengthError,   // IBV_WC_LOC_LEN_ERR
  kLocalProtection,    // IBV_WC_LOC_PROT_ERR: bad lkey or SGE outside its MR
  kFlushed,            // IBV_WC_WR_FLUSH_ERR: the QP went to the error state
  kRemoteAccess,       // IBV_WC_REM_ACCESS_ERR: bad rkey, bounds or rights
  kRemoteOperation,    // IBV_WC_REM_OP_ERR / REM_INV_REQ_ERR
  kRetryExceeded,      // IBV_WC_RETRY_EXC_ERR: no ACK within timeout x retries
  kRnrRetryExceeded,   // IBV_WC_RNR_RETRY_EXC_ERR
  kOther,
};
const char* wcStatusName(WcStatus status);

enum class WcOpcode : uint8_t { kSend, kRdmaWrite, kRecv, kRecvRdmaWithImm, kRdmaRead, kOther };

// ibv_wc. An error completion (status != kSuccess) is valid only in wrId,
// status, qpNumber and vendorError (ibv_poll_cq(3)): never read the rest then.
struct WorkCompletion {
  uint64_t wrId = 0;
  WcStatus status = WcStatus::kSuccess;
  WcOpcode opcode = WcOpcode::kOther;
  uint32_t byteLength = 0;
  bool hasImmediate = false;
  uint32_t immediate = 0;  // host order
  uint32_t vendorError = 0;
  uint32_t qpNumber = 0;
};

enum class AsyncEventType : uint8_t {
  kPortActive,   // IBV_EVENT_PORT_ACTIVE
  kPortError,    // IBV_EVENT_PORT_ERR
  kGidChange,    // IBV_EVENT_GID_CHANGE
  kQpFatal,      // IBV_EVENT_QP_FATAL and other per-QP errors
  kDeviceFatal,  // IBV_EVENT_DEVICE_FATAL
  kCqError,      // IBV_EVENT_CQ_ERR: a CQ overran; its QPs are in ERR and polling it fails
  kOther,
};
const char* asyncEventName(AsyncEventType type);

struct AsyncEvent {
  AsyncEventType type = AsyncEventType::kOther;
  int port = 0;
};

using Gid = std::array<uint8_t, 16>;
enum class GidType : uint8_t { kIb, kRoceV1, kRoceV2, kUnknown };

struct GidEntry {
  Gid gid{};
  GidType type = GidType::kUnknown;
  int index = 0;  // its index in the port's table (the QP's sgid_index)
};

// ibv_port_attr, the fields we use
struct PortAttributes {
  bool active = false;
  bool ethernet = false;  // link layer: Ethernet (RoCE) or InfiniBand
  uint16_t lid = 0;
  int activeMtu = 3;      // IBV_MTU_* enum value: 1=256 .. 5=4096
  int gidTableLength = 0;
  int speedMbps = 0;      // active_speed x active_width (portSpeedMbps); 0 = unknown
};

// A port's data rate in Mb/s from ibv_port_attr's active_speed (IB_SPEED_*
// bit: SDR .. NDR) and active_width (1x, 4x, 8x, 12x, 2x bit); 0 when either
// is a value this table does not know.
int portSpeedMbps(uint8_t activeSpeed, uint8_t activeWidth);

// ibv_sge
struct ScatterGather {
  uint64_t address = 0;
  uint32_t length = 0;
  uint32_t lkey = 0;
};

// ibv_send_wr, one SGE. kRead: RDMA READ of sge.length bytes at
// remoteAddress/rkey into the SGE.
struct SendRequest {
  enum class Op : uint8_t { kSend, kWrite, kWriteWithImmediate, kRead };
  uint64_t wrId = 0;
  Op op = Op::kSend;
  ScatterGather sge;
  bool signaled = true;
  uint64_t remoteAddress = 0;
  uint32_t rkey = 0;
  uint32_t immediate = 0;  // host order
};

// ibv_recv_wr, one SGE (length 0 for a receive that only takes an immediate)
struct RecvRequest {
  uint64_t wrId = 0;
  ScatterGather sge;
};

// What the peer told us about its QP (the ibv_qp_attr fields of INIT->RTR).
struct QpPeer {
  uint32_t qpNumber = 0;
  uint32_t packetSequence = 0;
  uint16_t lid = 0;
  Gid gid{};
  bool global = true;  // a GRH, routed by GID (always on RoCE; on IB only across subnets)
};

// How our packets are marked (the address vector of INIT->RTR): settings of
// this end, not exchanged, as NCCL's NCCL_IB_TC / NCCL_IB_SL.
struct QpRoute {
  uint8_t trafficClass = 0;  // GRH traffic class (RoCE v2: the IP header's DSCP + ECN byte)
  uint8_t serviceLevel = 0;  // SL (IB: the virtual lane; RoCE: the priority the driver maps it to)
};

class VerbsMemoryRegion {
 public:
  virtual ~VerbsMemoryRegion() = default;  // ibv_dereg_mr
  virtual uint32_t lkey() const = 0;
  virtual uint32_t rkey() const = 0;
};

class VerbsCompletionQueue {
 public:
  virtual ~VerbsCompletionQueue() = default;  // ibv_destroy_cq
  // ibv_poll_cq: up to `max` completions into `out`; returns how many. Throws
  // Error when ibv_poll_cq returns < 0 (the CQ is unusable: callers fail the path).
  virtual int poll(WorkCompletion* out, int max) = 0;
  // ibv_req_notify_cq (any completion, not only solicited ones): arms the CQ,
  // so the next completion added to it raises one event on its channel. One
  // event per arm: re-arm after each, then poll, or a completion that came
  // between the event and the arm is never announced. Throws Error.
  virtual void requestNotify() = 0;
};

// ibv_comp_channel: where the armed CQs made with it announce completions.
// Destroy its CQs first (ibv_destroy_comp_channel refuses a channel in use).
class VerbsCompletionChannel {
 public:
  virtual ~VerbsCompletionChannel() = default;  // ibv_destroy_comp_channel
  // Non-blocking; readable while an event waits (poll it with epoll).
  virtual int fd() const = 0;
  // ibv_get_cq_event + ibv_ack_cq_events: takes the oldest waiting event and
  // acknowledges it at once (ibv_destroy_cq waits for every event taken to be
  // acknowledged). Returns the CQ it announces, or nullptr when none waits.
  virtual VerbsCompletionQueue* takeEvent() = 0;
};

class VerbsQueuePair {
 public:
  virtual ~VerbsQueuePair() = default;  // ibv_destroy_qp
  virtual uint32_t qpNumber() const = 0;
  // ibv_modify_qp RESET->INIT on `port`, with local write and remote write and
  // read access.
  virtual void toInit(int port) = 0;
  // ibv_modify_qp INIT->RTR towards `peer`; `gidIndex` is our source GID,
  // `route` the traffic class (in the GRH) and service level we send with.
  // This and toReadyToSend throw ModifyQpTimedOut on ETIMEDOUT, Error otherwise.
  virtual void toReadyToReceive(const QpPeer& peer, int port, int gidIndex, int mtu,
                                const QpRoute& route) = 0;
  // ibv_modify_qp RTR->RTS; the ACK timeout is 4.096 us * 2^timeout per try.
  virtual void toReadyToSend(uint32_t packetSequence, int timeout, int retryCount) = 0;
  // ibv_modify_qp to ERR: outstanding requests complete with kFlushed and no
  // later write of this QP can land.
  virtual void toError() = 0;
  // ibv_post_send / ibv_post_recv: false (errno text in `error`) when refused.
  virtual bool postSend(const SendRequest& request, std::string* error) = 0;
  virtual bool postRecv(const RecvRequest& request, std::string* error) = 0;
};

// One opened device with its protection domain (ibv_open_device + ibv_alloc_pd).
class VerbsDevice {
 public:
  virtual ~VerbsDevice() = default;
  virtual std::string name() const = 0;
  // The device's PCI path (/sys/class/infiniband/<name>/device resolved), ""
  // where there is none.
  virtual std::string pciPath() const = 0;
  virtual PortAttributes queryPort(int port) = 0;  // ibv_query_port
  // ibv_query_gid_table (rdma-core v30+): every valid entry of the port's
  // table in one call, each with the type the kernel gives it. false, with the
  // reason in `why`, where the library lacks it or the call fails.
  virtual bool queryGidTable(int port, std::vector<GidEntry>* out, std::string* why) = 0;
  // One entry: ibv_query_gid_ex (type from the kernel) where the library has
  // it, else ibv_query_gid with the type from sysfs (gid_attrs/types), which
  // is kUnknown where sysfs does not say (hidden in a container, old kernel).
  virtual GidEntry queryGid(int port, int index) = 0;
  // ibv_reg_mr; remote write access when `remoteWrite`. `relaxedOrdering`
  // (only where supportsRelaxedOrdering): ibv_reg_mr_iova2 with
  // IBV_ACCESS_RELAXED_ORDERING, an optional flag a device may ignore.
  virtual std::unique_ptr<VerbsMemoryRegion> registerMemory(void* address, size_t bytes,
                                                            bool remoteWrite,
                                                            bool relaxedOrdering) = 0;
  // Whether the library can ask for relaxed ordering (ibv_reg_mr_iova2,
  // rdma-core v29+: the plain ibv_reg_mr symbol rejects optional flags).
  virtual bool supportsRelaxedOrdering() const = 0;
  // ibv_reg_dmabuf_mr with local and remote write and remote read (the flush
  // reads it): `bytes` of the dma-buf
  // `fd` from `offset`, which the NIC addresses as [iova, iova + bytes).
  // Throws Error when the provider cannot (supportsDmaBuf says why).
  virtual std::unique_ptr<VerbsMemoryRegion> registerDmaBuf(int fd, uint64_t offset, size_t bytes,
                                                            uint64_t iova,
                                                            bool relaxedOrdering) = 0;
  // ibv_reg_mr on a device (GPU) pointer, local + remote write + remote read: works only
  // where a peer-memory module (nvidia-peermem) lets the NIC map it.
  virtual std::unique_ptr<VerbsMemoryRegion> registerPeerMemory(void* address, size_t bytes,
                                                                bool relaxedOrdering) = 0;
  // Whether registerDmaBuf can work (rdma-core older than v34 lacks it).
  virtual bool supportsDmaBuf(std::string* why) const = 0;
  virtual std::unique_ptr<VerbsCompletionChannel>
  createCompletionChannel() = 0;  // ibv_create_comp_channel
  // ibv_create_cq; its events go to `channel` (which must outlive it), or
  // nowhere when it is nullptr (a CQ only ever polled).
  virtual std::unique_ptr<VerbsCompletionQueue> createCompletionQueue(
      int depth, VerbsCompletionChannel* channel) = 0;
  // ibv_create_qp, type RC.
  virtual std::unique_ptr<VerbsQueuePair> createQueuePair(VerbsCompletionQueue* sendCq,
                                                          VerbsCompletionQueue* recvCq, int maxSend,
                                                          int maxRecv) = 0;
  // ibv_get_async_event + ibv_ack_async_event, waiting at most `timeout`;
  // false without an event on timeout or once interrupted.
  virtual bool waitAsyncEvent(AsyncEvent* event, Millis timeout) = 0;
  // Makes a wait in progress, and every later one, return false at once: the
  // watcher then blocks on events alone (no periodic wake-ups) and still stops
  // when its transport does.
  virtual void interruptAsyncWait() = 0;
};

class VerbsApi {
 public:
  virtual ~VerbsApi() = default;
  virtual std::string describe() const = 0;  // "libibverbs.so.1" or "emulation"
  virtual std::vector<std::string> deviceNames() = 0;  // ibv_get_device_list
  // ibv_open_device + ibv_alloc_pd; throws Error naming the valid devices.
  virtual std::shared_ptr<VerbsDevice> open(const std::string& name) = 0;
  // Whether a peer-memory module (nvidia-peermem, or the older nv_peer_mem)
  // is loaded, so ibv_reg_mr can register GPU memory by pointer; if not, why not.
  virtual bool peerMemoryLoaded(std::string* why) const = 0;
};

// 4.096 us * 2^timeout * (retryCount + 1): how long an unanswered request is
// retried before it completes with kRetryExceeded.
int64_t retryBudgetNs(int timeout, int retryCount);

}  // namespace reccl
