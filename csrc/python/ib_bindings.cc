// Python bindings of the IB verbs transport (torch_reccl._C): the transport
// over the system libibverbs or over another verbs provider (the emulation of
// the test module torch_reccl._testing), the transport choice
// (RECCL_TRANSPORT).
// Called from the module definition in bindings.cc; connections, listeners
// and requests are the classes bound there.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "core/error.h"
#include "core/health.h"
#include "nccl/net_plugin.h"
#include "python/config_env.h"
#include "python/registered_buffer.h"
#include "transport/ib/ib_transport.h"
#include "transport/ib/qp_exchange.h"
#include "transport/ib/verbs_library.h"
#include "transport/make_transport.h"

namespace py = pybind11;
using namespace reccl;

void bindIbTransport(py::module_& m) {
  py::class_<VerbsApi, std::shared_ptr<VerbsApi>>(
      m, "VerbsProvider",
      "A verbs implementation the IB transport can run over instead of the system "
      "libibverbs (torch_reccl._testing.IbEmulation is one)");

  py::class_<IbTransport, std::shared_ptr<IbTransport>>(m, "IbTransport")
      .def(py::init([](py::object verbs, py::object env, const std::string& bootstrap) {
             Config config = configFromEnv(env);
             config.applyLogLevel();
             std::shared_ptr<VerbsApi> api;
             if (verbs.is_none()) {
               std::string error;
               api = loadSystemVerbs(&error);
               if (!api) throw ConfigError(error);
             } else {
               api = verbs.cast<std::shared_ptr<VerbsApi>>();
             }
             py::gil_scoped_release release;
             return std::make_shared<IbTransport>(config, api, bootstrap);
           }),
           py::arg("verbs") = py::none(), py::arg("env") = py::none(),
           py::arg("bootstrap_address") = "127.0.0.1",
           "An IB transport. `verbs`: a VerbsProvider (e.g. _testing.IbEmulation), or None for "
           "the system libibverbs. "
           "`env`: RECCL_* settings (default os.environ)")
      .def("nics",
           [](const IbTransport& t) {
             py::list out;
             const auto& nics = t.nics();
             for (size_t i = 0; i < nics.size(); ++i) {
               py::dict d;
               d["index"] = i;
               d["name"] = nics[i].name;
               d["backup"] = nics[i].backup >= 0 ? py::object(py::str(nics[nics[i].backup].name))
                                                 : py::none();
               d["backup_index"] = nics[i].backup;
               d["up"] = NicHealth::instance().usable(t.healthId(static_cast<int>(i)));
               d["speed_mbps"] = nics[i].speedMbps;
               d["pci_path"] = nics[i].pciPath;
               out.append(d);
             }
             return out;
           })
      .def("listen", &IbTransport::listen, py::arg("nic") = 0, py::keep_alive<0, 1>())
      // keep_alive: a registration keeps its transport (and so its devices'
      // contexts) alive: deregistering after the transport closed them would
      // touch freed verbs objects.
      .def(
          "register", [](IbTransport& t, py::buffer buffer) { return registerBuffer(t, buffer); },
          py::arg("buffer"), py::keep_alive<0, 1>(),
          "Registers `buffer` on every RDMA device for direct placement; None with "
          "RECCL_IB_ZERO_COPY=off")
      .def(
          "register_dmabuf",
          [](IbTransport& t, int fd, uint64_t offset, uint64_t bytes, uint64_t address) {
            auto held = std::make_shared<RegisteredBuffer>();
            py::gil_scoped_release release;
            held->registration = t.registerDmaBuf(fd, offset, bytes, address);
            return held;
          },
          py::arg("fd"), py::arg("offset"), py::arg("nbytes"), py::arg("address"),
          py::keep_alive<0, 1>(),
          "Registers a dma-buf range on every RDMA device, addressed as `address` (a device "
          "pointer the CPU never dereferences)")
      .def(
          "flush_device_writes",
          [](IbTransport& t, const RegisteredBuffer& registration, uint64_t address,
             RecvConnection& connection) {
            py::gil_scoped_release release;
            t.flushDeviceWrites(*registration.registration, address, connection.takePlacedNics());
          },
          py::arg("registration"), py::arg("address"), py::arg("connection"),
          "What the NCCL plugin's iflush does after a receive into device memory: a 1-byte RDMA "
          "READ of `address` through each NIC that placed data on `connection` since the last "
          "flush")
      .def("supports_dmabuf",
           [](const IbTransport& t) {
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

  m.def(
      "choose_transport",
      [](py::object env, py::object verbs) {
        Config config = configFromEnv(env);
        std::shared_ptr<VerbsApi> api;
        if (!verbs.is_none()) api = verbs.cast<std::shared_ptr<VerbsApi>>();
        TransportChoice choice = chooseTransport(config, api);
        py::dict d;
        d["kind"] = choice.kind;
        d["reason"] = choice.reason;
        return d;
      },
      py::arg("env") = py::none(), py::arg("verbs") = py::none(),
      "Which transport RECCL_TRANSPORT picks: {'kind': 'tcp'|'ib', 'reason'}. `verbs`: a "
      "VerbsProvider standing for the system libibverbs; raises ConfigError for ib without "
      "devices");
  m.def(
      "ib_bootstrap_address", [](py::object env) { return ibBootstrapAddress(configFromEnv(env)); },
      py::arg("env") = py::none());
  m.def(
      "nccl_plugin_transport", [] { return NetPlugin::instance().transportKind(); },
      "'tcp' or 'ib' once the NCCL plugin's init() succeeded, else ''");
  m.def("ib_verbs_headers_compiled", &verbsHeadersCompiledIn,
        "True when this build compiled the real verbs backend against <infiniband/verbs.h>");
  m.def(
      "ib_load_system_verbs",
      [] {
        std::string error;
        std::shared_ptr<VerbsApi> api = loadSystemVerbs(&error);
        py::dict d;
        d["loaded"] = static_cast<bool>(api);
        d["error"] = error;
        d["devices"] = api ? api->deviceNames() : std::vector<std::string>{};
        return d;
      },
      "dlopen()s libibverbs.so.1: {'loaded', 'error', 'devices'}");
  m.attr("IB_QP_EXCHANGE_BYTES") = kQpExchangeBytes;
}
