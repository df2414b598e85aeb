// An in-process verbs "fabric" with reliable-connected (RC) semantics, so the IB
// transport runs and is tested where there is no RDMA hardware. Several
// transports in one process share one emulation: each opens its own devices.
//
// What it models: devices with one RoCE port (or, set_infiniband, an IB port
// with a LID; state, GID table), protection
// domains, memory regions with lkey/rkey, bounds and access checks, completion
// queues and completion channels (an eventfd; an armed CQ raises one event at
// its next completion, then stays quiet until re-armed), RC QPs with the
// RESET->INIT->RTR->RTS->ERR state machine, and in-order execution of SEND,
// RDMA WRITE and RDMA WRITE WITH IMMEDIATE by one progress thread, which sleeps
// while no request waits. A request that cannot be delivered (a port down, a
// blackholed device, a peer QP not ready, a stale GID) is retried until the
// QP's budget 4.096 us * 2^timeout * (retry_cnt + 1) runs out, then completes
// with kRetryExceeded and the QP goes to ERR; moving a QP to ERR flushes every
// outstanding request (kFlushed). A SEND or WRITE WITH IMMEDIATE meets an
// empty receive queue with unbounded RNR retry (rnr_retry = 7), as we
// configure real QPs, and is counted (rnrNaks). A fatal device error kills the
// contexts open on it for good (setDeviceFatal). Memory regions of dma-buf fds are reached through
// the emulation's own mapping of the fd (a memfd stands in for a GPU's dma-buf). Port changes raise
// PORT_ERR / PORT_ACTIVE (and GID_CHANGE) async events; every link flap moves the RoCEv2 GIDs to
// other table indices, as re-added addresses do on real hosts.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "transport/ib/verbs_api.h"

namespace reccl {

struct EmulationCounters {
  uint64_t sends = 0;  // SENDs delivered
  uint64_t writes = 0;  // RDMA WRITEs delivered (with or without immediate)
  uint64_t writesWithImmediate = 0;  // of those, WRITE WITH IMMEDIATE (the staged chunks)
  uint64_t reads = 0;  // RDMA READs served (the GPU flush)
  uint64_t bytes = 0;  // payload bytes delivered
  uint64_t flushed = 0;  // completions with kFlushed
  uint64_t retryExceeded = 0;  // completions with kRetryExceeded
  uint64_t accessErrors = 0;  // kRemoteAccess / kLocalProtection / length errors
  uint64_t dropped = 0;  // requests swallowed by a blackholed device (per try)
  uint64_t corrupted = 0;  // deliveries altered by corruptNext
  uint64_t qpErrors = 0;  // QPs that entered ERR
  uint64_t landedLate = 0;  // deliveries that reached memory after a landing delay
  uint64_t cqOverruns = 0;  // CQs that got more completions than their depth
  uint64_t held = 0;  // requests parked on the wire by setHold
  uint64_t wireDelivered = 0;  // parked requests that landed when the hold ended
  uint64_t wireDropped = 0;  // parked requests their responder no longer took
  uint64_t rnrNaks = 0;  // receive-consuming requests that met an empty receive queue
  uint64_t closedWithRegions = 0;  // contexts closed while memory regions of theirs were live
  uint64_t deregAfterClose = 0;  // memory regions deregistered after their context closed
  uint64_t completionEvents = 0;  // completion-channel events raised (armed CQs completing)
  uint64_t completionsPolled = 0;  // completions taken by ibv_poll_cq
  uint64_t gidTableQueries = 0;  // ibv_query_gid_table calls answered
  uint64_t gidQueries = 0;  // ibv_query_gid(_ex) calls (one GID each)
};

// Where an emulated device's GID types can be read from, as on hosts with
// different rdma-core versions and sysfs views. The kernel always knows them.
struct GidSources {
  bool table = true;  // ibv_query_gid_table (rdma-core v30+)
  bool queryEx = true;  // ibv_query_gid_ex (rdma-core v30+)
  bool sysfs = true;  // gid_attrs/types (false: hidden, as in some containers)
};

class VerbsEmulation : public VerbsApi {
 public:
  // `devices`: the names of the emulated devices (one port each, up).
  explicit VerbsEmulation(std::vector<std::string> devices);
  ~VerbsEmulation() override;
  VerbsEmulation(const VerbsEmulation&) = delete;
  VerbsEmulation& operator=(const VerbsEmulation&) = delete;

  std::string describe() const override { return "emulation"; }
  std::vector<std::string> deviceNames() override;
  std::shared_ptr<VerbsDevice> open(const std::string& name) override;
  // The probe only: the emulation never registers GPU memory by pointer.
  bool peerMemoryLoaded(std::string* why) const override;
  void setPeerMemoryLoaded(bool loaded);

  // Faults. A port going down raises PORT_ERR; coming back it gets a new GID
  // table layout and raises GID_CHANGE and PORT_ACTIVE.
  void setPortUp(const std::string& device, bool up);
  // Silently drops every packet to and from the device (no event, no error
  // until the retry budget runs out), like a blackholed switch port.
  void setDrop(const std::string& device, bool drop);
  // Packets in flight: while on, every request the device sends leaves its
  // QP at once (with the bytes it reads then) but stays on the wire, with no
  // completion yet; moving the sending QP to ERR flushes it at the sender but
  // does not recall it. Turning it off delivers what is parked, in order, to
  // every responder QP still in RTR/RTS: a responder in ERR drops it (so does
  // one with no receive posted for a SEND: no RNR retry on release). This is
  // how tests show that a stale write of an old path cannot land once the
  // receiver fenced that path.
  void setHold(const std::string& device, bool hold);
  // Deliveries to the device are accepted (and acknowledged) at once but
  // reach its memory `delay` later, in order, even if the responder QP went
  // to ERR meanwhile: a write the HCA accepted just before its QP was moved
  // to ERR still lands (why a receiver waits RECCL_IB_FENCE_DELAY_MS after
  // the fence before it reports what it has).
  void setLandingDelay(const std::string& device, Millis delay);
  // Every CQ of the device overruns now (CQ_ERR; their QPs go to ERR; polling
  // them fails), as if each had got more completions than its depth.
  void overrunCompletionQueues(const std::string& device);
  // A fatal device error (IBV_EVENT_DEVICE_FATAL, as after a firmware reset):
  // every QP of the device goes to ERR, every context opened on it is dead for
  // good (verbs calls fail with EIO, no more async events) and opening the
  // device fails until recoverDevice; then only a fresh open works. Gone, it
  // is not listed; back, it is listed after the others (a driver re-probe
  // adds it again), so only its name finds it.
  void setDeviceFatal(const std::string& device);
  void recoverDevice(const std::string& device);
  // Whether ibv_reg_dmabuf_mr on the device fails (EOPNOTSUPP), as on a NIC
  // that cannot reach the GPU's memory peer-to-peer.
  void setRefuseDmaBuf(const std::string& device, bool refuse);
  // The device's RoCE fabric is lossless (PFC) for `trafficClass` only:
  // requests of QPs in another class, to or from it, are dropped (congestion
  // drops, here always) until the retry budget runs out. -1: every class.
  void setLosslessClass(const std::string& device, int trafficClass);
  // Whether the device's library can ask for relaxed ordering (it has
  // ibv_reg_mr_iova2); without, a registration asking for it fails (EINVAL).
  void setRelaxedOrdering(const std::string& device, bool supported);
  // Makes the device's port InfiniBand (before anything opens it): LID =
  // its position + 1, one IB GID (subnetPrefix + a GUID) at index 0. Packets
  // go by DLID within a subnet and need a GRH (the GID) across subnets; an IB
  // port and a RoCE one never reach each other.
  void setInfiniband(const std::string& device, uint64_t subnetPrefix);
  // Whether each of the device's QPs in RTR/RTS sends with a GRH.
  std::vector<bool> connectedGlobal(const std::string& device);
  // The device's live memory regions: (all, those with relaxed ordering).
  std::pair<int, int> memoryRegions(const std::string& device);
  // Alters the next delivery sent from `device`: "immediate" (an out-of-range
  // immediate), "payload" (the first payload byte flipped).
  void corruptNext(const std::string& device, const std::string& kind);
  // The next `times` calls of `call` on the device fail as real hardware can:
  // "poll_cq" (ibv_poll_cq on any of its CQs returns < 0) or "modify_qp" (its
  // QPs' INIT->RTR and RTR->RTS transitions answer ETIMEDOUT, state unchanged).
  void failNext(const std::string& device, const std::string& call, int times);
  std::vector<GidEntry> gidTable(const std::string& device);
  // How the device's GID types can be read (a real queryGid without ex and
  // sysfs answers kUnknown).
  void setGidSources(const std::string& device, GidSources sources);
  // Adds an address to the device's table (after its link-local pair, so
  // below the IPv4 GID's index), kept over flaps.
  void addGid(const std::string& device, const Gid& gid, GidType type);
  // The source GID index of each of the device's QPs now in RTR or RTS.
  std::vector<int> connectedGidIndexes(const std::string& device);
  // The traffic class and service level of each of the device's QPs now in RTR or RTS.
  std::vector<QpRoute> connectedRoutes(const std::string& device);
  EmulationCounters counters();
  // The PCI path the device reports (none by default).
  void setPciPath(const std::string& device, const std::string& path);
  // RDMA READs served to QPs of the device (the GPU flush's, per NIC).
  uint64_t readsOn(const std::string& device);

  struct State;  // shared with the handles it gives out

 private:
  void run();

  std::shared_ptr<State> state_;
  std::thread thread_;
  std::atomic<bool> peerMemory_{false};
};

}  // namespace reccl
