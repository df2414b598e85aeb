// Python bindings of the IB verbs transport (torch_reccl._C): the transport
// over the system libibverbs or over the in-process verbs emulation, the
// emulation's fault hooks and counters, the transport choice (RECCL_TRANSPORT)
// and the hook that runs the NCCL plugin over the emulation, and a few pure
// functions for tests.
// Called from the module definition in bindings.cc; connections, listeners
// and requests are the classes bound there.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/health.h"
#include "nccl/net_plugin.h"
#include "python/registered_buffer.h"
#include "transport/ib/gid_select.h"
#include "transport/ib/ib_transport.h"
#include "transport/ib/qp_exchange.h"
#include "transport/ib/verbs_emulation.h"
#include "transport/ib/verbs_library.h"
#include "transport/make_transport.h"

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

GidType gidTypeFromName(const std::string& name) {
  if (name == "IB") return GidType::kIb;
  if (name == "RoCEv1") return GidType::kRoceV1;
  if (name == "RoCEv2") return GidType::kRoceV2;
  if (name == "unknown") return GidType::kUnknown;
  throw ConfigError("GID type '" + name + "' is not valid: expected IB, RoCEv1, RoCEv2 or unknown");
}

std::map<std::string, std::string> envOf(const py::object& env) {
  std::map<std::string, std::string> out;
  py::dict source = env.is_none() ? py::dict(py::module_::import("os").attr("environ").attr("copy")())
                                  : env.cast<py::dict>();
  for (auto item : source) out[py::str(item.first)] = py::str(item.second);
  return out;
}

py::list gidList(const std::vector<GidEntry>& table) {
  py::list out;
  for (const auto& entry : table) {
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
  static const char* const kOpcodes[] = {"send", "rdma_write", "recv", "recv_rdma_with_imm", "rdma_read",
                                         "other"};
  py::dict d;
  d["wr_id"] = wc.wrId;
  d["status"] = wcStatusName(wc.status);
  d["opcode"] = kOpcodes[static_cast<int>(wc.opcode)];
  d["byte_len"] = wc.byteLength;
  d["imm"] = wc.hasImmediate ? py::object(py::int_(wc.immediate)) : py::none();
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
// directly (tests/test_ib_emulation.py).
void bindRawVerbs(py::module_& m) {
  py::class_<PyRegion, std::shared_ptr<PyRegion>>(m, "IbMemoryRegion")
      .def_property_readonly("lkey", [](const PyRegion& r) { return r.region->lkey(); })
      .def_property_readonly("rkey", [](const PyRegion& r) { return r.region->rkey(); })
      .def("address", &PyRegion::address, py::arg("offset") = 0, py::arg("length") = 0);
  py::class_<VerbsCompletionQueue, std::shared_ptr<VerbsCompletionQueue>>(m, "IbCompletionQueue")
      .def("poll", [](VerbsCompletionQueue& cq, int max) {
        std::vector<WorkCompletion> wcs(static_cast<size_t>(std::max(max, 1)));
        int got = cq.poll(wcs.data(), static_cast<int>(wcs.size()));
        py::list out;
        for (int i = 0; i < got; ++i) out.append(completionDict(wcs[i]));
        return out;
      }, py::arg("max") = 64)
      .def("arm", &VerbsCompletionQueue::requestNotify, "ibv_req_notify_cq: one event for the next completion");
  py::class_<VerbsCompletionChannel, std::shared_ptr<VerbsCompletionChannel>>(m, "IbCompletionChannel")
      .def_property_readonly("fd", &VerbsCompletionChannel::fd)
      // The CQ object the event announces (the one create_cq returned), or None.
      .def("take_event", &VerbsCompletionChannel::takeEvent, py::return_value_policy::reference);
  py::class_<VerbsQueuePair, std::shared_ptr<VerbsQueuePair>>(m, "IbQueuePair")
      .def_property_readonly("qp_number", &VerbsQueuePair::qpNumber)
      .def("to_init", [](VerbsQueuePair& qp) { qp.toInit(1); })
      .def("to_rtr", [](VerbsQueuePair& qp, uint32_t peerQp, py::bytes peerGid, int gidIndex) {
        std::string raw = peerGid;
        if (raw.size() != 16) throw ConfigError("a GID has 16 bytes");
        QpPeer peer;
        peer.qpNumber = peerQp;
        std::memcpy(peer.gid.data(), raw.data(), 16);
        qp.toReadyToReceive(peer, 1, gidIndex, 3);
      }, py::arg("peer_qp"), py::arg("peer_gid"), py::arg("gid_index"))
      .def("to_rts", [](VerbsQueuePair& qp, int timeout, int retry) { qp.toReadyToSend(0, timeout, retry); },
           py::arg("timeout"), py::arg("retry_count"))
      .def("to_error", &VerbsQueuePair::toError)
      .def("post_send", [](VerbsQueuePair& qp, const std::string& op, const PyRegion& local, size_t offset,
                           size_t length, uint64_t remoteAddress, uint32_t rkey, uint32_t imm, uint64_t wrId) {
        SendRequest request;
        request.wrId = wrId;
        request.op = opFromName(op);
        request.sge = {local.address(offset, length), static_cast<uint32_t>(length), local.region->lkey()};
        request.remoteAddress = remoteAddress;
        request.rkey = rkey;
        request.immediate = imm;
        std::string error;
        if (!qp.postSend(request, &error)) throw Error(error);
      }, py::arg("op"), py::arg("local"), py::arg("offset"), py::arg("length"),
         py::arg("remote_address") = 0, py::arg("rkey") = 0, py::arg("imm") = 0, py::arg("wr_id") = 0)
      .def("post_recv", [](VerbsQueuePair& qp, const PyRegion& local, size_t offset, size_t length, uint64_t wrId) {
        RecvRequest request;
        request.wrId = wrId;
        request.sge = {local.address(offset, length), static_cast<uint32_t>(length), local.region->lkey()};
        std::string error;
        if (!qp.postRecv(request, &error)) throw Error(error);
      }, py::arg("local"), py::arg("offset"), py::arg("length"), py::arg("wr_id") = 0);
  py::class_<VerbsDevice, std::shared_ptr<VerbsDevice>>(m, "IbDevice")
      .def_property_readonly("name", &VerbsDevice::name)
      .def("port_active", [](VerbsDevice& d) { return d.queryPort(1).active; })
      .def("gid_table", [](VerbsDevice& d) { return gidList(readGidTable(d, 1)); })
      .def("register", [](VerbsDevice& d, py::buffer buffer, bool remoteWrite) {
        auto region = std::make_shared<PyRegion>();
        region->owner = buffer;
        py::buffer_info info = buffer.request(true);
        region->base = reinterpret_cast<uint64_t>(info.ptr);
        region->size = static_cast<size_t>(info.size * info.itemsize);
        region->region = d.registerMemory(info.ptr, region->size, remoteWrite);
        return region;
      }, py::arg("buffer"), py::arg("remote_write") = false, py::keep_alive<0, 1>())
      .def("register_dmabuf", [](VerbsDevice& d, int fd, uint64_t offset, size_t length, uint64_t iova) {
        auto region = std::make_shared<PyRegion>();
        region->base = iova;
        region->size = length;
        region->region = d.registerDmaBuf(fd, offset, length, iova);
        return region;
      }, py::arg("fd"), py::arg("offset"), py::arg("length"), py::arg("iova"), py::keep_alive<0, 1>(),
         "ibv_reg_dmabuf_mr: the NIC reaches [iova, +length) through the fd, never through iova")
      .def("register_gpu_pointer", [](VerbsDevice& d, uint64_t address, size_t length) {
        auto region = std::make_shared<PyRegion>();
        region->base = address;
        region->size = length;
        region->region = d.registerPeerMemory(reinterpret_cast<void*>(address), length);
        return region;
      }, py::arg("address"), py::arg("length"), py::keep_alive<0, 1>())
      .def("create_channel", [](VerbsDevice& d) {
        return std::shared_ptr<VerbsCompletionChannel>(d.createCompletionChannel());
      }, py::keep_alive<0, 1>())
      .def("create_cq", [](VerbsDevice& d, std::shared_ptr<VerbsCompletionChannel> channel) {
        return std::shared_ptr<VerbsCompletionQueue>(d.createCompletionQueue(64, channel.get()));
      }, py::arg("channel") = nullptr, py::keep_alive<0, 1>(), py::keep_alive<0, 2>())
      .def("create_qp", [](VerbsDevice& d, std::shared_ptr<VerbsCompletionQueue> send,
                           std::shared_ptr<VerbsCompletionQueue> recv, int maxSend, int maxRecv) {
        return std::shared_ptr<VerbsQueuePair>(d.createQueuePair(send.get(), recv.get(), maxSend, maxRecv));
      }, py::arg("send_cq"), py::arg("recv_cq"), py::arg("max_send") = 16, py::arg("max_recv") = 16,
         py::keep_alive<0, 2>(), py::keep_alive<0, 3>())
      .def("wait_event", [](VerbsDevice& d, double timeout) -> py::object {
        AsyncEvent event;
        bool got;
        {
          py::gil_scoped_release release;
          got = d.waitAsyncEvent(&event, Millis(static_cast<int64_t>(timeout * 1000)));
        }
        return got ? py::object(py::str(asyncEventName(event.type))) : py::none();
      }, py::arg("timeout") = 1.0);
}

}  // namespace

void bindIbTransport(py::module_& m) {
  bindRawVerbs(m);
  py::class_<VerbsEmulation, std::shared_ptr<VerbsEmulation>>(
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
      .def("hold", &VerbsEmulation::setHold, py::arg("device"), py::arg("on") = true,
           py::call_guard<py::gil_scoped_release>(),
           "Parks what the device sends on the wire; hold(dev, False) delivers it where the "
           "responder QP still takes it (docs/ib.md)")
      .def("gid_table", [](VerbsEmulation& e, const std::string& d) { return gidList(e.gidTable(d)); })
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
        return d;
      });

  py::class_<IbTransport, std::shared_ptr<IbTransport>>(m, "IbTransport")
      .def(py::init([](py::object verbs, py::object env, const std::string& bootstrap) {
             Config config = Config::fromEnv(envOf(env));
             config.applyLogLevel();
             std::shared_ptr<VerbsApi> api;
             if (verbs.is_none()) {
               std::string error;
               api = loadSystemVerbs(&error);
               if (!api) throw ConfigError(error);
             } else {
               api = verbs.cast<std::shared_ptr<VerbsEmulation>>();
             }
             py::gil_scoped_release release;
             return std::make_shared<IbTransport>(config, api, bootstrap);
           }),
           py::arg("verbs") = py::none(), py::arg("env") = py::none(),
           py::arg("bootstrap_address") = "127.0.0.1",
           "An IB transport. `verbs`: an IbEmulation, or None for the system libibverbs. "
           "`env`: RECCL_* settings (default os.environ)")
      .def("nics",
           [](const IbTransport& t) {
             py::list out;
             const auto& nics = t.nics();
             for (size_t i = 0; i < nics.size(); ++i) {
               py::dict d;
               d["index"] = i;
               d["name"] = nics[i].name;
               d["backup"] = nics[i].backup >= 0 ? py::object(py::str(nics[nics[i].backup].name)) : py::none();
               d["backup_index"] = nics[i].backup;
               d["up"] = NicHealth::instance().usable(t.healthId(static_cast<int>(i)));
               d["speed_mbps"] = nics[i].speedMbps;
               d["pci_path"] = nics[i].pciPath;
               out.append(d);
             }
             return out;
           })
      .def("listen", &IbTransport::listen, py::arg("nic") = 0, py::keep_alive<0, 1>())
      .def("register", [](IbTransport& t, py::buffer buffer) { return registerBuffer(t, buffer); },
           py::arg("buffer"),
           "Registers `buffer` on every RDMA device for direct placement; None with "
           "RECCL_IB_ZERO_COPY=off")
      .def("register_dmabuf", [](IbTransport& t, int fd, uint64_t offset, uint64_t bytes, uint64_t address) {
             auto held = std::make_shared<RegisteredBuffer>();
             py::gil_scoped_release release;
             held->registration = t.registerDmaBuf(fd, offset, bytes, address);
             return held;
           }, py::arg("fd"), py::arg("offset"), py::arg("nbytes"), py::arg("address"),
           "Registers a dma-buf range on every RDMA device, addressed as `address` (a device "
           "pointer the CPU never dereferences)")
      .def("supports_dmabuf", [](const IbTransport& t) {
             std::string why;
             bool ok = t.supportsDmaBuf(&why);
             return py::make_tuple(ok, why);
           })
      .def(
          "connect",
          [](IbTransport& t, int nic, py::bytes handle) {
            std::string bytes = handle;
            return t.connect(nic, std::vector<uint8_t>(bytes.begin(), bytes.end()));
          },
          py::arg("nic"), py::arg("handle"), py::keep_alive<0, 1>());

  m.def("choose_transport", [](py::object env, py::object verbs) {
    Config config = Config::fromEnv(envOf(env));
    std::shared_ptr<VerbsApi> api;
    if (!verbs.is_none()) api = verbs.cast<std::shared_ptr<VerbsEmulation>>();
    TransportChoice choice = chooseTransport(config, api);
    py::dict d;
    d["kind"] = choice.kind;
    d["reason"] = choice.reason;
    return d;
  }, py::arg("env") = py::none(), py::arg("verbs") = py::none(),
     "Which transport RECCL_TRANSPORT picks: {'kind': 'tcp'|'ib', 'reason'}. `verbs`: an "
     "IbEmulation standing for the system libibverbs; raises ConfigError for ib without devices");
  m.def("ib_bootstrap_address", [](py::object env) { return ibBootstrapAddress(Config::fromEnv(envOf(env))); },
        py::arg("env") = py::none());
  m.def("nccl_plugin_use_verbs", [](std::shared_ptr<VerbsEmulation> emulation) {
    NetPlugin::instance().useVerbs(std::move(emulation));
  }, py::arg("emulation"),
     "Test-only: the NCCL net plugin's IB transport (RECCL_TRANSPORT=ib or auto) runs over "
     "this emulation instead of libibverbs. Call before the plugin's init(); once per process");
  m.def("nccl_plugin_transport", [] { return NetPlugin::instance().transportKind(); },
        "'tcp' or 'ib' once the NCCL plugin's init() succeeded, else ''");
  m.def("ib_port_speed_mbps", &portSpeedMbps, py::arg("active_speed"), py::arg("active_width"),
        "For tests: the rate a port reports from ibv_port_attr active_speed / active_width");
  m.def("ib_verbs_headers_compiled", &verbsHeadersCompiledIn,
        "True when this build compiled the real verbs backend against <infiniband/verbs.h>");
  m.def("ib_load_system_verbs", [] {
    std::string error;
    std::shared_ptr<VerbsApi> api = loadSystemVerbs(&error);
    py::dict d;
    d["loaded"] = static_cast<bool>(api);
    d["error"] = error;
    d["devices"] = api ? api->deviceNames() : std::vector<std::string>{};
    return d;
  }, "dlopen()s libibverbs.so.1: {'loaded', 'error', 'devices'}");
  m.def("ib_select_gid", [](const std::vector<std::pair<py::bytes, std::string>>& table, bool ethernet) {
    std::vector<GidEntry> entries;
    for (const auto& [gid, type] : table) {
      std::string raw = gid;
      if (raw.size() != 16) throw ConfigError("a GID has 16 bytes, not " + std::to_string(raw.size()));
      GidEntry entry;
      std::memcpy(entry.gid.data(), raw.data(), 16);
      entry.type = gidTypeFromName(type);
      entries.push_back(entry);
    }
    return selectGidIndex(entries, ethernet);
  }, py::arg("table"), py::arg("ethernet") = true);
  m.def("ib_decode_qp_exchange", [](py::bytes data, const std::string& role) {
    std::string raw = data;
    if (role != "sender" && role != "receiver") {
      throw ConfigError("role '" + role + "' is not valid: expected sender or receiver");
    }
    QpExchange e = decodeQpExchange(reinterpret_cast<const uint8_t*>(raw.data()), raw.size(),
                                    role == "sender" ? QpExchange::Role::kSender : QpExchange::Role::kReceiver);
    py::dict d;
    d["qp_number"] = e.qp.qpNumber;
    d["slot_count"] = e.slotCount;
    d["slot_bytes"] = e.slotBytes;
    d["mtu"] = e.mtu;
    return d;
  }, "For tests: validates a bootstrap QP description");
  m.attr("IB_QP_EXCHANGE_BYTES") = kQpExchangeBytes;
}
