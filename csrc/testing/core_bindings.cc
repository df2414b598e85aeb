// Test hooks of the core's pure logic and the wire formats, in the test module
// torch_reccl._testing (never in the library NCCL loads): frames and handles
// from bytes, the log limiter on a fake clock, the grey detector fed with
// synthetic counters, the spreading lanes' choice, and backup choice.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "core/config.h"
#include "core/error.h"
#include "core/frame.h"
#include "core/grey_detector.h"
#include "core/log.h"
#include "core/spread.h"
#include "core/topology.h"
#include "transport/handle.h"

namespace py = pybind11;
using namespace reccl;

namespace {

void bindWire(py::module_& m) {
  m.def(
      "parse_frame",
      [](py::bytes data) {
        std::string bytes = data;
        const auto* raw = reinterpret_cast<const uint8_t*>(bytes.data());
        FrameHeader header = parseFrameHeader(raw, bytes.size());
        if (header.type == static_cast<uint8_t>(FrameType::kData) ||
            header.type == static_cast<uint8_t>(FrameType::kDataRef)) {
          return std::string(frameTypeName(static_cast<FrameType>(header.type)));
        }
        ControlFrame frame =
            decodeControl(header, raw + sizeof(FrameHeader), bytes.size() - sizeof(FrameHeader));
        return std::string(frameTypeName(frame.type));
      },
      "Decodes one whole control frame; returns its type name or raises ProtocolError");
  m.def("decode_handle", [](py::bytes data) {
    std::string bytes = data;
    ListenHandle handle =
        decodeHandle(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    py::dict d;
    d["listener_nic"] = handle.listenerNic;
    d["listener_backup"] = handle.listenerBackup;
    d["chunk_bytes"] = handle.chunkBytes;
    py::list nics;
    for (const auto& nic : handle.nics) nics.append(py::make_tuple(nic.address, nic.port));
    d["nics"] = nics;
    return d;
  });
  m.def(
      "encode_frame",
      [](const std::string& kind, uint64_t a, uint64_t b) {
        std::vector<uint8_t> frame;
        if (kind == "cts")
          frame = encodeCts(a, b);
        else if (kind == "ack")
          frame = encodeAck(a, b);
        else if (kind == "activate")
          frame = encodeActivate(a, static_cast<uint8_t>(b), 0);
        else if (kind == "heartbeat")
          frame = encodeHeartbeat();
        else if (kind == "close")
          frame = encodeClose();
        else if (kind == "resync")
          frame = encodeResync(a, b, {});
        else
          throw ConfigError("unknown frame kind " + kind);
        return py::bytes(reinterpret_cast<const char*>(frame.data()), frame.size());
      },
      "A valid frame to mutate");
}

void bindLogLimiter(py::module_& m) {
  m.def(
      "log_limiter_trace",
      [](int64_t intervalMs, const std::string& what,
         const std::vector<std::tuple<int64_t, std::optional<std::string>, std::string>>& calls) {
        // Replays `calls` (time in ms, key, line; key None: flushDue) on a
        // LogLimiter with a fake clock; returns what it wrote, the
        // destructor's last counts included, and each flush's next due time.
        py::list written, due;
        const Clock::time_point zero = Clock::now();
        {
          LogLimiter limiter(LogLevel::kWarn, Millis(intervalMs), what,
                             [&](LogLevel, const std::string& text) { written.append(text); });
          for (const auto& [ms, key, line] : calls) {
            const Clock::time_point at = zero + Millis(ms);
            if (key) {
              limiter.log(*key, line, at);
            } else {
              Clock::time_point next = limiter.flushDue(at);
              due.append(next == Clock::time_point::max()
                             ? py::object(py::none())
                             : py::object(py::int_(
                                   std::chrono::duration_cast<Millis>(next - zero).count())));
            }
          }
        }
        return py::make_tuple(written, due);
      },
      py::arg("interval_ms"), py::arg("what"), py::arg("calls"),
      "A LogLimiter's output for (ms, key or None to flush, line) calls.");
}

void bindGreyDetector(py::module_& m) {
  py::class_<GreyDetector>(m, "GreyDetector",
                           "The grey-failure decision logic fed with synthetic counters")
      .def(py::init([](const py::dict& settings) {
             // The defaults of RECCL_GREY_*, overridden by the process environment.
             Config config = Config::fromProcessEnv();
             GreySettings s = GreySettings::fromConfig(config);
             for (const auto& [key, value] : settings) {
               const std::string name = py::str(key);
               if (name == "low_ratio")
                 s.lowRatio = value.cast<double>();
               else if (name == "recover_ratio")
                 s.recoverRatio = value.cast<double>();
               else if (name == "sustain_ms")
                 s.sustainNs = value.cast<int64_t>() * 1000000;
               else if (name == "min_bytes")
                 s.minBytes = value.cast<uint64_t>();
               else if (name == "retry_ms")
                 s.retryNs = value.cast<int64_t>() * 1000000;
               else
                 throw ConfigError("GreyDetector: unknown setting '" + name +
                                   "'; valid: low_ratio, "
                                   "recover_ratio, sustain_ms, min_bytes, retry_ms");
             }
             return GreyDetector(s);
           }),
           py::arg("settings") = py::dict())
      .def(
          "sample",
          [](GreyDetector& detector, int64_t nowNs,
             const std::vector<std::tuple<uint64_t, int64_t, bool>>& nics) {
            std::vector<GreySample> samples;
            for (const auto& [bytes, busyNs, linkUp] : nics)
              samples.push_back({bytes, busyNs, linkUp});
            py::list out;
            for (const GreyChange& c : detector.sample(nowNs, samples)) {
              py::dict d;
              d["nic"] = c.nic;
              d["state"] = greyStateName(c.state);
              d["ratio"] = c.ratio;
              d["announce"] = c.announce;
              d["detail"] = c.detail;
              out.append(d);
            }
            return out;
          },
          py::arg("now_ns"), py::arg("nics"),
          "nics: (busy bytes, busy ns, link up) cumulative per NIC; returns the verdicts that "
          "changed")
      .def("peer_found_slow", &GreyDetector::peerFoundSlow, py::arg("nic"),
           "a peer condemned the far end of a path on this NIC (NOTIFY, reason slow)")
      .def("last_resort", &GreyDetector::lastResort,
           "a connection has no usable path: put every degraded NIC with link on trial")
      .def("state",
           [](const GreyDetector& d, int nic) { return std::string(greyStateName(d.state(nic))); })
      .def("ratio", &GreyDetector::ratio)
      .def_property_readonly("loaded", &GreyDetector::loaded);
}

void bindSpreadLanes(py::module_& m) {
  py::class_<SpreadLanes>(m, "SpreadLanes", "The spreading scheduler's lane choice")
      .def(py::init<>())
      .def("reset", &SpreadLanes::reset, py::arg("slots"), py::arg("factors"))
      .def(
          "pick",
          [](SpreadLanes& lanes, uint64_t bytes, int64_t atMs) {
            return lanes.pick(bytes, Clock::time_point(std::chrono::milliseconds(atMs)));
          },
          py::arg("bytes"), py::arg("at_ms"))
      .def(
          "acked",
          [](SpreadLanes& lanes, int slot, uint64_t bytes, int64_t atMs) {
            lanes.acked(slot, bytes, Clock::time_point(std::chrono::milliseconds(atMs)));
          },
          py::arg("slot"), py::arg("bytes"), py::arg("at_ms"),
          "at_ms: times on a clock of the test's own (only differences count)");
  m.def("spread_distance_factor", &spreadDistanceFactor, py::arg("cost"));
}

void bindBackupChoice(py::module_& m) {
  m.def(
      "choose_backups",
      [](const std::vector<std::tuple<std::string, std::string, int>>& nics) {
        std::vector<NicInfo> infos;
        for (const auto& [name, pciPath, numa] : nics) {
          NicInfo info;
          info.name = name;
          info.pciPath = pciPath;
          info.numaNode = numa;
          infos.push_back(info);
        }
        chooseBackups(infos);
        std::vector<std::pair<int, int>> out;
        for (const auto& info : infos) out.push_back({info.backup, info.backupCost});
        return out;
      },
      "(name, sysfs PCI path, NUMA node) per NIC -> (backup index, cost) per NIC");
}

}  // namespace

void bindCoreRules(py::module_& m) {
  bindWire(m);
  bindLogLimiter(m);
  bindGreyDetector(m);
  bindSpreadLanes(m);
  bindBackupChoice(m);
}
