// NVL for the NCCL plugin (docs/design.md §7): when NCCL hands the plugin GPU buffers,
// each message is staged between the GPU and host memory for the transport;
// when the connection's active NIC sits next to another GPU (a backup NIC
// across the root complex, or every channel on one NIC), the message crosses
// NVLink to that GPU first and takes only its short PCIe hop.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/topology.h"
#include "gpu/cuda_api.h"
#include "gpu/device_stager.h"
#include "gpu/pinned_buffer.h"
#include "gpu/transit_map.h"

namespace reccl {

class Nvl {
 public:
  // The plugin's NVL, or nullptr (host buffers only) for RECCL_NVL=off, with
  // the reason in `why`. Throws ConfigError when RECCL_NVL=on finds no CUDA
  // GPU or RECCL_NIC_GPUS is wrong. `healthIds[n]` is NIC n's health-table id.
  // `cuda` null: the CUDA driver in own contexts; tests pass an emulation.
  static std::unique_ptr<Nvl> create(const Config& config, const std::vector<NicInfo>& nics,
                                     std::vector<int> healthIds, std::shared_ptr<CudaApi> cuda,
                                     std::string* why);

  // "NIC 0 next to GPU 0, NIC 1 next to GPU 1; transit GPUs: <which, from where>; GPU 1 via
  // GPU 0 for NIC 0, ...; transit up to N bytes per registered buffer".
  std::string describe() const;

  // One GPU buffer NCCL registered on a connection: its pinned host mirror
  // (a message at offset k of the buffer is staged at offset k of the mirror,
  // so messages in flight never share staging memory) and a stager prepared
  // for every transit GPU the buffer's GPU may use. All allocated here, at
  // registration, never on the data path.
  class Region {
   public:
    int gpu() const { return gpu_; }
    // Where the message for `data` (inside this region) sits on the host: sent
    // from there once staged, received there before delivery.
    uint8_t* hostCopy(const uint8_t* data, size_t bytes, const char* what);
    // Queues the copy of `bytes` at `data` to the mirror, for a message
    // leaving over local NIC `nic` (-1: none active; direct). Nothing when
    // DeviceStager::kMaxInFlight copies are in flight (retry later).
    std::optional<DeviceStager::Transfer> startSend(const uint8_t* data, size_t bytes, int nic);
    // Queues the copy of the received `bytes` from the mirror into `data`; they
    // arrived over local NIC `nic`. Nothing when all slots are busy.
    std::optional<DeviceStager::Transfer> startDeliver(uint8_t* data, size_t bytes, int nic);
    // Whether a queued copy finished; throws Error past its deadline.
    bool finished(DeviceStager::Transfer& transfer) { return stager_.done(transfer); }

   private:
    friend class Nvl;
    Region(Nvl& nvl, int gpu, uint8_t* base, size_t size);
    size_t offsetOf(const uint8_t* data, size_t bytes, const char* what) const;
    // Counts `bytes` on NIC `nic`'s nvl_bytes when they crossed to a transit GPU.
    void countTransit(int nic, int transit, size_t bytes);
    Nvl& nvl_;
    const int gpu_;
    uint8_t* const base_;
    const size_t size_;
    PinnedBuffer mirror_;
    DeviceStager stager_;
  };
  // Registers `size` bytes of GPU memory at `data`; throws Error when CUDA does
  // not know it as device memory.
  std::unique_ptr<Region> registerRegion(void* data, size_t size);

 private:
  Nvl(const Config& config, std::shared_ptr<CudaApi> cuda, TransitMap map,
      std::vector<int> healthIds, std::string transitPeers)
      : config_(config),
        cuda_(std::move(cuda)),
        map_(std::move(map)),
        healthIds_(std::move(healthIds)),
        transitPeers_(std::move(transitPeers)) {}

  Config config_;
  std::shared_ptr<CudaApi> cuda_;
  TransitMap map_;
  std::vector<int> healthIds_;
  std::string transitPeers_;  // which GPUs may be transit GPUs, and who said so
};

}  // namespace reccl
