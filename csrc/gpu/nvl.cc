#include "gpu/nvl.h"

#include "core/error.h"
#include "core/health.h"
#include "gpu/cuda_driver.h"

namespace reccl {

namespace {
// The bound on one GPU copy of the staging. A copy waits for no network: only a
// hung GPU or driver keeps it from finishing, so it is a fixed 10 s, not the wait
// for a path (RECCL_NO_PATH_TIMEOUT_MS), which is long enough to ride out outages.
constexpr int kCopyTimeoutMs = 10000;
}  // namespace

std::unique_ptr<Nvl> Nvl::create(const Config& config, const std::vector<NicInfo>& nics,
                                 std::vector<int> healthIds, std::shared_ptr<CudaApi> cuda,
                                 std::string* why) {
  if (!config.nvl) {
    *why = "RECCL_NVL=off";
    return nullptr;
  }
  std::string error;
  if (!cuda) cuda = CudaDriver::load(&error);
  if (!cuda) throw ConfigError("RECCL_NVL=on needs CUDA GPUs: " + error);
  const int gpus = cuda->deviceCount();
  std::string transitPeers;
  TransitMap::PeerAccess peer;
  if (config.nvlinkPeers.empty()) {
    transitPeers =
        "any GPU with CUDA peer access (RECCL_NVLINK_PEERS unset: `import torch_reccl` "
        "sets it where pynvml and NVML answer; `reccl topo` says why not)";
    peer = [&](int gpu, int other) { return cuda->canAccessPeer(gpu, other); };
  } else {
    NvlinkPairs pairs = NvlinkPairs::parse(config.nvlinkPeers);
    transitPeers = "NVLink peers only (RECCL_NVLINK_PEERS: " + std::to_string(pairs.size()) +
                   (pairs.size() == 1 ? " pair)" : " pairs)");
    std::vector<std::string> busIds;
    for (int g = 0; g < gpus; ++g) busIds.push_back(cuda->pciBusId(g));
    peer = [&cuda, pairs, busIds](int gpu, int other) {
      return pairs.joined(busIds[gpu], busIds[other]) && cuda->canAccessPeer(gpu, other);
    };
  }
  TransitMap map;
  if (!config.nicGpus.empty()) {
    map = TransitMap::fromNicGpus(config.nicGpus, nics.size(), gpus, peer);
  } else {
    std::vector<PciLocation> gpuLocations, nicLocations;
    for (int g = 0; g < gpus; ++g) gpuLocations.push_back(pciLocationOfBusId(cuda->pciBusId(g)));
    for (const auto& nic : nics) nicLocations.push_back({nic.pciPath, nic.numaNode});
    map = TransitMap::fromPci(gpuLocations, nicLocations, peer);
  }
  // Contexts and peer access for the device NCCL initialises now, before its
  // kernels run: creating them allocates and maps GPU memory.
  const int current = cuda->currentDevice();
  for (size_t nic = 0; nic < nics.size() && current >= 0; ++nic) {
    int transit = map.transitGpu(current, static_cast<int>(nic));
    if (transit >= 0) cuda->enablePeerAccess(current, transit);
  }
  return std::unique_ptr<Nvl>(new Nvl(config, std::move(cuda), std::move(map), std::move(healthIds),
                                      std::move(transitPeers)));
}

std::string Nvl::describe() const {
  std::string out;
  for (size_t n = 0; n < map_.nicGpus().size(); ++n) {
    if (!out.empty()) out += ", ";
    int gpu = map_.nicGpus()[n];
    out += "NIC " + std::to_string(n) + " next to " +
           (gpu < 0 ? std::string("no known GPU") : "GPU " + std::to_string(gpu));
  }
  out += "; transit GPUs: " + transitPeers_ + ";";
  bool any = false;
  for (int g = 0; g < map_.gpuCount(); ++g) {
    for (size_t n = 0; n < map_.nicGpus().size(); ++n) {
      const int transit = map_.transitGpu(g, static_cast<int>(n));
      if (transit < 0) continue;
      out += std::string(any ? "," : "") + " GPU " + std::to_string(g) + " via GPU " +
             std::to_string(transit) + " for NIC " + std::to_string(n);
      any = true;
    }
  }
  if (!any) out += " none used, every GPU goes direct";
  return out + "; transit up to " + std::to_string(config_.nvlMaxBytes) +
         " bytes per registered buffer";
}

std::unique_ptr<Nvl::Region> Nvl::registerRegion(void* data, size_t size) {
  const int gpu = cuda_->deviceOf(data);
  if (gpu < 0) {
    throw Error("regMr: " + std::to_string(size) +
                " bytes registered as GPU memory are not known to CUDA");
  }
  if (!cuda_->isVirtualMemory(data)) {
    throw Error(
        "regMr: RECCL_NVL stages only GPU buffers from CUDA's virtual memory API (NCCL allocates "
        "its buffers so with NCCL_CUMEM_ENABLE=1, its default where the driver supports it); "
        "these " +
        std::to_string(size) + " bytes on GPU " + std::to_string(gpu) +
        " come from cudaMalloc, and copying them would wait for the application's CUDA calls. "
        "Set NCCL_CUMEM_ENABLE=1 (and, for tensors registered with NCCL, "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or RECCL_NVL=off");
  }
  return std::unique_ptr<Region>(new Region(*this, gpu, static_cast<uint8_t*>(data), size));
}

Nvl::Region::Region(Nvl& nvl, int gpu, uint8_t* base, size_t size)
    : nvl_(nvl),
      gpu_(gpu),
      base_(base),
      size_(size),
      mirror_(nvl.cuda_, gpu, size),
      stager_(nvl.cuda_, nvl.config_.nvlMaxBytes, kCopyTimeoutMs) {
  std::vector<int> transits;
  for (size_t nic = 0; nic < nvl.healthIds_.size(); ++nic) {
    transits.push_back(nvl.map_.transitGpu(gpu, static_cast<int>(nic)));
  }
  stager_.prepare(gpu, size, transits);
}

size_t Nvl::Region::offsetOf(const uint8_t* data, size_t bytes, const char* what) const {
  if (data < base_ || bytes > size_ || static_cast<size_t>(data - base_) > size_ - bytes) {
    throw Error(std::string(what) + ": " + std::to_string(bytes) +
                " bytes lie outside the GPU buffer registered for them (" + std::to_string(size_) +
                " bytes)");
  }
  return static_cast<size_t>(data - base_);
}

void Nvl::Region::countTransit(int nic, int transit, size_t bytes) {
  if (transit >= 0) NicHealth::instance().counters(nvl_.healthIds_[nic]).nvlBytes.fetch_add(bytes);
}

uint8_t* Nvl::Region::hostCopy(const uint8_t* data, size_t bytes, const char* what) {
  return mirror_.data() + offsetOf(data, bytes, what);
}

std::optional<DeviceStager::Transfer> Nvl::Region::startSend(const uint8_t* data, size_t bytes,
                                                             int nic) {
  uint8_t* host = hostCopy(data, bytes, "isend");
  const int transit = nvl_.map_.transitGpu(gpu_, nic);
  std::optional<DeviceStager::Transfer> transfer =
      stager_.startToHost(host, data, gpu_, bytes, transit);
  if (transfer) countTransit(nic, transit, bytes);
  return transfer;
}

std::optional<DeviceStager::Transfer> Nvl::Region::startDeliver(uint8_t* data, size_t bytes,
                                                                int nic) {
  const int transit = nvl_.map_.transitGpu(gpu_, nic);
  std::optional<DeviceStager::Transfer> transfer =
      stager_.startToDevice(data, gpu_, hostCopy(data, bytes, "irecv"), bytes, transit);
  if (transfer) countTransit(nic, transit, bytes);
  return transfer;
}

}  // namespace reccl
