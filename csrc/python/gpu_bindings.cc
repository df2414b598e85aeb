// Python bindings of the NVL pieces (torch_reccl._C), for tests, bench/ and `reccl topo`:
// the transit map (pure logic, testable without a GPU) and the device stager
// over the CUDA driver (own contexts). The NCCL plugin uses them directly; the
// CUDA emulation is in the test module torch_reccl._testing.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/error.h"
#include "core/health.h"
#include "gpu/cuda_driver.h"
#include "gpu/device_stager.h"
#include "gpu/transit_map.h"

namespace py = pybind11;
using namespace reccl;

namespace {

TransitMap::PeerAccess peerMatrix(const std::vector<std::vector<bool>>& peers) {
  return [peers](int gpu, int other) {
    return gpu < static_cast<int>(peers.size()) && other < static_cast<int>(peers[gpu].size()) &&
           peers[gpu][other];
  };
}

py::dict describeMap(const TransitMap& map, int gpus, size_t nics) {
  py::dict out;
  out["nic_gpus"] = map.nicGpus();
  std::vector<std::vector<int>> transit(gpus, std::vector<int>(nics, -1));
  bool anyTransit = false;
  for (int g = 0; g < gpus; ++g) {
    for (size_t n = 0; n < nics; ++n) {
      transit[g][n] = map.transitGpu(g, static_cast<int>(n));
      anyTransit = anyTransit || transit[g][n] >= 0;
    }
  }
  out["transit"] = transit;
  out["any_transit"] = anyTransit;
  return out;
}

uint8_t* pointer(uintptr_t address) { return reinterpret_cast<uint8_t*>(address); }

}  // namespace

void bindGpu(py::module_& m) {
  m.def(
      "transit_map_from_nic_gpus",
      [](const std::vector<int>& nicGpus, size_t nicCount, int gpuCount,
         const std::vector<std::vector<bool>>& peers) {
        return describeMap(TransitMap::fromNicGpus(nicGpus, nicCount, gpuCount, peerMatrix(peers)),
                           gpuCount, nicCount);
      },
      py::arg("nic_gpus"), py::arg("nic_count"), py::arg("gpu_count"), py::arg("peers"),
      "For tests: NVL's transit GPU per (buffer GPU, NIC) from RECCL_NIC_GPUS");
  m.def(
      "transit_map_from_pci",
      [](const std::vector<std::pair<std::string, int>>& gpus,
         const std::vector<std::pair<std::string, int>>& nics,
         const std::vector<std::vector<bool>>& peers) {
        std::vector<PciLocation> gpuLocations, nicLocations;
        for (const auto& [path, numa] : gpus) gpuLocations.push_back({path, numa});
        for (const auto& [path, numa] : nics) nicLocations.push_back({path, numa});
        return describeMap(TransitMap::fromPci(gpuLocations, nicLocations, peerMatrix(peers)),
                           static_cast<int>(gpus.size()), nics.size());
      },
      py::arg("gpus"), py::arg("nics"), py::arg("peers"),
      "For reccl topo and tests: NVL's transit GPU per (buffer GPU, NIC) from (sysfs path, "
      "NUMA node) pairs");
  m.def(
      "nvlink_peer_matrix",
      [](const std::vector<std::string>& setting, const std::vector<std::string>& busIds) {
        NvlinkPairs pairs = NvlinkPairs::parse(setting);
        std::vector<std::vector<bool>> joined(busIds.size(),
                                              std::vector<bool>(busIds.size(), false));
        for (size_t a = 0; a < busIds.size(); ++a) {
          for (size_t b = 0; b < busIds.size(); ++b)
            joined[a][b] = pairs.joined(busIds[a], busIds[b]);
        }
        return joined;
      },
      py::arg("setting"), py::arg("bus_ids"),
      "For reccl topo and tests: which GPUs (by PCI bus id) RECCL_NVLINK_PEERS's items join, "
      "as NVL reads them");
  m.def(
      "cuda_driver_problem",
      [] {
        std::string error;
        CudaDriver::load(&error);
        return error;
      },
      "Why NVL cannot stage here ('' when a CUDA driver with GPUs is loadable)");

  py::class_<DeviceStager, std::shared_ptr<DeviceStager>>(
      m, "DeviceStager",
      "NVL's copies between GPU buffers and pinned host memory (addresses as ints)")
      .def(py::init([](int64_t maxTransitBytes, int timeoutMs) {
             std::string error;
             std::shared_ptr<CudaApi> cuda = CudaDriver::load(&error);
             if (!cuda) throw ConfigError("DeviceStager needs CUDA GPUs: " + error);
             return std::make_shared<DeviceStager>(std::move(cuda), maxTransitBytes, timeoutMs);
           }),
           py::arg("max_transit_bytes") = 32 << 20, py::arg("timeout_ms") = 10000)
      .def(
          "prepare",
          [](DeviceStager& s, int bufferGpu, size_t messageBytes,
             const std::vector<int>& transitGpus) {
            py::gil_scoped_release release;
            s.prepare(bufferGpu, messageBytes, transitGpus);
          },
          py::arg("buffer_gpu"), py::arg("message_bytes"), py::arg("transit_gpus"),
          "Streams, peer access and transit buffers; once, before any copy")
      .def(
          "to_host",
          [](DeviceStager& s, uintptr_t host, uintptr_t src, int srcGpu, size_t bytes,
             int transitGpu) {
            py::gil_scoped_release release;
            s.toHost(pointer(host), pointer(src), srcGpu, bytes, transitGpu);
          },
          py::arg("host"), py::arg("src"), py::arg("src_gpu"), py::arg("bytes"),
          py::arg("transit_gpu"))
      .def(
          "to_device",
          [](DeviceStager& s, uintptr_t dst, int dstGpu, uintptr_t host, size_t bytes,
             int transitGpu) {
            py::gil_scoped_release release;
            s.toDevice(pointer(dst), dstGpu, pointer(host), bytes, transitGpu);
          },
          py::arg("dst"), py::arg("dst_gpu"), py::arg("host"), py::arg("bytes"),
          py::arg("transit_gpu"))
      .def_property_readonly("transit_bytes", &DeviceStager::transitBytes);
}
