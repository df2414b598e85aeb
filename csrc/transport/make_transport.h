// The transport factory: which transport a process runs over (RECCL_TRANSPORT:
// auto | tcp | ib), and making it. auto takes IB when the verbs library loads
// and lists RDMA devices, TCP otherwise; ib without a library or devices is a
// ConfigError saying which is missing. The one place that builds a TCP
// transport (tcp/ is known to nothing else).
#pragma once

#include <memory>
#include <string>

#include "core/config.h"
#include "transport/transport.h"

namespace reccl {

class VerbsApi;  // transport/ib/verbs_api.h

struct TransportChoice {
  std::string kind;    // "tcp" or "ib"
  std::string reason;  // why, for the log
  std::shared_ptr<VerbsApi> verbs;  // the provider IB runs over; null for tcp
};

// `verbs`: the provider to use for IB instead of the system libibverbs (tests
// install the emulation); nullptr = dlopen the system library when IB is
// possible. Throws ConfigError for RECCL_TRANSPORT=ib with no library or no
// devices.
TransportChoice chooseTransport(const Config& config, std::shared_ptr<VerbsApi> verbs);

// The local IPv4 address of the IB bootstrap sockets: RECCL_IB_BOOTSTRAP, else
// the first NIC RECCL_NICS selects (or discovers). ConfigError naming the
// available interfaces when there is none.
std::string ibBootstrapAddress(const Config& config);

// The transport `chooseTransport` picks, made.
std::unique_ptr<Transport> makeTransport(const Config& config, std::shared_ptr<VerbsApi> verbs);

// A TCP transport whatever RECCL_TRANSPORT says (the CPU engine's transport).
std::unique_ptr<Transport> makeTcpTransport(const Config& config);

}  // namespace reccl
