#include "transport/make_transport.h"

#include "core/error.h"
#include "core/log.h"
#include "core/topology.h"
#include "transport/descriptor_table.h"
#include "transport/ib/ib_transport.h"
#include "transport/ib/verbs_library.h"
#include "transport/tcp/tcp_transport.h"

namespace reccl {

TransportChoice chooseTransport(const Config& config, std::shared_ptr<VerbsApi> verbs) {
  if (config.transport == TransportMode::kTcp) return {"tcp", "RECCL_TRANSPORT=tcp", nullptr};
  const bool required = config.transport == TransportMode::kIb;
  std::string error;
  if (!verbs) verbs = loadSystemVerbs(&error);
  if (!verbs) {
    if (required)
      throw ConfigError("RECCL_TRANSPORT=ib, but the verbs library is unusable: " + error);
    return {"tcp", "RECCL_TRANSPORT=auto and no verbs library (" + error + ")", nullptr};
  }
  std::vector<std::string> devices = verbs->deviceNames();
  if (devices.empty()) {
    if (required) {
      throw ConfigError("RECCL_TRANSPORT=ib, but " + verbs->describe() +
                        " lists no RDMA devices (/sys/class/infiniband is empty: no HCA driver "
                        "or soft-RoCE loaded); use RECCL_TRANSPORT=tcp or auto");
    }
    return {"tcp", "RECCL_TRANSPORT=auto and " + verbs->describe() + " lists no RDMA devices",
            nullptr};
  }
  std::string names;
  for (const auto& name : devices) names += (names.empty() ? "" : ",") + name;
  return {"ib",
          "RECCL_TRANSPORT=" + transportName(config.transport) + " and " + verbs->describe() +
              " lists " + names,
          std::move(verbs)};
}

std::string ibBootstrapAddress(const Config& config) {
  std::vector<std::string> selection =
      config.ibBootstrap.empty() ? config.nics : std::vector<std::string>{config.ibBootstrap};
  const std::string what =
      "the IB bootstrap address (RECCL_IB_BOOTSTRAP, else the first RECCL_NICS NIC): ";
  std::vector<NicInfo> found;
  try {
    found = discoverNics(selection);
  } catch (const ConfigError& error) {
    throw ConfigError(what + error.what());  // it names the available interfaces
  }
  if (found.empty()) throw ConfigError(what + "no local IPv4 address found");
  return found.front().address;
}

std::unique_ptr<Transport> makeTransport(const Config& config, std::shared_ptr<VerbsApi> verbs) {
  reserveDescriptorTable();  // before the transport's sockets need the room
  TransportChoice choice = chooseTransport(config, std::move(verbs));
  RECCL_LOG(kInfo, "transport " + choice.kind + ": " + choice.reason);
  if (choice.kind == "tcp") return makeTcpTransport(config);
  return std::make_unique<IbTransport>(config, std::move(choice.verbs), ibBootstrapAddress(config));
}

std::unique_ptr<Transport> makeTcpTransport(const Config& config) {
  return std::make_unique<TcpTransport>(config);
}

}  // namespace reccl
