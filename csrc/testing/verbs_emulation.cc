#include "testing/verbs_emulation.h"

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "core/error.h"
#include "core/thread_name.h"
#include "transport/socket.h"

#ifdef __SANITIZE_THREAD__
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#endif

namespace reccl {

namespace {

// The emulated NIC's DMA. A real NIC's reads and writes of registered memory are
// invisible to ThreadSanitizer, and the library orders them as it must (credits,
// completions); the emulation's copies, made on its own thread, are kept out of
// TSan's view the same way, so that it reports the library's races, not the
// hardware's.
void dmaCopy(void* to, const void* from, size_t bytes) {
#ifdef __SANITIZE_THREAD__
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
  std::memcpy(to, from, bytes);
#ifdef __SANITIZE_THREAD__
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
}

constexpr int kGidTableLength = 16;
// What an emulated port reports as its rate (4x EDR). Nothing is paced by it:
// emulated timing says nothing about real bandwidth.
constexpr int kEmulatedPortMbps = 100000;

enum class QpState { kReset, kInit, kReadyToReceive, kReadyToSend, kError };

const char* qpStateName(QpState state) {
  switch (state) {
    case QpState::kReset: return "RESET";
    case QpState::kInit: return "INIT";
    case QpState::kReadyToReceive: return "RTR";
    case QpState::kReadyToSend: return "RTS";
    case QpState::kError: return "ERR";
  }
  return "?";
}

struct CompletionQueueRecord;

// A completion channel: its eventfd (semaphore mode, non-blocking) counts the
// events in `waiting`, so it is readable exactly while one waits.
struct CompletionChannelRecord {
  Fd events;
  std::deque<CompletionQueueRecord*> waiting;
};

// A completion waiting in its CQ, and (a send completion) which send-queue
// slots polling it frees: every request of `qp` up to `sendSequence`.
struct QueuedCompletion {
  WorkCompletion wc;
  uint64_t sendSequence = 0;  // 0: a receive completion
};

struct CompletionQueueRecord {
  std::deque<QueuedCompletion> entries;
  size_t depth = 0;                             // ibv_create_cq's cqe: more is an overrun
  int device = 0;
  bool overrun = false;                         // unusable: polls fail, CQ_ERR raised
  VerbsCompletionQueue* handle = nullptr;       // what an event names
  CompletionChannelRecord* channel = nullptr;
  bool armed = false;                           // the next completion raises an event
};

struct MemoryRegionRecord {
  int device = 0;
  uint64_t iova = 0;        // the address range the NIC is asked to use
  uint8_t* base = nullptr;  // where the emulated NIC really reads and writes it
  size_t bytes = 0;
  bool remoteWrite = false;
  bool remoteRead = false;
  bool relaxedOrdering = false;
  uint32_t lkey = 0;
  uint32_t rkey = 0;

  bool covers(uint64_t address, uint64_t length) const {
    return address >= iova && length <= bytes && address - iova <= bytes - length;
  }
  // The emulated NIC's own pointer to `address` (which covers() accepted): a
  // dma-buf region is reached through the emulation's mapping of the fd, never
  // through the caller's address.
  uint8_t* translate(uint64_t address) const { return base + (address - iova); }
};

struct PendingSend {
  SendRequest request;
  uint64_t sequence = 0;  // its number among the QP's posted requests
  int64_t firstTryNs = 0;
  bool countedDrop = false;
  bool countedRnr = false;
};

// One open device context (ibv_open_device + ibv_alloc_pd) and the memory
// regions registered through it, which must be deregistered before it closes.
struct ContextRecord {
  bool closed = false;
  int liveRegions = 0;
};

struct QueuePairRecord {
  uint32_t qpNumber = 0;
  int device = 0;
  CompletionQueueRecord* sendCq = nullptr;
  CompletionQueueRecord* recvCq = nullptr;
  QpState state = QpState::kReset;
  QpPeer peer;
  int gidIndex = 0;
  Gid sourceGid{};
  QpRoute route;
  int64_t retryBudgetNs = 0;
  size_t maxSend = 0;
  size_t maxRecv = 0;
  uint32_t sendPsn = 0;   // sq_psn (RTS); the peer's rq_psn must equal it
  // Send-queue slots: requests posted minus those whose completion (or a
  // later one's: an unsignaled request has none) was polled.
  uint64_t posted = 0;
  uint64_t retired = 0;
  std::deque<PendingSend> sends;
  std::deque<RecvRequest> recvs;
};

struct AsyncQueue {
  std::deque<AsyncEvent> events;
  int generation = 0;  // the device's life it was opened in: a dead context hears nothing more
};

// A request that left its QP while the device was held: on the wire, with the
// bytes it read when it left, delivered (or not) when the hold is released.
struct WireRequest {
  uint32_t fromQp = 0;
  uint32_t toQp = 0;
  int fromDevice = 0;
  SendRequest request;
  uint64_t sequence = 0;
  std::vector<uint8_t> payload;
  bool senderFlushed = false;  // the sending QP went to ERR meanwhile
};

// A delivery its responder accepted (and ACKed) whose bytes reach memory
// only at dueNs (setLandingDelay).
struct Landing {
  int64_t dueNs = 0;
  uint32_t toQp = 0;
  bool byLocalKey = false;  // a SEND into a receive buffer (lkey) or a write (rkey)
  uint32_t key = 0;
  uint64_t address = 0;
  std::vector<uint8_t> payload;
  bool hasRecv = false;
  WorkCompletion wc;
};

struct DeviceRecord {
  std::string name;
  bool portUp = true;
  bool drop = false;
  bool hold = false;
  int flaps = 0;
  std::string corruptKind;
  int pollFailures = 0;    // ibv_poll_cq calls on its CQs still to fail (failNext)
  int modifyTimeouts = 0;   // ibv_modify_qp calls of its QPs still to answer ETIMEDOUT
  // setDeviceFatal: the device is gone (opens fail) until recoverDevice; each
  // fatal error ends a life: contexts opened before stay dead for good.
  bool fatal = false;
  int generation = 0;
  // setLosslessClass: the traffic class its fabric protects (PFC); -1 = none.
  int losslessClass = -1;
  // Where ibv_get_device_list puts it: a device back from a fatal error is
  // listed last, as a driver's re-probe adds it (deviceNames).
  uint64_t listedAt = 0;
  bool refuseDmaBuf = false;  // setRefuseDmaBuf: ibv_reg_dmabuf_mr fails (EOPNOTSUPP)
  uint64_t reads = 0;         // RDMA READs its QPs issued and were served (readsOn)
  std::string pciPath;        // setPciPath; none by default
  int64_t landingDelayNs = 0;  // setLandingDelay
  bool relaxedOrdering = true;  // setRelaxedOrdering: the library can ask for it
  bool ethernet = true;          // setInfiniband: false, with a LID and an IB GID
  uint16_t lid = 0;
  uint64_t subnetPrefix = 0;
  std::deque<Landing> landings;  // accepted for it, not yet in its memory, in order
  std::vector<GidEntry> gids;
  std::vector<GidEntry> extraGids;     // addGid: kept over flaps, after the link-local pair
  GidSources gidSources;
  std::vector<AsyncQueue*> listeners;  // one per open handle
};

std::vector<GidEntry> buildGidTable(int deviceIndex, int flaps,
                                    const std::vector<GidEntry>& extras) {
  // Link-local first, then the added entries, then (depending on the flap
  // count) some global IPv6 addresses, then the IPv4-mapped address: its
  // index moves with every flap.
  std::vector<GidEntry> table;
  auto pair = [&](Gid gid) {
    table.push_back({gid, GidType::kRoceV1});
    table.push_back({gid, GidType::kRoceV2});
  };
  Gid linkLocal{};
  linkLocal[0] = 0xfe;
  linkLocal[1] = 0x80;
  linkLocal[15] = static_cast<uint8_t>(deviceIndex + 1);
  pair(linkLocal);
  table.insert(table.end(), extras.begin(), extras.end());
  for (int i = 0; i < flaps % 3; ++i) {
    Gid global{};
    global[0] = 0xfd;
    global[1] = 0x00;
    global[2] = static_cast<uint8_t>(flaps);
    global[3] = static_cast<uint8_t>(i);
    global[15] = static_cast<uint8_t>(deviceIndex + 1);
    pair(global);
  }
  Gid mapped{};
  mapped[10] = 0xff;
  mapped[11] = 0xff;
  mapped[12] = 10;
  mapped[13] = 0;
  mapped[14] = static_cast<uint8_t>(deviceIndex);
  mapped[15] = 1;
  pair(mapped);
  table.resize(
      std::max<size_t>(table.size(), kGidTableLength));  // the rest are empty (all-zero) entries
  for (size_t i = 0; i < table.size(); ++i) table[i].index = static_cast<int>(i);
  return table;
}

bool isLinkLocalGid(const Gid& gid) { return gid[0] == 0xfe && (gid[1] & 0xc0) == 0x80; }
bool isIpv4MappedGid(const Gid& gid) {
  static const uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.data(), kPrefix, sizeof(kPrefix)) == 0;
}

// The emulated RoCE fabric is routed (each port its own IP subnet), as a
// rail-optimized L3 fabric is: only RoCE v2 packets with routable addresses
// cross it, and both ends must speak the same address family.
bool carriedBetween(const GidEntry& from, const GidEntry& to) {
  auto routable = [](const GidEntry& e) {
    return e.type == GidType::kRoceV2 && !isLinkLocalGid(e.gid);
  };
  return routable(from) && routable(to) && isIpv4MappedGid(from.gid) == isIpv4MappedGid(to.gid);
}

WcOpcode opcodeOf(SendRequest::Op op) {
  switch (op) {
    case SendRequest::Op::kSend: return WcOpcode::kSend;
    case SendRequest::Op::kRead: return WcOpcode::kRdmaRead;
    default: return WcOpcode::kRdmaWrite;
  }
}

}  // namespace

// An InfiniBand port's table: its port GID (subnet prefix + GUID) at index 0;
// it does not move on a flap.
std::vector<GidEntry> buildIbGidTable(int deviceIndex, uint64_t subnetPrefix) {
  std::vector<GidEntry> table(kGidTableLength);
  for (int i = 0; i < 8; ++i) table[0].gid[i] = static_cast<uint8_t>(subnetPrefix >> (56 - 8 * i));
  table[0].gid[8] = 0x02;  // a GUID
  table[0].gid[15] = static_cast<uint8_t>(deviceIndex + 1);
  table[0].type = GidType::kIb;
  for (size_t i = 0; i < table.size(); ++i) table[i].index = static_cast<int>(i);
  return table;
}

struct VerbsEmulation::State {
  std::mutex mutex;
  std::condition_variable work;
  std::condition_variable events;
  bool stopping = false;
  std::vector<DeviceRecord> devices;
  std::map<uint32_t, QueuePairRecord*> qps;
  std::map<uint32_t, MemoryRegionRecord*> byLkey;
  std::map<uint32_t, MemoryRegionRecord*> byRkey;
  std::vector<CompletionQueueRecord*> cqs;
  std::vector<QueuePairRecord*> allQps;  // to detach destroyed CQs
  uint32_t nextQpNumber = 0x101;
  uint32_t nextKey = 0x1001;
  EmulationCounters counters;
  uint64_t relisted = 0;  // devices back from a fatal error so far (DeviceRecord::listedAt)
  std::deque<WireRequest> wire;

  int deviceIndex(const std::string& name) const {
    for (size_t i = 0; i < devices.size(); ++i) {
      if (devices[i].name == name) return static_cast<int>(i);
    }
    std::string known;
    for (const auto& device : devices) known += (known.empty() ? "" : ", ") + device.name;
    throw ConfigError("no emulated RDMA device '" + name + "'; devices: " + known);
  }

  // The CQ overran: lost (CQ_ERR), with every QP that completes into it, as
  // on a real HCA.
  void overrun(CompletionQueueRecord* cq) {
    cq->overrun = true;
    ++counters.cqOverruns;
    raise(cq->device, AsyncEventType::kCqError);
    for (QueuePairRecord* qp : allQps) {
      if (qp->sendCq == cq || qp->recvCq == cq) toError(*qp);
    }
  }

  void complete(CompletionQueueRecord* cq, WorkCompletion wc, uint64_t sendSequence = 0) {
    if (cq == nullptr || cq->overrun) return;
    if (wc.status == WcStatus::kFlushed) ++counters.flushed;
    if (wc.status == WcStatus::kRetryExceeded) ++counters.retryExceeded;
    if (wc.status == WcStatus::kRemoteAccess || wc.status == WcStatus::kLocalProtection ||
        wc.status == WcStatus::kLocalLengthError) {
      ++counters.accessErrors;
    }
    if (cq->entries.size() >= cq->depth) {
      overrun(cq);  // more completions than the CQ holds
      return;
    }
    if (wc.status != WcStatus::kSuccess) {
      // Only wr_id, status, qp_num and vendor_err of an error completion
      // are valid (ibv_poll_cq(3)); the rest is left as garbage here.
      wc.opcode = static_cast<WcOpcode>((wc.wrId + 3) % 6);
      wc.byteLength = 0xDEADBEEF;
      wc.hasImmediate = true;
      wc.immediate = 0xBADC0DE;
    }
    cq->entries.push_back({wc, sendSequence});
    if (cq->armed && cq->channel != nullptr) {
      // One event per arm, as on a real HCA: the CQ stays quiet until re-armed.
      cq->armed = false;
      ++counters.completionEvents;
      cq->channel->waiting.push_back(cq);
      signalWake(cq->channel->events.get());
    }
  }

  // An unsignaled request that succeeds has no completion: its slot frees
  // with the next completion polled after it.
  void completeSend(QueuePairRecord& qp, const SendRequest& request, WcStatus status,
                    uint64_t sequence) {
    if (status == WcStatus::kSuccess && !request.signaled) return;
    WorkCompletion wc;
    wc.wrId = request.wrId;
    wc.status = status;
    wc.opcode = opcodeOf(request.op);
    wc.byteLength = request.sge.length;
    wc.qpNumber = qp.qpNumber;
    complete(qp.sendCq, wc, sequence);
  }

  void toError(QueuePairRecord& qp) {
    if (qp.state == QpState::kError) return;
    qp.state = QpState::kError;
    ++counters.qpErrors;
    for (const auto& pending : qp.sends)
      completeSend(qp, pending.request, WcStatus::kFlushed, pending.sequence);
    qp.sends.clear();
    // Requests already on the wire stay there (a QP's error state does not
    // recall packets in flight), but their sender sees them flushed.
    for (auto& parked : wire) {
      if (parked.fromQp == qp.qpNumber && !parked.senderFlushed) {
        parked.senderFlushed = true;
        completeSend(qp, parked.request, WcStatus::kFlushed, parked.sequence);
      }
    }
    for (const auto& recv : qp.recvs) {
      WorkCompletion wc;
      wc.qpNumber = qp.qpNumber;
      wc.wrId = recv.wrId;
      wc.status = WcStatus::kFlushed;
      wc.opcode = WcOpcode::kRecv;
      complete(qp.recvCq, wc);
    }
    qp.recvs.clear();
  }

  bool linkUsable(int device) const {
    return devices[device].portUp && !devices[device].drop && !devices[device].fatal;
  }

  // The peer QP a request of `qp` reaches now, or nullptr if it is lost.
  QueuePairRecord* route(QueuePairRecord& qp) {
    if (!linkUsable(qp.device)) return nullptr;
    const DeviceRecord& local = devices[qp.device];
    if (local.gids.at(qp.gidIndex).gid != qp.sourceGid) return nullptr;  // our GID moved
    auto it = qps.find(qp.peer.qpNumber);
    if (it == qps.end()) return nullptr;
    QueuePairRecord& remote = *it->second;
    if (remote.state != QpState::kReadyToReceive && remote.state != QpState::kReadyToSend) {
      return nullptr;  // a QP in RESET/INIT/ERR drops what arrives
    }
    if (remote.peer.qpNumber != qp.qpNumber || !linkUsable(remote.device)) return nullptr;
    const DeviceRecord& far = devices[remote.device];
    if (local.ethernet != far.ethernet) return nullptr;  // an IB port cannot reach a RoCE one
    // The responder takes only the PSN it expects: ours must be its rq_psn
    // (a mismatch is NAKed or dropped as a duplicate, then retry-exceeded).
    if (remote.peer.packetSequence != qp.sendPsn) return nullptr;
    if (!local.ethernet) {
      // InfiniBand: switches forward by DLID within a subnet; across subnets
      // only a GRH (routed by GID) gets there.
      if (local.subnetPrefix != far.subnetPrefix) {
        return qp.peer.global && far.gids.at(remote.gidIndex).gid == qp.peer.gid ? &remote
                                                                                 : nullptr;
      }
      if (qp.peer.lid != far.lid) return nullptr;
      if (qp.peer.global && far.gids.at(remote.gidIndex).gid != qp.peer.gid) return nullptr;
      return &remote;
    }
    // A lossless (PFC) fabric protects one traffic class; the others are
    // dropped under congestion (here: always), the responder's ACKs as well.
    // A loopback QP's traffic never leaves the NIC.
    if (qp.device != remote.device &&
        ((local.losslessClass >= 0 && qp.route.trafficClass != local.losslessClass) ||
         (far.losslessClass >= 0 && remote.route.trafficClass != far.losslessClass))) {
      return nullptr;
    }
    const GidEntry& theirs = devices[remote.device].gids.at(remote.gidIndex);
    if (theirs.gid != qp.peer.gid) return nullptr;
    if (!carriedBetween(local.gids.at(qp.gidIndex), theirs)) return nullptr;
    return &remote;
  }

  MemoryRegionRecord* localRegion(int device, const ScatterGather& sge) {
    auto it = byLkey.find(sge.lkey);
    if (it == byLkey.end() || it->second->device != device) return nullptr;
    return it->second->covers(sge.address, sge.length) ? it->second : nullptr;
  }

  void corrupt(int device, SendRequest::Op op, uint8_t* payload, uint32_t length,
               uint32_t* immediate) {
    std::string& kind = devices[device].corruptKind;
    if (kind.empty() || op == SendRequest::Op::kWrite) return;
    if (kind == "immediate" && op == SendRequest::Op::kWriteWithImmediate) {
      *immediate = 0xFFFFFFFFu;
    } else if (kind == "payload" && length > 0) {
      payload[0] ^= 0xFF;
    } else {
      return;
    }
    kind.clear();
    ++counters.corrupted;
  }

  // Tries the head request of `qp`; true if it finished (either way).
  bool advance(QueuePairRecord& qp, int64_t now) {
    PendingSend& head = qp.sends.front();
    if (head.firstTryNs == 0) head.firstTryNs = now;
    const SendRequest request = head.request;
    const uint64_t sequence = head.sequence;
    QueuePairRecord* remote = route(qp);
    if (remote == nullptr) {
      bool dropped = devices[qp.device].drop;
      auto peer = qps.find(qp.peer.qpNumber);
      if (peer != qps.end()) dropped = dropped || devices[peer->second->device].drop;
      if (dropped && !head.countedDrop) {
        head.countedDrop = true;
        ++counters.dropped;
      }
      if (now - head.firstTryNs <= qp.retryBudgetNs) return false;
      qp.sends.pop_front();
      completeSend(qp, request, WcStatus::kRetryExceeded, sequence);
      toError(qp);
      return true;
    }
    uint8_t* local = nullptr;  // what the request reads (or, a READ, fills)
    if (request.sge.length > 0) {
      MemoryRegionRecord* mr = localRegion(qp.device, request.sge);
      if (mr == nullptr) {
        qp.sends.pop_front();
        completeSend(qp, request, WcStatus::kLocalProtection, sequence);
        toError(qp);
        return true;
      }
      local = mr->translate(request.sge.address);
    }
    const uint8_t* source = local;
    if (request.op == SendRequest::Op::kRead) {
      // Not held: a READ's data comes back to us, there is nothing to park.
      auto it = byRkey.find(request.rkey);
      MemoryRegionRecord* mr = it == byRkey.end() ? nullptr : it->second;
      qp.sends.pop_front();
      if (mr == nullptr || mr->device != remote->device || !mr->remoteRead ||
          !mr->covers(request.remoteAddress, request.sge.length)) {
        completeSend(qp, request, WcStatus::kRemoteAccess, sequence);
        toError(*remote);
        toError(qp);
        return true;
      }
      if (request.sge.length > 0)
        dmaCopy(local, mr->translate(request.remoteAddress), request.sge.length);
      ++counters.reads;
      ++devices[qp.device].reads;
      completeSend(qp, request, WcStatus::kSuccess, sequence);
      return true;
    }
    if (devices[qp.device].hold) {
      // Leaves now with the bytes it reads now; lands when the hold ends.
      WireRequest parked;
      parked.fromQp = qp.qpNumber;
      parked.toQp = remote->qpNumber;
      parked.fromDevice = qp.device;
      parked.request = request;
      parked.sequence = sequence;
      if (source != nullptr) parked.payload.assign(source, source + request.sge.length);
      wire.push_back(std::move(parked));
      ++counters.held;
      qp.sends.pop_front();
      return true;
    }
    Delivery result = deliver(*remote, request, source, qp.device);
    if (result == Delivery::kReceiverNotReady) {
      // RNR NAK: retried without bound (rnr_retry = 7), each a stall of the QP.
      if (!head.countedRnr) {
        head.countedRnr = true;
        ++counters.rnrNaks;
      }
      return false;
    }
    qp.sends.pop_front();
    if (result == Delivery::kDone) {
      completeSend(qp, request, WcStatus::kSuccess, sequence);
      return true;
    }
    completeSend(qp, request,
                 result == Delivery::kRemoteAccess ? WcStatus::kRemoteAccess
                                                   : WcStatus::kRemoteOperation,
                 sequence);
    toError(*remote);
    toError(qp);
    return true;
  }

  enum class Delivery { kDone, kReceiverNotReady, kRemoteAccess, kRemoteOperation };

  // Executes `request` at the responder `remote`, reading the payload from
  // `source`. On a bad request the responder's receive (if one was due) fails
  // and its QP goes to ERR; the requester's side is the caller's.
  Delivery deliver(QueuePairRecord& remote, const SendRequest& request, const uint8_t* source,
                   int fromDevice) {
    const bool consumesRecv = request.op != SendRequest::Op::kWrite;
    if (consumesRecv && remote.recvs.empty()) return Delivery::kReceiverNotReady;
    auto failRecv = [&](WcStatus status) {
      RecvRequest recv = remote.recvs.front();
      remote.recvs.pop_front();
      WorkCompletion wc;
      wc.qpNumber = remote.qpNumber;
      wc.wrId = recv.wrId;
      wc.status = status;
      wc.opcode = WcOpcode::kRecv;
      complete(remote.recvCq, wc);
      return Delivery::kRemoteOperation;
    };
    uint8_t* target = nullptr;
    if (request.op == SendRequest::Op::kSend) {
      const RecvRequest& recv = remote.recvs.front();
      if (recv.sge.length < request.sge.length) return failRecv(WcStatus::kLocalLengthError);
      if (request.sge.length > 0) {
        MemoryRegionRecord* mr = localRegion(remote.device, recv.sge);
        if (mr == nullptr) return failRecv(WcStatus::kLocalProtection);
        target = mr->translate(recv.sge.address);
      }
    } else {
      auto it = byRkey.find(request.rkey);
      MemoryRegionRecord* mr = it == byRkey.end() ? nullptr : it->second;
      if (mr == nullptr || mr->device != remote.device || !mr->remoteWrite ||
          !mr->covers(request.remoteAddress, request.sge.length)) {
        return Delivery::kRemoteAccess;
      }
      target = mr->translate(request.remoteAddress);
    }
    uint32_t immediate = request.immediate;
    // A responder device with a landing delay accepts (and ACKs) now and
    // writes memory later; what it accepted lands even if its QP goes to ERR
    // meanwhile. Later deliveries queue behind earlier ones (RC order).
    std::deque<Landing>& landings = devices[remote.device].landings;
    const int64_t delay = devices[remote.device].landingDelayNs;
    const bool late = delay > 0 || !landings.empty();
    Landing landing;
    uint8_t* into = target;
    if (request.sge.length > 0) {
      if (late) {
        landing.payload.resize(request.sge.length);
        dmaCopy(landing.payload.data(), source, request.sge.length);
        into = landing.payload.data();
      } else {
        dmaCopy(target, source, request.sge.length);
      }
    }
    corrupt(fromDevice, request.op, into, request.sge.length, &immediate);
    counters.bytes += request.sge.length;
    if (request.op == SendRequest::Op::kSend) {
      ++counters.sends;
    } else {
      ++counters.writes;
      if (request.op == SendRequest::Op::kWriteWithImmediate) ++counters.writesWithImmediate;
    }
    WorkCompletion wc;
    RecvRequest recv;
    if (consumesRecv) {
      recv = remote.recvs.front();
      remote.recvs.pop_front();
      wc.qpNumber = remote.qpNumber;
      wc.wrId = recv.wrId;
      wc.byteLength = request.sge.length;
      if (request.op == SendRequest::Op::kSend) {
        wc.opcode = WcOpcode::kRecv;
      } else {
        wc.opcode = WcOpcode::kRecvRdmaWithImm;
        wc.hasImmediate = true;
        wc.immediate = immediate;
      }
    }
    if (late) {
      const bool send = request.op == SendRequest::Op::kSend;
      landing.dueNs =
          std::max(nowNs() + delay, landings.empty() ? int64_t{0} : landings.back().dueNs);
      landing.toQp = remote.qpNumber;
      landing.byLocalKey = send;
      landing.key = send ? recv.sge.lkey : request.rkey;
      landing.address = send ? recv.sge.address : request.remoteAddress;
      landing.hasRecv = consumesRecv;
      landing.wc = wc;
      landings.push_back(std::move(landing));
      return Delivery::kDone;
    }
    if (consumesRecv) complete(remote.recvCq, wc);
    return Delivery::kDone;
  }

  // Accepted deliveries whose time has come reach memory (the region looked
  // up again: it may be gone) and complete their receive (flushed if the QP
  // went to ERR meanwhile). True if any landed.
  bool land(int64_t now) {
    bool any = false;
    for (DeviceRecord& device : devices) any = landOn(device.landings, now) || any;
    return any;
  }

  bool landOn(std::deque<Landing>& landings, int64_t now) {
    bool any = false;
    while (!landings.empty() && landings.front().dueNs <= now) {
      Landing landing = std::move(landings.front());
      landings.pop_front();
      if (!landing.payload.empty()) {
        auto& keys = landing.byLocalKey ? byLkey : byRkey;
        auto it = keys.find(landing.key);
        if (it != keys.end() && it->second->covers(landing.address, landing.payload.size())) {
          dmaCopy(it->second->translate(landing.address), landing.payload.data(),
                  landing.payload.size());
        }
      }
      ++counters.landedLate;
      auto qp = qps.find(landing.toQp);
      if (landing.hasRecv && qp != qps.end()) {
        if (qp->second->state == QpState::kError) landing.wc.status = WcStatus::kFlushed;
        complete(qp->second->recvCq, landing.wc);
      }
      any = true;
    }
    return any;
  }

  // The hold on `device` ended: what it parked on the wire arrives now, in
  // order, where the responder QP still takes it (RTR/RTS, connected back, its
  // port usable); a responder in ERR (fenced) or gone drops it.
  void releaseWire(int device) {
    std::deque<WireRequest> kept;
    while (!wire.empty()) {
      WireRequest parked = std::move(wire.front());
      wire.pop_front();
      if (parked.fromDevice != device) {
        kept.push_back(std::move(parked));
        continue;
      }
      auto sender = qps.find(parked.fromQp);
      QueuePairRecord* from =
          sender == qps.end() || parked.senderFlushed ? nullptr : sender->second;
      auto it = qps.find(parked.toQp);
      QueuePairRecord* remote = it == qps.end() ? nullptr : it->second;
      bool reachable =
          remote != nullptr && remote->peer.qpNumber == parked.fromQp &&
          (remote->state == QpState::kReadyToReceive || remote->state == QpState::kReadyToSend) &&
          linkUsable(remote->device);
      Delivery result = reachable ? deliver(*remote, parked.request, parked.payload.data(), device)
                                  : Delivery::kReceiverNotReady;
      if (result == Delivery::kDone) {
        ++counters.wireDelivered;
        if (from != nullptr)
          completeSend(*from, parked.request, WcStatus::kSuccess, parked.sequence);
        continue;
      }
      ++counters.wireDropped;
      if (result != Delivery::kReceiverNotReady && remote != nullptr) toError(*remote);
      if (from != nullptr) {
        completeSend(*from, parked.request, WcStatus::kRetryExceeded, parked.sequence);
        toError(*from);
      }
    }
    wire = std::move(kept);
  }

  bool retrying() const {
    for (const DeviceRecord& device : devices) {
      if (!device.landings.empty()) return true;
    }
    for (const auto& [number, qp] : qps) {
      if (qp->state == QpState::kReadyToSend && !qp->sends.empty()) return true;
    }
    return false;
  }

  bool step(int64_t now) {
    bool progressed = false;
    for (auto& [number, qp] : qps) {
      // In-order: at most the head of each send queue moves per step, and a
      // head that cannot move blocks those behind it.
      while (qp->state == QpState::kReadyToSend && !qp->sends.empty() && advance(*qp, now)) {
        progressed = true;
      }
    }
    return progressed;
  }

  void raise(int device, AsyncEventType type) {
    for (AsyncQueue* queue : devices[device].listeners) {
      if (queue->generation == devices[device].generation) queue->events.push_back({type, 1});
    }
    events.notify_all();
  }

  // Runs `f(record, index)` on the named device under the lock.
  template <typename F>
  auto withDevice(const std::string& device, F f) {
    std::lock_guard<std::mutex> lock(mutex);
    const int index = deviceIndex(device);
    return f(devices[index], index);
  }

  // `view(qp)` of each QP of the device now in RTR or RTS.
  template <typename F>
  auto ofConnectedQps(const std::string& device, F view) {
    std::lock_guard<std::mutex> lock(mutex);
    const int index = deviceIndex(device);
    std::vector<decltype(view(std::declval<const QueuePairRecord&>()))> out;
    for (const auto& [number, qp] : qps) {
      if (qp->device == index &&
          (qp->state == QpState::kReadyToReceive || qp->state == QpState::kReadyToSend)) {
        out.push_back(view(*qp));
      }
    }
    return out;
  }
};

namespace {

using State = VerbsEmulation::State;
using Lock = std::unique_lock<std::mutex>;

// The emulated NIC's own mapping of a dma-buf fd (RAII).
// The emulated NIC's own mapping of a dma-buf fd (RAII), under the kernel's
// rules for ibv_reg_dmabuf_mr: [offset, offset + bytes) inside the dma-buf, and
// iova at the same offset within a page as `offset` (the NIC maps whole
// pages), else EINVAL.
class DmaBufMapping {
 public:
  DmaBufMapping(int fd, uint64_t offset, size_t bytes, uint64_t iova) {
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    if (offset % page != iova % page) {
      throw Error("emulated ibv_reg_dmabuf_mr: offset " + std::to_string(offset) + " and iova " +
                  std::to_string(iova) + " lie at different offsets within a " +
                  std::to_string(page) + "-byte page (EINVAL)");
    }
    struct stat info{};
    if (::fstat(fd, &info) != 0) {
      throw Error(std::string("emulated ibv_reg_dmabuf_mr: fd ") + std::to_string(fd) +
                  " is not a dma-buf: " + std::strerror(errno));
    }
    const uint64_t size = static_cast<uint64_t>(info.st_size);
    if (offset > size || bytes > size - offset) {
      throw Error("emulated ibv_reg_dmabuf_mr: [" + std::to_string(offset) + ", +" +
                  std::to_string(bytes) + ") lies beyond the dma-buf's " + std::to_string(size) +
                  " bytes (EINVAL)");
    }
    lead_ = offset % page;
    mappedBytes_ = bytes + lead_;
    void* mapped = ::mmap(nullptr, mappedBytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                          static_cast<off_t>(offset - lead_));
    if (mapped == MAP_FAILED) {
      throw Error(std::string("emulated ibv_reg_dmabuf_mr: mmap of fd ") + std::to_string(fd) +
                  " failed: " + std::strerror(errno));
    }
    mapped_ = static_cast<uint8_t*>(mapped);
  }
  ~DmaBufMapping() { ::munmap(mapped_, mappedBytes_); }
  DmaBufMapping(const DmaBufMapping&) = delete;
  DmaBufMapping& operator=(const DmaBufMapping&) = delete;
  uint8_t* data() const { return mapped_ + lead_; }  // byte `offset` of the dma-buf

 private:
  uint8_t* mapped_ = nullptr;
  size_t mappedBytes_ = 0;
  uint64_t lead_ = 0;
};

class EmulatedMemoryRegion : public VerbsMemoryRegion {
 public:
  EmulatedMemoryRegion(std::shared_ptr<State> state, std::shared_ptr<ContextRecord> context,
                       MemoryRegionRecord record, std::unique_ptr<DmaBufMapping> mapping = nullptr)
      : state_(std::move(state)),
        context_(std::move(context)),
        record_(record),
        mapping_(std::move(mapping)) {
    Lock lock(state_->mutex);
    record_.lkey = state_->nextKey++;
    record_.rkey = state_->nextKey++;
    state_->byLkey[record_.lkey] = &record_;
    state_->byRkey[record_.rkey] = &record_;
    ++context_->liveRegions;
  }
  ~EmulatedMemoryRegion() override {
    Lock lock(state_->mutex);
    state_->byLkey.erase(record_.lkey);
    state_->byRkey.erase(record_.rkey);
    // ibv_dereg_mr on a closed context reads freed memory on a real host.
    if (context_->closed) ++state_->counters.deregAfterClose;
    --context_->liveRegions;
  }
  uint32_t lkey() const override { return record_.lkey; }
  uint32_t rkey() const override { return record_.rkey; }

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<ContextRecord> context_;  // only to detect a use after close, never keeps it open
  MemoryRegionRecord record_;
  std::unique_ptr<DmaBufMapping> mapping_;  // unmapped after the keys are gone
};

class EmulatedCompletionChannel : public VerbsCompletionChannel {
 public:
  explicit EmulatedCompletionChannel(std::shared_ptr<State> state) : state_(std::move(state)) {
    record_.events = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE));
    if (!record_.events.valid()) {
      throw Error(std::string("emulated ibv_create_comp_channel: eventfd: ") +
                  std::strerror(errno));
    }
  }
  ~EmulatedCompletionChannel() override {
    // A real channel refuses to go while CQs use it; here they are detached,
    // so nothing points at it afterwards.
    Lock lock(state_->mutex);
    for (CompletionQueueRecord* cq : state_->cqs) {
      if (cq->channel == &record_) cq->channel = nullptr;
    }
  }
  int fd() const override { return record_.events.get(); }
  VerbsCompletionQueue* takeEvent() override {
    Lock lock(state_->mutex);
    uint64_t one = 0;
    if (::read(record_.events.get(), &one, sizeof(one)) != sizeof(one)) return nullptr;  // EAGAIN
    CompletionQueueRecord* cq = record_.waiting.front();
    record_.waiting.pop_front();
    return cq->handle;
  }
  CompletionChannelRecord* record() { return &record_; }

 private:
  std::shared_ptr<State> state_;
  CompletionChannelRecord record_;
};

class EmulatedCompletionQueue : public VerbsCompletionQueue {
 public:
  EmulatedCompletionQueue(std::shared_ptr<State> state, int device, int depth,
                          CompletionChannelRecord* channel)
      : state_(std::move(state)), device_(device) {
    record_.handle = this;
    record_.depth = static_cast<size_t>(depth);
    record_.device = device;
    record_.channel = channel;
    Lock lock(state_->mutex);
    state_->cqs.push_back(&record_);
  }
  ~EmulatedCompletionQueue() override {
    Lock lock(state_->mutex);
    for (QueuePairRecord* qp : state_->allQps) {
      if (qp->sendCq == &record_) qp->sendCq = nullptr;
      if (qp->recvCq == &record_) qp->recvCq = nullptr;
    }
    state_->cqs.erase(std::find(state_->cqs.begin(), state_->cqs.end(), &record_));
    if (record_.channel == nullptr) return;
    // Events of this CQ not taken yet go with it (the kernel drops them too).
    auto& waiting = record_.channel->waiting;
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (*it != &record_) {
        ++it;
        continue;
      }
      it = waiting.erase(it);
      uint64_t one = 0;
      ssize_t taken = ::read(record_.channel->events.get(), &one, sizeof(one));
      (void)taken;  // the count matched `waiting`, so one was there
    }
  }
  int poll(WorkCompletion* out, int max) override {
    Lock lock(state_->mutex);
    int& failures = state_->devices[device_].pollFailures;
    if (failures > 0) {
      --failures;
      throw Error("ibv_poll_cq failed (returned -1)");
    }
    if (record_.overrun) {
      throw Error("ibv_poll_cq failed (returned -1): the completion queue overran its " +
                  std::to_string(record_.depth) + " entries");
    }
    int count = 0;
    while (count < max && !record_.entries.empty()) {
      const QueuedCompletion& queued = record_.entries.front();
      out[count++] = queued.wc;
      if (queued.sendSequence != 0) {
        auto qp = state_->qps.find(queued.wc.qpNumber);
        if (qp != state_->qps.end())
          qp->second->retired = std::max(qp->second->retired, queued.sendSequence);
      }
      record_.entries.pop_front();
    }
    state_->counters.completionsPolled += count;
    return count;
  }
  void requestNotify() override {
    Lock lock(state_->mutex);
    if (record_.channel == nullptr)
      throw Error("ibv_req_notify_cq on a CQ without a completion channel");
    record_.armed = true;
  }
  CompletionQueueRecord* record() { return &record_; }

 private:
  std::shared_ptr<State> state_;
  const int device_;
  CompletionQueueRecord record_;
};

class EmulatedQueuePair : public VerbsQueuePair {
 public:
  EmulatedQueuePair(std::shared_ptr<State> state, int device, CompletionQueueRecord* sendCq,
                    CompletionQueueRecord* recvCq, int maxSend, int maxRecv)
      : state_(std::move(state)) {
    Lock lock(state_->mutex);
    record_.qpNumber = state_->nextQpNumber++;
    record_.device = device;
    record_.sendCq = sendCq;
    record_.recvCq = recvCq;
    record_.maxSend = static_cast<size_t>(maxSend);
    record_.maxRecv = static_cast<size_t>(maxRecv);
    state_->qps[record_.qpNumber] = &record_;
    state_->allQps.push_back(&record_);
  }
  ~EmulatedQueuePair() override {
    Lock lock(state_->mutex);
    state_->qps.erase(record_.qpNumber);
    state_->allQps.erase(std::find(state_->allQps.begin(), state_->allQps.end(), &record_));
  }
  uint32_t qpNumber() const override { return record_.qpNumber; }

  void toInit(int port) override {
    Lock lock(state_->mutex);
    expect(QpState::kReset, "INIT");
    if (port != 1) throw Error("emulated devices have one port (1), not " + std::to_string(port));
    record_.state = QpState::kInit;
  }
  void toReadyToReceive(const QpPeer& peer, int port, int gidIndex, int mtu,
                        const QpRoute& route) override {
    Lock lock(state_->mutex);
    expect(QpState::kInit, "RTR");
    timeOutIfAsked("RTR");
    const auto& gids = state_->devices[record_.device].gids;
    if (gidIndex < 0 || gidIndex >= static_cast<int>(gids.size()) || gids[gidIndex].gid == Gid{}) {
      throw Error("source GID index " + std::to_string(gidIndex) + " is empty or out of range");
    }
    if (mtu < 1 || mtu > 5) throw Error("path MTU enum " + std::to_string(mtu) + " not in 1..5");
    const DeviceRecord& device = state_->devices[record_.device];
    if (device.ethernet && !peer.global)
      throw Error("RoCE needs a GRH (is_global) in the address vector (EINVAL)");
    if (!device.ethernet && !peer.global && peer.lid == 0) {
      throw Error("an InfiniBand address vector without a GRH needs a DLID (EINVAL)");
    }
    if (route.serviceLevel > 15) {
      throw Error("service level " + std::to_string(route.serviceLevel) + " not in 0..15 (4 bits)");
    }
    record_.peer = peer;
    record_.peer.packetSequence &= 0xFFFFFF;  // rq_psn: 24 bits, as the HCA keeps it
    record_.gidIndex = gidIndex;
    record_.sourceGid = gids[gidIndex].gid;
    record_.route = route;
    record_.state = QpState::kReadyToReceive;
  }
  void toReadyToSend(uint32_t packetSequence, int timeout, int retryCount) override {
    Lock lock(state_->mutex);
    expect(QpState::kReadyToReceive, "RTS");
    timeOutIfAsked("RTS");
    if (timeout < 1 || timeout > 31 || retryCount < 0 || retryCount > 7) {
      throw Error("timeout " + std::to_string(timeout) + " / retry count " +
                  std::to_string(retryCount) + " outside 1..31 / 0..7");
    }
    record_.retryBudgetNs = retryBudgetNs(timeout, retryCount);
    record_.sendPsn = packetSequence & 0xFFFFFF;
    record_.state = QpState::kReadyToSend;
  }
  void toError() override {
    Lock lock(state_->mutex);
    state_->toError(record_);
  }
  bool postSend(const SendRequest& request, std::string* error) override {
    Lock lock(state_->mutex);
    if (record_.state != QpState::kReadyToSend && record_.state != QpState::kError) {
      *error = std::string("post_send on a QP in ") + qpStateName(record_.state) + " (EINVAL)";
      return false;
    }
    // A slot frees when the request's completion, or a later one's, is
    // polled, not when the request executes (as on a real HCA).
    if (record_.posted - record_.retired >= record_.maxSend) {
      *error = "send queue full: " + std::to_string(record_.maxSend) +
               " requests whose completions were not polled yet (ENOMEM)";
      return false;
    }
    const uint64_t sequence = ++record_.posted;
    if (record_.state == QpState::kError) {
      state_->completeSend(record_, request, WcStatus::kFlushed, sequence);
      return true;
    }
    PendingSend pending;
    pending.request = request;
    pending.sequence = sequence;
    record_.sends.push_back(pending);
    state_->work.notify_all();
    return true;
  }
  bool postRecv(const RecvRequest& request, std::string* error) override {
    Lock lock(state_->mutex);
    if (record_.state == QpState::kError) {
      WorkCompletion wc;
      wc.qpNumber = record_.qpNumber;
      wc.wrId = request.wrId;
      wc.status = WcStatus::kFlushed;
      wc.opcode = WcOpcode::kRecv;
      state_->complete(record_.recvCq, wc);
      return true;
    }
    if (record_.state == QpState::kReset) {
      *error = "post_recv on a QP in RESET (EINVAL)";
      return false;
    }
    if (record_.recvs.size() >= record_.maxRecv) {
      *error = "receive queue full (ENOMEM)";
      return false;
    }
    record_.recvs.push_back(request);
    state_->work.notify_all();
    return true;
  }

 private:
  // failNext(device, "modify_qp"): the transition is refused with ETIMEDOUT
  // and the QP keeps its state, as when RoCE neighbour resolution times out.
  void timeOutIfAsked(const char* to) {
    int& timeouts = state_->devices[record_.device].modifyTimeouts;
    if (timeouts == 0) return;
    --timeouts;
    throw ModifyQpTimedOut(std::string("ibv_modify_qp to ") + to + ": " + std::strerror(ETIMEDOUT));
  }
  void expect(QpState from, const char* to) {
    if (record_.state != from) {
      throw Error(std::string("invalid QP transition ") + qpStateName(record_.state) + "->" + to);
    }
  }

  std::shared_ptr<State> state_;
  QueuePairRecord record_;
};

class EmulatedDevice : public VerbsDevice {
 public:
  // Called with the lock held (open() checks the device is there).
  EmulatedDevice(std::shared_ptr<State> state, int device)
      : state_(std::move(state)), device_(device), context_(std::make_shared<ContextRecord>()) {
    events_.generation = state_->devices[device_].generation;
    state_->devices[device_].listeners.push_back(&events_);
  }
  ~EmulatedDevice() override {
    Lock lock(state_->mutex);
    auto& listeners = state_->devices[device_].listeners;
    listeners.erase(std::find(listeners.begin(), listeners.end(), &events_));
    // ibv_dealloc_pd refuses (EBUSY) while memory regions remain; closing
    // anyway leaves them dangling.
    if (context_->liveRegions > 0) ++state_->counters.closedWithRegions;
    context_->closed = true;
  }
  std::string name() const override { return state_->devices[device_].name; }
  std::string pciPath() const override {
    Lock lock(state_->mutex);
    return state_->devices[device_].pciPath;
  }

  PortAttributes queryPort(int port) override {
    checkPort(port);
    Lock lock(state_->mutex);
    checkAlive("ibv_query_port");
    PortAttributes attributes;
    attributes.active = state_->devices[device_].portUp;
    attributes.ethernet = state_->devices[device_].ethernet;
    attributes.lid = state_->devices[device_].lid;
    attributes.activeMtu = 3;  // 1024, the usual RoCE MTU
    attributes.gidTableLength = static_cast<int>(state_->devices[device_].gids.size());
    attributes.speedMbps = kEmulatedPortMbps;
    return attributes;
  }
  bool queryGidTable(int port, std::vector<GidEntry>* out, std::string* why) override {
    checkPort(port);
    Lock lock(state_->mutex);
    checkAlive("ibv_query_gid_table");
    const DeviceRecord& device = state_->devices[device_];
    if (!device.gidSources.table) {
      *why = "emulated libibverbs without ibv_query_gid_table";
      return false;
    }
    for (const GidEntry& entry : device.gids) {
      if (entry.gid != Gid{}) out->push_back(entry);  // valid entries only, as the real call
    }
    ++state_->counters.gidTableQueries;
    return true;
  }
  GidEntry queryGid(int port, int index) override {
    checkPort(port);
    Lock lock(state_->mutex);
    checkAlive("ibv_query_gid");
    ++state_->counters.gidQueries;
    const DeviceRecord& device = state_->devices[device_];
    const auto& gids = device.gids;
    if (index < 0 || index >= static_cast<int>(gids.size())) {
      throw Error("GID index " + std::to_string(index) + " out of range 0.." +
                  std::to_string(gids.size() - 1));
    }
    GidEntry entry = gids[index];
    if (!device.gidSources.queryEx && !device.gidSources.sysfs) entry.type = GidType::kUnknown;
    return entry;
  }
  std::unique_ptr<VerbsMemoryRegion> registerMemory(void* address, size_t bytes, bool remoteWrite,
                                                    bool relaxedOrdering) override {
    if (address == nullptr || bytes == 0) throw Error("cannot register an empty memory region");
    checkRelaxedOrdering(relaxedOrdering);
    checkAliveLocked("ibv_reg_mr");
    MemoryRegionRecord record;
    record.relaxedOrdering = relaxedOrdering;
    record.device = device_;
    record.base = static_cast<uint8_t*>(address);
    record.iova = reinterpret_cast<uint64_t>(address);
    record.bytes = bytes;
    record.remoteWrite = remoteWrite;
    return std::make_unique<EmulatedMemoryRegion>(state_, context_, record);
  }
  bool supportsDmaBuf(std::string*) const override { return true; }
  bool supportsRelaxedOrdering() const override {
    Lock lock(state_->mutex);
    return state_->devices[device_].relaxedOrdering;
  }
  std::unique_ptr<VerbsMemoryRegion> registerPeerMemory(void*, size_t, bool) override {
    throw Error(
        "the verbs emulation cannot register GPU memory by pointer (on a real host that "
        "needs nvidia-peermem); register it as a dma-buf instead");
  }
  std::unique_ptr<VerbsMemoryRegion> registerDmaBuf(int fd, uint64_t offset, size_t bytes,
                                                    uint64_t iova, bool relaxedOrdering) override {
    if (bytes == 0 || iova == 0) throw Error("cannot register an empty dma-buf range");
    checkRelaxedOrdering(relaxedOrdering);
    checkAliveLocked("ibv_reg_dmabuf_mr");
    {
      Lock lock(state_->mutex);
      if (state_->devices[device_].refuseDmaBuf) {
        throw Error(
            "emulated ibv_reg_dmabuf_mr on " + state_->devices[device_].name +
            ": cannot import the dma-buf (no peer-to-peer path to its memory) (EOPNOTSUPP)");
      }
    }
    // Like a real NIC, the emulation reaches the memory through the fd (its
    // own mapping), never through the caller's address `iova`.
    auto mapping = std::make_unique<DmaBufMapping>(fd, offset, bytes, iova);
    MemoryRegionRecord record;
    record.device = device_;
    record.base = mapping->data();
    record.iova = iova;
    record.bytes = bytes;
    record.remoteWrite = true;
    record.remoteRead = true;
    record.relaxedOrdering = relaxedOrdering;
    return std::make_unique<EmulatedMemoryRegion>(state_, context_, record, std::move(mapping));
  }
  std::unique_ptr<VerbsCompletionChannel> createCompletionChannel() override {
    checkAliveLocked("ibv_create_comp_channel");
    return std::make_unique<EmulatedCompletionChannel>(state_);
  }
  std::unique_ptr<VerbsCompletionQueue> createCompletionQueue(
      int depth, VerbsCompletionChannel* channel) override {
    if (depth < 1) throw Error("completion queue depth must be at least 1");
    checkAliveLocked("ibv_create_cq");
    CompletionChannelRecord* events = nullptr;
    if (channel != nullptr) {
      auto* emulated = dynamic_cast<EmulatedCompletionChannel*>(channel);
      if (emulated == nullptr) throw Error("a completion channel of another provider");
      events = emulated->record();
    }
    return std::make_unique<EmulatedCompletionQueue>(state_, device_, depth, events);
  }
  std::unique_ptr<VerbsQueuePair> createQueuePair(VerbsCompletionQueue* sendCq,
                                                  VerbsCompletionQueue* recvCq, int maxSend,
                                                  int maxRecv) override {
    auto* send = dynamic_cast<EmulatedCompletionQueue*>(sendCq);
    auto* recv = dynamic_cast<EmulatedCompletionQueue*>(recvCq);
    if (send == nullptr || recv == nullptr) throw Error("completion queues of another provider");
    checkAliveLocked("ibv_create_qp");
    return std::make_unique<EmulatedQueuePair>(state_, device_, send->record(), recv->record(),
                                               maxSend, maxRecv);
  }
  bool waitAsyncEvent(AsyncEvent* event, Millis timeout) override {
    Lock lock(state_->mutex);
    if (!state_->events.wait_for(lock, timeout, [&] {
          return !events_.events.empty() || state_->stopping || interrupted_;
        })) {
      return false;
    }
    if (events_.events.empty() || interrupted_) return false;
    *event = events_.events.front();
    events_.events.pop_front();
    return true;
  }
  void interruptAsyncWait() override {
    Lock lock(state_->mutex);
    interrupted_ = true;
    state_->events.notify_all();
  }

 private:
  // A library without ibv_reg_mr_iova2 has only the plain ibv_reg_mr, which
  // rejects the optional flag (EINVAL).
  void checkRelaxedOrdering(bool asked) const {
    if (asked && !supportsRelaxedOrdering()) {
      throw Error(
          "emulated ibv_reg_mr: IBV_ACCESS_RELAXED_ORDERING without ibv_reg_mr_iova2 (EINVAL)");
    }
  }
  static void checkPort(int port) {
    if (port != 1) throw Error("emulated devices have one port (1), not " + std::to_string(port));
  }
  // After a fatal error the context is dead for good (EIO), even once the
  // device is back: only a fresh ibv_open_device works again. Lock held.
  void checkAlive(const char* call) const {
    const DeviceRecord& device = state_->devices[device_];
    if (device.fatal || device.generation != events_.generation) {
      throw Error(std::string("emulated ") + call + " on " + device.name +
                  ": the device had a fatal error; this context is dead, reopen the device (EIO)");
    }
  }
  void checkAliveLocked(const char* call) const {
    Lock lock(state_->mutex);
    checkAlive(call);
  }

  std::shared_ptr<State> state_;
  const int device_;
  std::shared_ptr<ContextRecord> context_;
  AsyncQueue events_;
  bool interrupted_ = false;  // guarded by state_->mutex
};

}  // namespace

VerbsEmulation::VerbsEmulation(std::vector<std::string> devices)
    : state_(std::make_shared<State>()) {
  if (devices.empty()) throw ConfigError("an emulation needs at least one device");
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].empty()) throw ConfigError("emulated device names must not be empty");
    for (size_t j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) throw ConfigError("duplicate emulated device " + devices[i]);
    }
    DeviceRecord record;
    record.name = devices[i];
    record.gids = buildGidTable(static_cast<int>(i), 0, {});
    state_->devices.push_back(std::move(record));
  }
  thread_ = std::thread([this] { run(); });
}

VerbsEmulation::~VerbsEmulation() {
  {
    Lock lock(state_->mutex);
    state_->stopping = true;
    state_->work.notify_all();
    state_->events.notify_all();
  }
  thread_.join();
}

void VerbsEmulation::run() {
  nameThisThread("reccl-ibemu");
  Lock lock(state_->mutex);
  while (!state_->stopping) {
    const bool landed = state_->land(nowNs());
    if (state_->step(nowNs()) || landed) continue;
    // Requests waiting (a route, a receive, their retry budget) are retried
    // every millisecond; with none, only new work (which notifies) can change
    // anything, so an idle fabric sleeps.
    if (state_->retrying()) {
      state_->work.wait_for(lock, Millis(1));
    } else {
      state_->work.wait(lock);
    }
  }
}

std::vector<std::string> VerbsEmulation::deviceNames() {
  Lock lock(state_->mutex);
  // A device gone after a fatal error is not listed; one that came back is
  // listed after the others.
  std::vector<const DeviceRecord*> listed;
  for (const auto& device : state_->devices) {
    if (!device.fatal) listed.push_back(&device);
  }
  std::stable_sort(listed.begin(), listed.end(), [](const DeviceRecord* a, const DeviceRecord* b) {
    return a->listedAt < b->listedAt;
  });
  std::vector<std::string> names;
  for (const DeviceRecord* device : listed) names.push_back(device->name);
  return names;
}

std::shared_ptr<VerbsDevice> VerbsEmulation::open(const std::string& name) {
  Lock lock(state_->mutex);
  const int index = state_->deviceIndex(name);
  if (state_->devices[index].fatal) {
    throw Error("emulated ibv_open_device: " + name + " is gone after a fatal error (ENODEV)");
  }
  return std::make_shared<EmulatedDevice>(state_, index);
}

bool VerbsEmulation::peerMemoryLoaded(std::string* why) const {
  if (peerMemory_.load()) return true;
  *why = "the emulation has no peer-memory module (IbEmulation.set_peer_memory)";
  return false;
}

void VerbsEmulation::setPeerMemoryLoaded(bool loaded) { peerMemory_.store(loaded); }

void VerbsEmulation::setDeviceFatal(const std::string& device) {
  state_->withDevice(device, [&](DeviceRecord& record, int index) {
    if (record.fatal) return;
    state_->raise(index, AsyncEventType::kDeviceFatal);  // the last event its contexts hear
    record.fatal = true;
    ++record.generation;
    for (QueuePairRecord* qp : state_->allQps) {
      if (qp->device == index) state_->toError(*qp);
    }
    state_->work.notify_all();
  });
}

void VerbsEmulation::recoverDevice(const std::string& device) {
  state_->withDevice(device, [&](DeviceRecord& record, int) {
    if (record.fatal) record.listedAt = ++state_->relisted;
    record.fatal = false;
    state_->work.notify_all();
  });
}

void VerbsEmulation::setRefuseDmaBuf(const std::string& device, bool refuse) {
  state_->withDevice(device, [&](DeviceRecord& record, int) { record.refuseDmaBuf = refuse; });
}

void VerbsEmulation::setPortUp(const std::string& device, bool up) {
  state_->withDevice(device, [&](DeviceRecord& record, int index) {
    if (record.portUp == up) return;
    record.portUp = up;
    if (up && !record.ethernet) {
      state_->raise(index, AsyncEventType::kPortActive);  // an IB port's GID stays where it was
    } else if (up) {
      record.gids = buildGidTable(index, ++record.flaps, record.extraGids);
      state_->raise(index, AsyncEventType::kGidChange);
      state_->raise(index, AsyncEventType::kPortActive);
    } else {
      state_->raise(index, AsyncEventType::kPortError);
    }
    state_->work.notify_all();
  });
}

void VerbsEmulation::setDrop(const std::string& device, bool drop) {
  state_->withDevice(device, [&](DeviceRecord& record, int) {
    record.drop = drop;
    state_->work.notify_all();
  });
}

void VerbsEmulation::setHold(const std::string& device, bool hold) {
  state_->withDevice(device, [&](DeviceRecord& record, int index) {
    record.hold = hold;
    if (!hold) state_->releaseWire(index);
    state_->work.notify_all();
  });
}

void VerbsEmulation::failNext(const std::string& device, const std::string& call, int times) {
  if (call != "poll_cq" && call != "modify_qp") {
    throw ConfigError("verbs call '" + call + "' cannot be failed: expected poll_cq or modify_qp");
  }
  if (times < 0) throw ConfigError("failNext times must be >= 0, not " + std::to_string(times));
  state_->withDevice(device, [&](DeviceRecord& record, int) {
    (call == "poll_cq" ? record.pollFailures : record.modifyTimeouts) = times;
  });
}

void VerbsEmulation::corruptNext(const std::string& device, const std::string& kind) {
  if (kind != "immediate" && kind != "payload") {
    throw ConfigError("corruption kind '" + kind + "' is not valid: expected immediate or payload");
  }
  state_->withDevice(device, [&](DeviceRecord& record, int) { record.corruptKind = kind; });
}

std::vector<QpRoute> VerbsEmulation::connectedRoutes(const std::string& device) {
  return state_->ofConnectedQps(device, [](const QueuePairRecord& qp) { return qp.route; });
}

std::vector<bool> VerbsEmulation::connectedGlobal(const std::string& device) {
  return state_->ofConnectedQps(device, [](const QueuePairRecord& qp) { return qp.peer.global; });
}

std::vector<int> VerbsEmulation::connectedGidIndexes(const std::string& device) {
  return state_->ofConnectedQps(device, [](const QueuePairRecord& qp) { return qp.gidIndex; });
}

void VerbsEmulation::setLosslessClass(const std::string& device, int trafficClass) {
  state_->withDevice(device,
                     [&](DeviceRecord& record, int) { record.losslessClass = trafficClass; });
}

void VerbsEmulation::setLandingDelay(const std::string& device, Millis delay) {
  if (delay.count() < 0) throw ConfigError("a landing delay must be >= 0 ms");
  state_->withDevice(device, [&](DeviceRecord& record, int) {
    record.landingDelayNs = std::chrono::duration_cast<std::chrono::nanoseconds>(delay).count();
  });
}

void VerbsEmulation::setInfiniband(const std::string& device, uint64_t subnetPrefix) {
  state_->withDevice(device, [&](DeviceRecord& record, int index) {
    record.ethernet = false;
    record.lid = static_cast<uint16_t>(index + 1);
    record.subnetPrefix = subnetPrefix;
    record.gids = buildIbGidTable(index, subnetPrefix);
  });
}

void VerbsEmulation::overrunCompletionQueues(const std::string& device) {
  state_->withDevice(device, [&](DeviceRecord&, int index) {
    for (CompletionQueueRecord* cq : state_->cqs) {
      if (cq->device == index && !cq->overrun) state_->overrun(cq);
    }
  });
}

void VerbsEmulation::setRelaxedOrdering(const std::string& device, bool supported) {
  state_->withDevice(device,
                     [&](DeviceRecord& record, int) { record.relaxedOrdering = supported; });
}

std::pair<int, int> VerbsEmulation::memoryRegions(const std::string& device) {
  return state_->withDevice(device, [&](DeviceRecord&, int index) {
    std::pair<int, int> out{0, 0};
    for (const auto& [key, region] : state_->byLkey) {
      if (region->device != index) continue;
      ++out.first;
      if (region->relaxedOrdering) ++out.second;
    }
    return out;
  });
}

void VerbsEmulation::setGidSources(const std::string& device, GidSources sources) {
  state_->withDevice(device, [&](DeviceRecord& record, int) { record.gidSources = sources; });
}

void VerbsEmulation::addGid(const std::string& device, const Gid& gid, GidType type) {
  state_->withDevice(device, [&](DeviceRecord& record, int index) {
    record.extraGids.push_back({gid, type});
    record.gids = buildGidTable(index, record.flaps, record.extraGids);
    state_->raise(index, AsyncEventType::kGidChange);
  });
}

void VerbsEmulation::setPciPath(const std::string& device, const std::string& path) {
  state_->withDevice(device, [&](DeviceRecord& record, int) { record.pciPath = path; });
}

uint64_t VerbsEmulation::readsOn(const std::string& device) {
  return state_->withDevice(device, [](DeviceRecord& record, int) { return record.reads; });
}

std::vector<GidEntry> VerbsEmulation::gidTable(const std::string& device) {
  return state_->withDevice(device, [](DeviceRecord& record, int) { return record.gids; });
}

EmulationCounters VerbsEmulation::counters() {
  Lock lock(state_->mutex);
  return state_->counters;
}

}  // namespace reccl
