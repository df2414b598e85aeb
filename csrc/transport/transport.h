// What every transport offers the layers above it (the NCCL plugin, the CPU
// engine's links, the Python API): its NICs, listeners and connections. The
// bonded connections themselves are the core's (SendConnection /
// RecvConnection) and the listener is shared (transport/listener.h); a
// transport only decides how one path is dialed and carried. TcpTransport and
// IbTransport implement it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "core/memory_registration.h"
#include "core/recv_connection.h"
#include "core/send_connection.h"
#include "core/topology.h"
#include "transport/listener.h"

namespace reccl {

class Transport {
 public:
  virtual ~Transport() = default;

  // "tcp" or "ib", for logs and tools.
  virtual const char* kind() const = 0;
  virtual const Config& config() const = 0;
  // One entry per NIC (interface or RDMA device), in rail order: its name in
  // health, stats and events, its backup, link state, speed, PCI path.
  virtual const std::vector<NicInfo>& nics() const = 0;
  // The NIC's id in the process-wide health table.
  virtual int healthId(int nic) const = 0;

  // A listener on `nic`; its handle (kHandleBytes) goes to the sender out of band.
  virtual std::shared_ptr<Listener> listen(int nic) = 0;
  // Starts connecting at once to the listener behind `handle`; poll
  // SendConnection::ready(). `tag` (nonzero) names the connection to a
  // listener that serves several (Listener::acceptTagged); 0: untagged.
  virtual std::shared_ptr<SendConnection> connect(int nic, const std::vector<uint8_t>& handle,
                                                  uint64_t tag) = 0;
  std::shared_ptr<SendConnection> connect(int nic, const std::vector<uint8_t>& handle) {
    return connect(nic, handle, 0);
  }

  // Registers host memory [base, base + bytes) on every NIC for zero-copy
  // sends and receives (isend/irecv take the result). nullptr when this
  // transport does not register memory (TCP; IB with RECCL_IB_ZERO_COPY=0):
  // the data then travels as it always does. Throws Error when registering fails.
  virtual std::unique_ptr<MemoryRegistration> registerMemory(void* base, uint64_t bytes) {
    (void)base;
    (void)bytes;
    return nullptr;
  }
  // Registers device (GPU) memory by its pointer on every NIC, for direct
  // placement only (ibv_reg_mr on a GPU pointer: needs nvidia-peermem on a
  // real host). Throws Error when this transport or host cannot.
  virtual std::unique_ptr<MemoryRegistration> registerDeviceMemory(void* address, uint64_t bytes) {
    (void)address;
    (void)bytes;
    throw Error(std::string(kind()) + " transport does not register device memory");
  }
  // Makes what this transport's NICs wrote directly into the device memory at
  // `address` (inside `registration`) visible to the device, through each NIC
  // in `writers` (bit i: NIC i; RecvConnection::takePlacedNics; 0: any one).
  // Nothing to do for host memory or for a transport that never writes device
  // memory. Bounded; throws Error.
  virtual void flushDeviceWrites(const MemoryRegistration& registration, uint64_t address,
                                 uint64_t writers) {
    (void)registration;
    (void)address;
    (void)writers;
  }
  // Whether registerDeviceMemory can work here (a peer-memory module lets the
  // NICs map GPU memory by pointer), and if not, why not.
  virtual bool supportsPeerMemory(std::string* why) const {
    *why = std::string(kind()) + " transport does not register device memory";
    return false;
  }
  // Whether registerDmaBuf can work here, and if not, why not.
  virtual bool supportsDmaBuf(std::string* why) const {
    *why = std::string(kind()) + " transport does not register dma-buf memory";
    return false;
  }
  // Registers `bytes` of the dma-buf `fd` from `offset` on every NIC; the
  // caller addresses that memory as [address, address + bytes) (a GPU
  // pointer: the NIC's I/O virtual address). The CPU never touches it.
  // Throws Error when unsupported (supportsDmaBuf) or when registering fails.
  virtual std::unique_ptr<MemoryRegistration> registerDmaBuf(int fd, uint64_t offset,
                                                             uint64_t bytes, uint64_t address) {
    (void)fd;
    (void)offset;
    (void)bytes;
    (void)address;
    std::string why;
    supportsDmaBuf(&why);
    throw Error("dma-buf registration is not supported: " + why);
  }
};

}  // namespace reccl
