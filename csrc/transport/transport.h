// What every transport offers the layers above it (the NCCL plugin, the CPU
// engine's links, the Python API): its NICs, listeners and connections. The
// bonded connections themselves are the core's (SendConnection /
// RecvConnection) and the listener is shared (transport/listener.h); a
// transport only decides how one path is dialed and carried. TcpTransport and
// IbTransport implement it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/config.h"
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
  // SendConnection::ready().
  virtual std::shared_ptr<SendConnection> connect(int nic, const std::vector<uint8_t>& handle) = 0;
};

}  // namespace reccl
