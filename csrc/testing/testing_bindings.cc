// The test module torch_reccl._testing: the in-process verbs emulation (RC
// semantics, fault hooks) with raw verbs objects over it, the CUDA emulation,
// the provider-install calls that run the NCCL plugin over them, the IB
// transport's pure rules, same-host reads, one handshake as a dialer sees it,
// and (core_bindings.cc, timing_bindings.cc) the test hooks of the core and the
// transport layer.
// Nothing here is in libnccl-net-reccl.so, the library NCCL loads; this module
// links it, so the plugin it configures is the process's one plugin.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "core/error.h"
#include "nccl/net_plugin.h"
#include "testing/cuda_emulation.h"
#include "testing/verbs_emulation.h"
#include "transport/hello_dial.h"
#include "transport/ib/gid_select.h"
#include "transport/ib/qp_exchange.h"
#include "transport/ib/verbs_library.h"
#include "transport/same_host.h"

namespace py = pybind11;
using namespace reccl;

namespace {

const char* gidTypeName(GidType type) {
  switch (type) {
    case GidType::kIb: return "IB";
    case GidType::kRoceV1: return "RoCEv1";
    case GidType::kRoceV2: return "RoCEv2";
    case GidType::kUnknown: return "unknown";
  }
  return "unknown";
}

GidType gidTypeNamed(const std::string& name) {
  for (GidType type : {GidType::kIb, GidType::kRoceV1, GidType::kRoceV2, GidType::kUnknown}) {
    if (name == gidTypeName(type)) return type;
  }
  throw ConfigError("GID type '" + name + "' is not valid: expected IB, RoCEv1, RoCEv2 or unknown");
}

// (gid bytes, type name) at each entry's table index; empty indexes all-zero.
py::list gidList(const std::vector<GidEntry>& table) {
  std::vector<GidEntry> dense;
  for (const auto& entry : table) {
    if (entry.index >= static_cast<int>(dense.size()))
      dense.resize(static_cast<size_t>(entry.index) + 1);
    dense[static_cast<size_t>(entry.index)] = entry;
  }
  py::list out;
  for (const auto& entry : dense) {
    out.append(py::make_tuple(py::bytes(reinterpret_cast<const char*>(entry.gid.data()), 16),
                              gidTypeName(entry.type)));
  }
  return out;
}

// A registered Python buffer (the region keeps it alive), or a dma-buf range
// the NIC addresses from `base`.
struct PyRegion {
  py::object owner;
  uint64_t base = 0;
  size_t size = 0;
  std::unique_ptr<VerbsMemoryRegion> region;
  uint64_t address(size_t offset, size_t length) const {
    if (offset > size || length > size - offset) {
      throw ConfigError("range [" + std::to_string(offset) + ", +" + std::to_string(length) +
                        ") outside the registered " + std::to_string(size) + " bytes");
    }
    return base + offset;
  }
};

py::dict completionDict(const WorkCompletion& wc) {
  static const char* const kOpcodes[] = {"send",      "rdma_write", "recv", "recv_rdma_with_imm",
                                         "rdma_read", "other"};
  py::dict d;
  d["wr_id"] = wc.wrId;
  d["status"] = wcStatusName(wc.status);
  d["opcode"] = kOpcodes[static_cast<int>(wc.opcode)];
  d["byte_len"] = wc.byteLength;
  d["imm"] = wc.hasImmediate ? py::object(py::int_(wc.immediate)) : py::none();
  d["qp_num"] = wc.qpNumber;
  d["vendor_err"] = wc.vendorError;
  return d;
}

SendRequest::Op opFromName(const std::string& op) {
  if (op == "send") return SendRequest::Op::kSend;
  if (op == "write") return SendRequest::Op::kWrite;
  if (op == "write_imm") return SendRequest::Op::kWriteWithImmediate;
  if (op == "read") return SendRequest::Op::kRead;
  throw ConfigError("operation '" + op + "' is not valid: expected send, write, write_imm or read");
}

// Raw verbs objects of the emulation, so tests can check its RC semantics
// directly (tests/transport/test_ib_emulation.py).
void bindRawVerbs(py::module_& m) {
  py::class_<PyRegion, std::shared_ptr<PyRegion>>(m, "IbMemoryRegion")
      .def_property_readonly("lkey", [](const PyRegion& r) { return r.region->lkey(); })
      .def_property_readonly("rkey", [](const PyRegion& r) { return r.region->rkey(); })
      .def("address", &PyRegion::address, py::arg("offset") = 0, py::arg("length") = 0);
  py::class_<VerbsCompletionQueue, std::shared_ptr<VerbsCompletionQueue>>(m, "IbCompletionQueue")
      .def(
          "poll",
          [](VerbsCompletionQueue& cq, int max) {
            std::vector<WorkCompletion> wcs(static_cast<size_t>(std::max(max, 1)));
            int got = cq.poll(wcs.data(), static_cast<int>(wcs.size()));
            py::list out;
            for (int i = 0; i < got; ++i) out.append(completionDict(wcs[i]));
            return out;
          },
          py::arg("max") = 64)
      .def("arm", &VerbsCompletionQueue::requestNotify,
           "ibv_req_notify_cq: one event for the next completion");
  py::class_<VerbsCompletionChannel, std::shared_ptr<VerbsCompletionChannel>>(m,
                                                                              "IbCompletionChannel")
      .def_property_readonly("fd", &VerbsCompletionChannel::fd)
      // The CQ object the event announces (the one create_cq returned), or None.
      .def("take_event", &VerbsCompletionChannel::takeEvent, py::return_value_policy::reference);
  py::class_<VerbsQueuePair, std::shared_ptr<VerbsQueuePair>>(m, "IbQueuePair")
      .def_property_readonly("qp_number", &VerbsQueuePair::qpNumber)
      .def("to_init", [](VerbsQueuePair& qp) { qp.toInit(1); })
      .def(
          "to_rtr",
          [](VerbsQueuePair& qp, uint32_t peerQp, py::bytes peerGid, int gidIndex,
             uint32_t peerPsn) {
            std::string raw = peerGid;
            if (raw.size() != 16) throw ConfigError("a GID has 16 bytes");
            QpPeer peer;
            peer.qpNumber = peerQp;
            peer.packetSequence = peerPsn;
            std::memcpy(peer.gid.data(), raw.data(), 16);
            qp.toReadyToReceive(peer, 1, gidIndex, 3, QpRoute{});
          },
          py::arg("peer_qp"), py::arg("peer_gid"), py::arg("gid_index"), py::arg("peer_psn") = 0,
          "INIT->RTR; peer_psn: the rq_psn, the PSN the peer's RTS will start from")
      .def(
          "to_rts",
          [](VerbsQueuePair& qp, int timeout, int retry, uint32_t psn) {
            qp.toReadyToSend(psn, timeout, retry);
          },
          py::arg("timeout"), py::arg("retry_count"), py::arg("psn") = 0)
      .def("to_error", &VerbsQueuePair::toError)
      .def(
          "post_send",
          [](VerbsQueuePair& qp, const std::string& op, const PyRegion& local, size_t offset,
             size_t length, uint64_t remoteAddress, uint32_t rkey, uint32_t imm, uint64_t wrId,
             bool signaled) {
            SendRequest request;
            request.wrId = wrId;
            request.signaled = signaled;
            request.op = opFromName(op);
            request.sge = {local.address(offset, length), static_cast<uint32_t>(length),
                           local.region->lkey()};
            request.remoteAddress = remoteAddress;
            request.rkey = rkey;
            request.immediate = imm;
            std::string error;
            if (!qp.postSend(request, &error)) throw Error(error);
          },
          py::arg("op"), py::arg("local"), py::arg("offset"), py::arg("length"),
          py::arg("remote_address") = 0, py::arg("rkey") = 0, py::arg("imm") = 0,
          py::arg("wr_id") = 0, py::arg("signaled") = true)
      .def(
          "post_recv",
          [](VerbsQueuePair& qp, const PyRegion& local, size_t offset, size_t length,
             uint64_t wrId) {
            RecvRequest request;
            request.wrId = wrId;
            request.sge = {local.address(offset, length), static_cast<uint32_t>(length),
                           local.region->lkey()};
            std::string error;
            if (!qp.postRecv(request, &error)) throw Error(error);
          },
          py::arg("local"), py::arg("offset"), py::arg("length"), py::arg("wr_id") = 0);
  py::class_<VerbsDevice, std::shared_ptr<VerbsDevice>>(m, "IbDevice")
      .def_property_readonly("name", &VerbsDevice::name)
      .def("port_active", [](VerbsDevice& d) { return d.queryPort(1).active; })
      .def(
          "gid_table",
          [](VerbsDevice& d) { return gidList(readGidTable(d, 1, d.queryPort(1).gidTableLength)); },
          "the port's GIDs as the transport reads them (gid, type) by index")
      .def(
          "register",
          [](VerbsDevice& d, py::buffer buffer, bool remoteWrite) {
            auto region = std::make_shared<PyRegion>();
            region->owner = buffer;
            py::buffer_info info = buffer.request(true);
            region->base = reinterpret_cast<uint64_t>(info.ptr);
            region->size = static_cast<size_t>(info.size * info.itemsize);
            region->region = d.registerMemory(info.ptr, region->size, remoteWrite, false);
            return region;
          },
          py::arg("buffer"), py::arg("remote_write") = false, py::keep_alive<0, 1>())
      .def(
          "register_dmabuf",
          [](VerbsDevice& d, int fd, uint64_t offset, size_t length, uint64_t iova) {
            auto region = std::make_shared<PyRegion>();
            region->base = iova;
            region->size = length;
            region->region = d.registerDmaBuf(fd, offset, length, iova, false);
            return region;
          },
          py::arg("fd"), py::arg("offset"), py::arg("length"), py::arg("iova"),
          py::keep_alive<0, 1>(),
          "ibv_reg_dmabuf_mr: the NIC reaches [iova, +length) through the fd, never through iova")
      .def(
          "register_gpu_pointer",
          [](VerbsDevice& d, uint64_t address, size_t length) {
            auto region = std::make_shared<PyRegion>();
            region->base = address;
            region->size = length;
            region->region = d.registerPeerMemory(reinterpret_cast<void*>(address), length, false);
            return region;
          },
          py::arg("address"), py::arg("length"), py::keep_alive<0, 1>())
      .def(
          "create_channel",
          [](VerbsDevice& d) {
            return std::shared_ptr<VerbsCompletionChannel>(d.createCompletionChannel());
          },
          py::keep_alive<0, 1>())
      .def(
          "create_cq",
          [](VerbsDevice& d, std::shared_ptr<VerbsCompletionChannel> channel, int depth) {
            return std::shared_ptr<VerbsCompletionQueue>(
                d.createCompletionQueue(depth, channel.get()));
          },
          py::arg("channel") = nullptr, py::arg("depth") = 64, py::keep_alive<0, 1>(),
          py::keep_alive<0, 2>())
      .def(
          "create_qp",
          [](VerbsDevice& d, std::shared_ptr<VerbsCompletionQueue> send,
             std::shared_ptr<VerbsCompletionQueue> recv, int maxSend, int maxRecv) {
            return std::shared_ptr<VerbsQueuePair>(
                d.createQueuePair(send.get(), recv.get(), maxSend, maxRecv));
          },
          py::arg("send_cq"), py::arg("recv_cq"), py::arg("max_send") = 16,
          py::arg("max_recv") = 16, py::keep_alive<0, 2>(), py::keep_alive<0, 3>())
      .def(
          "wait_event",
          [](VerbsDevice& d, double timeout) -> py::object {
            AsyncEvent event;
            bool got;
            {
              py::gil_scoped_release release;
              got = d.waitAsyncEvent(&event, Millis(static_cast<int64_t>(timeout * 1000)));
            }
            return got ? py::object(py::str(asyncEventName(event.type))) : py::none();
          },
          py::arg("timeout") = 1.0);
}

void bindVerbsEmulation(py::module_& m) {
  py::class_<VerbsEmulation, VerbsApi, std::shared_ptr<VerbsEmulation>>(
      m, "IbEmulation", "In-process verbs with RC semantics and fault hooks (docs/ib.md)")
      .def(py::init<std::vector<std::string>>(), py::arg("devices"))
      .def("devices", &VerbsEmulation::deviceNames)
      .def("open", &VerbsEmulation::open, py::arg("device"), py::keep_alive<0, 1>(),
           "Raw verbs on one device, for tests of the emulation itself")
      .def("port_down", [](VerbsEmulation& e, const std::string& d) { e.setPortUp(d, false); })
      .def("port_up", [](VerbsEmulation& e, const std::string& d) { e.setPortUp(d, true); })
      .def("drop", &VerbsEmulation::setDrop, py::arg("device"), py::arg("on") = true,
           "Blackholes the device: packets vanish, no event, retry-exceeded later")
      .def("corrupt_next", &VerbsEmulation::corruptNext, py::arg("device"), py::arg("kind"))
      .def("fail_next", &VerbsEmulation::failNext, py::arg("device"), py::arg("call"),
           py::arg("times") = 1,
           "The next `times` poll_cq (returns < 0) or modify_qp (ETIMEDOUT) calls on the device "
           "fail")
      .def("hold", &VerbsEmulation::setHold, py::arg("device"), py::arg("on") = true,
           py::call_guard<py::gil_scoped_release>(),
           "Parks what the device sends on the wire; hold(dev, False) delivers it where the "
           "responder QP still takes it (docs/ib.md)")
      .def("set_lossless_class", &VerbsEmulation::setLosslessClass, py::arg("device"),
           py::arg("traffic_class"),
           "the device's fabric protects only this traffic class (PFC): other classes are dropped; "
           "-1 = any")
      .def(
          "qp_routes",
          [](VerbsEmulation& e, const std::string& d) {
            std::vector<std::pair<int, int>> out;
            for (const QpRoute& r : e.connectedRoutes(d))
              out.emplace_back(r.trafficClass, r.serviceLevel);
            return out;
          },
          py::arg("device"), "(traffic class, service level) of the device's QPs in RTR/RTS")
      .def("gid_table",
           [](VerbsEmulation& e, const std::string& d) { return gidList(e.gidTable(d)); })
      .def(
          "set_landing_delay",
          [](VerbsEmulation& e, const std::string& d, double seconds) {
            e.setLandingDelay(d, Millis(static_cast<int64_t>(seconds * 1000)));
          },
          py::arg("device"), py::arg("seconds"),
          "Deliveries to the device are acknowledged at once and reach memory this much later, "
          "even past a move of the responder QP to ERR")
      .def("set_relaxed_ordering", &VerbsEmulation::setRelaxedOrdering, py::arg("device"),
           py::arg("supported"),
           "Whether the device's library can ask for IBV_ACCESS_RELAXED_ORDERING (has "
           "ibv_reg_mr_iova2)")
      .def("memory_regions", &VerbsEmulation::memoryRegions, py::arg("device"),
           "(live memory regions, of them with relaxed ordering) on the device")
      .def("set_infiniband", &VerbsEmulation::setInfiniband, py::arg("device"),
           py::arg("subnet_prefix") = 0xfe80000000000000ull,
           "InfiniBand link layer for the device (before a transport opens it): LID routing in a "
           "subnet, GRH across subnets")
      .def("qp_global", &VerbsEmulation::connectedGlobal, py::arg("device"),
           "whether each of the device's QPs in RTR/RTS sends with a GRH")
      .def("device_fatal", &VerbsEmulation::setDeviceFatal, py::arg("device"),
           "A fatal device error: DEVICE_FATAL, its QPs to ERR, its open contexts dead for good, "
           "opening it fails until recover_device")
      .def("recover_device", &VerbsEmulation::recoverDevice, py::arg("device"),
           "The device is back after a fatal error: a fresh open works (old contexts stay dead)")
      .def("refuse_dmabuf", &VerbsEmulation::setRefuseDmaBuf, py::arg("device"),
           py::arg("on") = true,
           "ibv_reg_dmabuf_mr on the device fails (EOPNOTSUPP), as on a NIC without a P2P path")
      .def("set_peer_memory", &VerbsEmulation::setPeerMemoryLoaded, py::arg("loaded"),
           "What the peer-memory probe (nvidia-peermem loaded?) answers; registering GPU memory "
           "by pointer still fails")
      .def("set_pci_path", &VerbsEmulation::setPciPath, py::arg("device"), py::arg("path"),
           "The PCI path the device reports (what /sys/class/infiniband/<dev>/device resolves to)")
      .def("reads_on", &VerbsEmulation::readsOn, py::arg("device"),
           "RDMA READs served to the device's QPs (GPU flushes through that NIC)")
      .def("overrun_cqs", &VerbsEmulation::overrunCompletionQueues, py::arg("device"),
           "Every CQ of the device overruns now: CQ_ERR, their QPs to ERR, polls fail")
      .def(
          "set_gid_sources",
          [](VerbsEmulation& e, const std::string& d, bool table, bool queryEx, bool sysfs) {
            e.setGidSources(d, GidSources{table, queryEx, sysfs});
          },
          py::arg("device"), py::arg("table") = true, py::arg("query_ex") = true,
          py::arg("sysfs") = true,
          "Where the device's GID types can be read: ibv_query_gid_table, ibv_query_gid_ex, sysfs "
          "(all False: every type reads unknown)")
      .def(
          "add_gid",
          [](VerbsEmulation& e, const std::string& d, py::bytes gid, const std::string& type) {
            std::string raw = gid;
            if (raw.size() != 16)
              throw ConfigError("a GID has 16 bytes, not " + std::to_string(raw.size()));
            Gid value{};
            std::memcpy(value.data(), raw.data(), 16);
            e.addGid(d, value, gidTypeNamed(type));
          },
          py::arg("device"), py::arg("gid"), py::arg("type") = "RoCEv2",
          "Adds an address after the link-local pair (below the IPv4 GID), kept over flaps")
      .def("qp_gid_indexes", &VerbsEmulation::connectedGidIndexes, py::arg("device"),
           "the source GID index of each of the device's QPs in RTR/RTS")
      .def("counters", [](VerbsEmulation& e) {
        EmulationCounters c = e.counters();
        py::dict d;
        d["sends"] = c.sends;
        d["writes"] = c.writes;
        d["writes_with_imm"] = c.writesWithImmediate;
        d["reads"] = c.reads;
        d["held"] = c.held;
        d["wire_delivered"] = c.wireDelivered;
        d["wire_dropped"] = c.wireDropped;
        d["bytes"] = c.bytes;
        d["flushed"] = c.flushed;
        d["retry_exceeded"] = c.retryExceeded;
        d["access_errors"] = c.accessErrors;
        d["dropped"] = c.dropped;
        d["corrupted"] = c.corrupted;
        d["qp_errors"] = c.qpErrors;
        d["cq_overruns"] = c.cqOverruns;
        d["landed_late"] = c.landedLate;
        d["rnr_naks"] = c.rnrNaks;
        d["closed_with_regions"] = c.closedWithRegions;
        d["dereg_after_close"] = c.deregAfterClose;
        d["cq_events"] = c.completionEvents;
        d["completions_polled"] = c.completionsPolled;
        d["gid_table_queries"] = c.gidTableQueries;
        d["gid_queries"] = c.gidQueries;
        return d;
      });
}

void bindCudaEmulation(py::module_& m) {
  py::class_<CudaEmulation, std::shared_ptr<CudaEmulation>>(
      m, "CudaEmulation", "Devices whose memory is checked host memory (testing/cuda_emulation.h)")
      .def(py::init<int>(), py::arg("devices"))
      .def(
          "alloc",
          [](CudaEmulation& e, int device, size_t bytes, bool virtualMemory) {
            return reinterpret_cast<uintptr_t>(e.applicationAlloc(device, bytes, virtualMemory));
          },
          py::arg("device"), py::arg("bytes"), py::arg("virtual_memory") = true,
          "device memory as NCCL allocates it (virtual_memory=False: as cudaMalloc); its address "
          "as an int")
      .def(
          "free",
          [](CudaEmulation& e, int device, uintptr_t address) {
            e.deviceFree(device, reinterpret_cast<void*>(address));
          },
          py::arg("device"), py::arg("address"))
      .def("set_dmabuf", &CudaEmulation::setDmaBuf, py::arg("supported"),
           "Whether the emulated GPUs can export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)")
      .def("set_queries_before_done", &CudaEmulation::setQueriesBeforeDone, py::arg("queries"),
           "events report done only at this query after their record (default 1): copies seem in "
           "flight")
      .def("counters", [](const CudaEmulation& e) {
        CudaEmulation::Counters c = e.counters();
        py::dict d;
        d["to_host_bytes"] = c.toHostBytes;
        d["to_device_bytes"] = c.toDeviceBytes;
        d["peer_bytes"] = c.peerBytes;
        d["device_bytes_allocated"] = c.deviceBytesAllocated;
        d["pinned_bytes_allocated"] = c.pinnedBytesAllocated;
        d["streams"] = c.streams;
        d["events"] = c.events;
        d["peer_links"] = c.peerLinks;
        return d;
      });
}

// The NCCL plugin over the emulations.
void bindPluginProviders(py::module_& m) {
  m.def(
      "nccl_plugin_use_verbs",
      [](std::shared_ptr<VerbsEmulation> emulation) {
        NetPlugin::instance().useVerbs(std::move(emulation));
      },
      py::arg("emulation"),
      "The NCCL net plugin's IB transport (RECCL_TRANSPORT=ib or auto) runs over this "
      "emulation instead of libibverbs. Call before the plugin's init(); once per process");
  m.def(
      "nccl_plugin_use_cuda",
      [](std::shared_ptr<CudaEmulation> emulation) {
        NetPlugin::instance().useCuda(std::move(emulation));
      },
      py::arg("emulation"),
      "The NCCL plugin's NVL (RECCL_NVL=on) runs over this CUDA emulation. Call before the "
      "plugin's init(); once per process");
}

// The IB transport's pure rules: fork handling, GID choice, port rates, the QP exchange.
void bindIbRules(py::module_& m) {
  m.def(
      "ib_needs_fork_init",
      [](const std::string& state, std::optional<std::string> rdmavForkSafe,
         std::optional<std::string> ibvForkSafe) {
        static const std::map<std::string, ForkState> kStates = {{"unknown", ForkState::kUnknown},
                                                                 {"disabled", ForkState::kDisabled},
                                                                 {"enabled", ForkState::kEnabled},
                                                                 {"unneeded",
                                                                  ForkState::kUnneeded}};
        auto it = kStates.find(state);
        if (it == kStates.end()) {
          throw ConfigError("fork state '" + state +
                            "' is not valid: expected unknown, disabled, "
                            "enabled or unneeded");
        }
        return needsForkInit(it->second, rdmavForkSafe ? rdmavForkSafe->c_str() : nullptr,
                             ibvForkSafe ? ibvForkSafe->c_str() : nullptr);
      },
      py::arg("state"), py::arg("rdmav_fork_safe") = py::none(),
      py::arg("ibv_fork_safe") = py::none(),
      "Whether the system verbs loader calls ibv_fork_init (verbs_library.h needsForkInit); "
      "the variables' values, None when unset");
  m.def("ib_port_speed_mbps", &portSpeedMbps, py::arg("active_speed"), py::arg("active_width"),
        "The rate a port reports from ibv_port_attr active_speed / active_width");
  m.def(
      "ib_select_gid",
      [](const std::vector<std::pair<py::bytes, std::string>>& table, bool ethernet,
         const std::string& addrRange) {
        std::vector<GidEntry> entries;
        for (const auto& [gid, type] : table) {
          std::string raw = gid;
          if (raw.size() != 16)
            throw ConfigError("a GID has 16 bytes, not " + std::to_string(raw.size()));
          GidEntry entry;
          std::memcpy(entry.gid.data(), raw.data(), 16);
          entry.type = gidTypeNamed(type);
          entry.index = static_cast<int>(entries.size());
          entries.push_back(entry);
        }
        if (addrRange.empty()) return selectGidIndex(entries, ethernet);
        const AddressRange range = AddressRange::parse(addrRange);
        return selectGidIndex(entries, ethernet, &range);
      },
      py::arg("table"), py::arg("ethernet") = true, py::arg("addr_range") = "",
      "The GID index the IB transport chooses from (gid, type) entries at their list positions "
      "(addr_range: RECCL_IB_ADDR_RANGE); -1 when none is usable");
  m.def(
      "ib_decode_qp_exchange",
      [](py::bytes data, const std::string& role) {
        std::string raw = data;
        if (role != "sender" && role != "receiver") {
          throw ConfigError("role '" + role + "' is not valid: expected sender or receiver");
        }
        QpExchange e = decodeQpExchange(reinterpret_cast<const uint8_t*>(raw.data()), raw.size(),
                                        role == "sender" ? QpExchange::Role::kSender
                                                         : QpExchange::Role::kReceiver);
        py::dict d;
        d["qp_number"] = e.qp.qpNumber;
        d["slot_count"] = e.slotCount;
        d["slot_bytes"] = e.slotBytes;
        d["mtu"] = e.mtu;
        return d;
      },
      "Validates a bootstrap QP description");
}

void bindSameHost(py::module_& m) {
  // Same-host reads (transport/same_host.h), each half on its own.
  m.def("same_host_key", &sameHostKey,
        "This process's host key (kernel, network and pid namespace)");
  py::class_<SameHostWindow, std::shared_ptr<SameHostWindow>>(
      m, "SameHostWindow", "A sender's token word, as a TCP path holds one")
      .def(py::init<>())
      .def_property_readonly("token_address", &SameHostWindow::tokenAddress)
      .def_property_readonly("token", &SameHostWindow::token)
      .def("revoke", &SameHostWindow::revoke);
  m.def(
      "same_host_read",
      [](int pid, uint64_t tokenAddress, uint64_t token, uint64_t address, size_t bytes) {
        std::string out(bytes, '\0');
        std::string why;
        bool ok;
        {
          py::gil_scoped_release release;
          ok = PeerMemory(pid, tokenAddress, token, nullptr).read(out.data(), address, bytes, &why);
        }
        return py::make_tuple(ok, py::bytes(ok ? out : why));
      },
      py::arg("pid"), py::arg("token_address"), py::arg("token"), py::arg("address"),
      py::arg("bytes"), "A receiver's read: (True, the bytes) or (False, why)");
}

void bindHandshake(py::module_& m) {
  // One handshake as a transport dials it (transport/hello_dial.h), against
  // whatever listens at address:port, and how its failure is classified.
  m.def(
      "dial_with_hello",
      [](const std::string& localAddress, const std::string& address, uint16_t port,
         int timeoutMs) {
        PathFailure failure;
        Fd socket;
        {
          py::gil_scoped_release release;
          socket = dialWithHello(localAddress, HandleEndpoint{address, port}, HelloBody{},
                                 Millis(timeoutMs), &failure);
        }
        py::dict d;
        d["connected"] = socket.valid();
        d["what"] = failure.what;
        d["peer_host_answered"] = failure.peerHostAnswered;
        return d;
      },
      py::arg("local_address"), py::arg("address"), py::arg("port"), py::arg("timeout_ms"),
      "Dials address:port with a HELLO; {connected, what, peer_host_answered}");
}

}  // namespace

// csrc/testing/core_bindings.cc: frames, handles, log limiter, grey detector, lanes, backups.
void bindCoreRules(py::module_& m);
// csrc/testing/timing_bindings.cc: the timer wheel, the supervisor, an event loop.
void bindTiming(py::module_& m);

PYBIND11_MODULE(_testing, m) {
  m.doc() = "torch_reccl test module: emulations and test hooks (never loaded by NCCL)";
  // _C registers VerbsProvider (the emulation's base, so IbTransport takes an
  // IbEmulation) and the translators of reccl's exceptions.
  py::module_::import("torch_reccl._C");
  bindRawVerbs(m);
  bindVerbsEmulation(m);
  bindCudaEmulation(m);
  bindPluginProviders(m);
  bindIbRules(m);
  bindSameHost(m);
  bindHandshake(m);
  bindCoreRules(m);
  bindTiming(m);
}
