// The Python module torch_reccl._C: the low-level connection API, NIC table,
// health drills, events and stats. Blocking calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/config.h"
#include "core/connection.h"
#include "core/error.h"
#include "core/health.h"
#include "core/spread.h"
#include "core/topology.h"
#include "python/config_env.h"
#include "python/registered_buffer.h"
#include "transport/descriptor_table.h"
#include "transport/event_loop.h"
#include "transport/handle.h"
#include "transport/make_transport.h"

namespace py = pybind11;
using namespace reccl;

namespace {

Millis toMillis(double seconds) {
  if (!(seconds >= 0)) throw ConfigError("timeout must be a non-negative number of seconds");
  return Millis(static_cast<int64_t>(seconds * 1000.0));
}

py::dict nicDict(const NicInfo& nic, int index, const std::vector<NicInfo>& all) {
  py::dict d;
  d["index"] = index;
  d["name"] = nic.name;
  d["interface"] = nic.interface;
  d["address"] = nic.address;
  d["pci_path"] = nic.pciPath;
  d["numa_node"] = nic.numaNode;
  d["backup"] = nic.backup >= 0 ? py::object(py::str(all[nic.backup].name)) : py::none();
  d["backup_index"] = nic.backup;
  d["backup_cost"] = nic.backupCost;
  int id = NicHealth::instance().idOf(nic.name);
  d["up"] = id >= 0 ? NicHealth::instance().linkUsable(id) : nic.linkUp;
  d["grey"] = id >= 0 ? greyStateName(NicHealth::instance().grey(id)) : "healthy";
  return d;
}

// A writable or readable buffer held for the life of a request.
struct HeldBuffer {
  py::buffer owner;
  py::buffer_info info;
  HeldBuffer(py::buffer buffer, bool writable) : owner(buffer), info(buffer.request(writable)) {
    bool contiguous = info.ndim <= 1 || [&] {
      py::ssize_t expected = info.itemsize;
      for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
        if (info.strides[d] != expected) return false;
        expected *= info.shape[d];
      }
      return true;
    }();
    if (!contiguous || (info.ndim == 1 && info.strides[0] != info.itemsize)) {
      throw ConfigError("buffer must be C-contiguous");
    }
  }
  uint8_t* data() const { return static_cast<uint8_t*>(info.ptr); }
  uint64_t bytes() const { return static_cast<uint64_t>(info.size * info.itemsize); }
};

class PyRequest {
 public:
  PyRequest(std::shared_ptr<Request> request, std::shared_ptr<HeldBuffer> buffer,
            std::shared_ptr<RegisteredBuffer> registration = nullptr)
      : request_(std::move(request)),
        buffer_(std::move(buffer)),
        registration_(std::move(registration)) {}
  // (done, nbytes); raises on failure.
  py::tuple test() {
    uint64_t bytes = 0;
    std::string error;
    if (!request_->test(&bytes, &error)) return py::make_tuple(false, 0);
    if (!error.empty()) throw Error(error);
    return py::make_tuple(true, bytes);
  }
  uint64_t wait(double timeoutSeconds) {
    Millis timeout = toMillis(timeoutSeconds);
    bool done;
    {
      py::gil_scoped_release release;
      done = request_->wait(timeout);
    }
    if (!done) {
      throw TimeoutError("request not complete after " + std::to_string(timeoutSeconds) + " s");
    }
    py::tuple result = test();
    return result[1].cast<uint64_t>();
  }

 private:
  std::shared_ptr<Request> request_;
  std::shared_ptr<HeldBuffer> buffer_;
  std::shared_ptr<RegisteredBuffer> registration_;  // kept until the request goes
};

const MemoryRegistration* registrationOf(const std::shared_ptr<RegisteredBuffer>& held) {
  return held ? held->registration.get() : nullptr;
}

void waitReady(SendConnection& connection, double timeoutSeconds) {
  Clock::time_point deadline = Clock::now() + toMillis(timeoutSeconds);
  {
    py::gil_scoped_release release;
    while (!connection.ready() && connection.error().empty() && Clock::now() < deadline) {
      std::this_thread::sleep_for(Millis(1));
    }
  }
  std::string error = connection.error();
  if (!error.empty()) throw Error("connect failed: " + error);
  if (!connection.ready()) {
    throw TimeoutError("connect not complete after " + std::to_string(timeoutSeconds) +
                       " s; paths: " + [&] {
                         std::string out;
                         for (const auto& p : connection.describePaths()) out += p + "; ";
                         return out;
                       }());
  }
}

py::dict eventDict(const Event& event) {
  py::dict d;
  d["kind"] = eventKindName(event.kind);
  d["reason"] = reasonName(event.reason);
  d["time"] = static_cast<double>(event.wallNs) / 1e9;
  d["nic"] = event.nic;
  d["peer"] = event.peer;
  d["connection"] = event.connectionId;
  d["from_path"] = event.fromPath;
  d["to_path"] = event.toPath;
  d["duration_s"] =
      event.durationNs >= 0 ? py::object(py::float_(event.durationNs / 1e9)) : py::none();
  d["bytes_replayed"] =
      event.bytesReplayed >= 0 ? py::object(py::int_(event.bytesReplayed)) : py::none();
  d["detail"] = event.detail;
  d["group"] = event.group;
  d["op"] = event.op >= 0 ? py::object(py::int_(event.op)) : py::none();
  d["plan"] = event.plan >= 0 ? py::object(py::int_(event.plan)) : py::none();
  return d;
}

int healthIdOrThrow(const std::string& nic) {
  int id = NicHealth::instance().idOf(nic);
  if (id < 0) {
    std::string known;
    for (const auto& name : NicHealth::instance().names()) known += " " + name;
    throw ConfigError("unknown NIC '" + nic +
                      "'; known NICs:" + (known.empty() ? " (none yet)" : known));
  }
  return id;
}

}  // namespace

py::object reccl::registerBuffer(Transport& transport, py::buffer buffer) {
  auto held = std::make_shared<RegisteredBuffer>();
  held->owner = buffer;
  held->info = buffer.request(true);
  {
    py::gil_scoped_release release;
    held->registration =
        transport.registerMemory(held->info.ptr,
                                 static_cast<uint64_t>(held->info.size * held->info.itemsize));
  }
  if (!held->registration) return py::none();
  return py::cast(held);
}

// The reccl process group (csrc/python/pg_bindings.cc).
void bindProcessGroup(py::module_& m);
// The IB verbs transport and its emulation (csrc/python/ib_bindings.cc).
void bindIbTransport(py::module_& m);
void bindGpu(py::module_& m);
// Test hooks of the shared executor (csrc/python/executor_bindings.cc).
void bindExecutor(py::module_& m);

namespace {

// reccl's exceptions as Python classes (every reccl module raises these).
void bindErrors(py::module_& m) {
  static py::exception<Error> recclError(m, "RecclError", PyExc_RuntimeError);
  static py::exception<ConfigError> configError(m, "ConfigError", PyExc_ValueError);
  static py::exception<ProtocolError> protocolError(m, "ProtocolError", recclError.ptr());
  static py::exception<TimeoutError> timeoutError(m, "TimeoutError", PyExc_TimeoutError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ConfigError& e) {
      PyErr_SetString(configError.ptr(), e.what());
    } catch (const ProtocolError& e) {
      PyErr_SetString(protocolError.ptr(), e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(timeoutError.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(recclError.ptr(), e.what());
    }
  });
}

// Bonded connections, their requests and registrations, and listeners.
void bindConnections(py::module_& m) {
  py::class_<PyRequest>(m, "Request")
      .def("test", &PyRequest::test, "(done, nbytes); raises RecclError if the request failed")
      .def("wait", &PyRequest::wait, py::arg("timeout") = 60.0,
           "Waits up to `timeout` seconds; returns the bytes moved");

  py::class_<RegisteredBuffer, std::shared_ptr<RegisteredBuffer>>(
      m, "Registration", "A buffer registered with a transport on every NIC (transport.register)")
      .def_property_readonly("address",
                             [](const RegisteredBuffer& r) { return r.registration->address(); })
      .def_property_readonly("nbytes",
                             [](const RegisteredBuffer& r) { return r.registration->bytes(); });

  py::class_<SendConnection, std::shared_ptr<SendConnection>>(m, "SendConnection")
      .def(
          "isend",
          [](SendConnection& c, py::buffer buffer, std::shared_ptr<RegisteredBuffer> registration) {
            auto held = std::make_shared<HeldBuffer>(buffer, false);
            return PyRequest(c.isend(held->data(), held->bytes(), registrationOf(registration)),
                             held, registration);
          },
          py::arg("buffer"), py::arg("registration") = nullptr,
          "Sends `buffer`; `registration` (from transport.register, covering it) lets a "
          "transport that can place it directly (IB)")
      .def("wait_ready", &waitReady, py::arg("timeout") = 30.0)
      .def_property_readonly("ready", &SendConnection::ready)
      .def_property_readonly("id", &SendConnection::id)
      .def_property_readonly("error", &SendConnection::error)
      .def_property_readonly("active_path", &SendConnection::activePath)
      .def_property_readonly("active_nic", &SendConnection::activeLocalNic,
                             "local NIC index of the active path; -1 when none is active")
      .def("paths", &SendConnection::describePaths)
      .def("close", &SendConnection::close, py::call_guard<py::gil_scoped_release>());

  py::class_<RecvConnection, std::shared_ptr<RecvConnection>>(m, "RecvConnection")
      .def(
          "irecv",
          [](RecvConnection& c, py::buffer buffer, std::shared_ptr<RegisteredBuffer> registration) {
            auto held = std::make_shared<HeldBuffer>(buffer, true);
            return PyRequest(c.irecv(held->data(), held->bytes(), registrationOf(registration)),
                             held, registration);
          },
          py::arg("buffer"), py::arg("registration") = nullptr,
          "Receives into `buffer`; with `registration` the sender may write it directly")
      .def_property_readonly("id", &RecvConnection::id)
      .def_property_readonly("error", &RecvConnection::error)
      .def_property_readonly("active_path", &RecvConnection::activePath)
      .def_property_readonly("active_nic", &RecvConnection::activeLocalNic,
                             "local NIC index of the active path; -1 when none is active")
      .def("paths", &RecvConnection::describePaths)
      .def("close", &RecvConnection::close, py::call_guard<py::gil_scoped_release>());

  py::class_<Listener, std::shared_ptr<Listener>>(m, "Listener")
      .def_property_readonly("handle",
                             [](const Listener& l) {
                               const auto& h = l.handle();
                               return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
                             })
      .def_property_readonly("nic", &Listener::nic)
      .def(
          "accept",
          [](Listener& l, double timeout) {
            std::shared_ptr<RecvConnection> c;
            {
              py::gil_scoped_release release;
              c = l.accept(toMillis(timeout));
            }
            if (!c) throw TimeoutError("no connection within " + std::to_string(timeout) + " s");
            return c;
          },
          py::arg("timeout") = 30.0, py::keep_alive<0, 1>())
      .def("close", &Listener::close);
}

// The low-level TCP transport (made by the transport factory).
void bindTransport(py::module_& m) {
  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def(
          py::init([](py::object env) {
            Config config = configFromEnv(env);
            config.applyLogLevel();
            return std::shared_ptr<Transport>(makeTcpTransport(config));
          }),
          py::arg("env") = py::none(),
          "A TCP transport over the RECCL_NICS NICs. `env`: RECCL_* settings (default: os.environ)")
      .def("nics",
           [](const Transport& t) {
             py::list out;
             for (size_t i = 0; i < t.nics().size(); ++i)
               out.append(nicDict(t.nics()[i], static_cast<int>(i), t.nics()));
             return out;
           })
      .def("listen", &Transport::listen, py::arg("nic") = 0, py::keep_alive<0, 1>())
      .def(
          "register", [](Transport& t, py::buffer buffer) { return registerBuffer(t, buffer); },
          py::arg("buffer"), "None: TCP registers no memory (data is always copied)")
      .def(
          "connect",
          [](Transport& t, int nic, py::bytes handle) {
            std::string bytes = handle;
            return t.connect(nic, std::vector<uint8_t>(bytes.begin(), bytes.end()));
          },
          py::arg("nic"), py::arg("handle"), py::keep_alive<0, 1>());
  m.attr("HANDLE_BYTES") = kHandleBytes;
}

// The RECCL_* settings table and option checks.
void bindSettings(py::module_& m) {
  m.def(
      "validate_config", [](py::object env) { configFromEnv(env); }, py::arg("env") = py::none(),
      "Raises ConfigError for an unknown RECCL_* name or bad value");
  m.def(
      "settings",
      [] {
        py::list out;
        for (const SettingSpec& spec : settings()) {
          py::dict d;
          d["name"] = spec.name;
          d["default"] =
              spec.defaultValue ? py::object(py::str(spec.defaultValue)) : py::object(py::none());
          d["default_doc"] =
              spec.defaultDoc ? py::object(py::str(spec.defaultDoc)) : py::object(py::none());
          d["valid"] = describeValid(spec);
          d["range"] = spec.type == SettingType::kInt || spec.type == SettingType::kIntList
                           ? py::object(py::make_tuple(spec.lo, spec.hi))
                           : py::object(py::none());
          d["option"] = spec.option ? py::object(py::str(spec.option)) : py::object(py::none());
          d["doc"] = spec.doc;
          out.append(d);
        }
        return out;
      },
      "Every RECCL_* setting from the table in core/config.cc, in documentation order: name, "
      "default (None: found at run time, see default_doc), valid (in words), range "
      "(integers), option (the backend.Options field overriding it) and doc.");
  m.def("check_option", &checkOption, py::arg("option"), py::arg("value"),
        "Raises ConfigError unless `value` (text) is valid for process-group option `option`.");
}

// The NIC table and fault injection.
void bindNics(py::module_& m) {
  m.def(
      "discover_nics",
      [](py::object env) {
        Config config = configFromEnv(env);
        std::vector<NicInfo> nics = discoverNics(config.nics);
        py::list out;
        for (size_t i = 0; i < nics.size(); ++i)
          out.append(nicDict(nics[i], static_cast<int>(i), nics));
        return out;
      },
      py::arg("env") = py::none());
  m.def(
      "inject_fault",
      [](const std::string& nic, const std::string& kind) {
        NicHealth& health = NicHealth::instance();
        int id = healthIdOrThrow(nic);
        if (kind == "down") {
          health.setInjectedDown(id, true);
        } else if (kind == "up") {
          health.setInjectedDown(id, false);
          health.setBlackhole(id, false);
        } else if (kind == "blackhole") {
          health.setBlackhole(id, true);
        } else {
          throw ConfigError("fault kind '" + kind +
                            "' is not valid here; valid: down, up, blackhole");
        }
      },
      py::arg("nic"), py::arg("kind"));
}

// Events, NIC counters and process-wide stats.
void bindStats(py::module_& m) {
  m.def(
      "drain_events",
      [](size_t max) {
        py::list out;
        for (const auto& event : NicHealth::instance().events().drain(max))
          out.append(eventDict(event));
        return out;
      },
      py::arg("max") = 1024);
  m.def("nic_stats", [] {
    NicHealth& health = NicHealth::instance();
    py::dict out;
    std::vector<std::string> names = health.names();
    for (size_t i = 0; i < names.size(); ++i) {
      NicCounters& c = health.counters(static_cast<int>(i));
      py::dict d;
      d["up"] = health.linkUsable(static_cast<int>(i));
      d["blackholed"] = health.blackholed(static_cast<int>(i));
      d["bytes_sent"] = c.bytesSent.load();
      d["bytes_received"] = c.bytesReceived.load();
      d["failovers"] = c.failovers.load();
      d["failbacks"] = c.failbacks.load();
      d["paths_down"] = c.pathsDown.load();
      d["nvl_bytes"] = c.nvlBytes.load();
      d["same_host_bytes"] = c.sameHostBytes.load();
      d["grey"] = greyStateName(health.grey(static_cast<int>(i)));
      d["degraded"] = health.grey(static_cast<int>(i)) != GreyState::kHealthy;
      d["weight"] = health.weight(static_cast<int>(i));
      d["busy_bytes"] = c.busyBytes.load();
      d["busy_s"] = static_cast<double>(c.busyNs.load()) / 1e9;
      out[py::str(names[i])] = d;
    }
    return out;
  });
  m.def("process_stats", [] {
    py::dict d;
    d["rejected_handshakes"] = NicHealth::instance().rejectedHandshakes();
    d["events_dropped"] = NicHealth::instance().events().dropped();
    d["nvl_transit_bytes"] = NicHealth::instance().transitBytes();
    d["nvl_transit_peak_bytes"] = NicHealth::instance().transitPeakBytes();
    // The event loops running now (RECCL_IO_THREADS per NIC in use), which
    // serve TCP sockets and IB completion channels alike.
    d["io_threads"] = EventLoops::instance().runningThreads();
    // Connections spreading now (RECCL_SPREAD), each with its lanes' NICs.
    py::list spreading;
    for (const SpreadInfo& info : SpreadTable::instance().list()) {
      py::dict entry;
      entry["connection"] = info.connection;
      entry["peer"] = info.peer;
      entry["nics"] = info.nics;
      spreading.append(entry);
    }
    d["spreading"] = spreading;
    // Connections with no usable path now, waiting for one (`stalled` events).
    py::list stalled;
    for (const StallInfo& info : stalledConnections()) {
      py::dict entry;
      entry["connection"] = info.connection;
      entry["peer"] = info.peer;
      entry["since"] = info.sinceWallNs / 1e9;
      entry["paths"] = info.paths;
      stalled.append(entry);
    }
    d["stalled"] = stalled;
    d["stalls"] = stallsReported();
    return d;
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_reccl native core: bonded connections with failover";
  reserveDescriptorTable();  // long before a group's sockets need the room
  bindErrors(m);
  bindConnections(m);
  bindTransport(m);
  bindSettings(m);
  bindNics(m);
  bindStats(m);
  bindProcessGroup(m);
  bindIbTransport(m);
  bindGpu(m);
  bindExecutor(m);
}
