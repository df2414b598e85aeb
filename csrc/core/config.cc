#include "core/config.h"

#include <cctype>
#include <cstdlib>

#include "core/error.h"
#include "core/log.h"

extern char** environ;

namespace reccl {

const std::vector<ConfigVar>& configVars() {
  static const std::vector<ConfigVar> kVars = {
      {"RECCL_NICS", "(all up non-loopback IPv4 interfaces)",
       "comma list of interface names or local IPv4 addresses; order is the rail order"},
      {"RECCL_HEARTBEAT_MS", "1000",
       "silence on a path (ms) after which it is declared dead; 10..60000"},
      {"RECCL_NO_PATH_TIMEOUT_MS", "10000",
       "how long a connection with no usable path waits for one before its operations fail; 100..600000"},
      {"RECCL_CONNECT_TIMEOUT_MS", "5000", "bound on one dial attempt (ms); 100..120000"},
      {"RECCL_NSOCKS", "4", "data sockets per path; 1..16"},
      {"RECCL_IO_THREADS", "0",
       "TCP transport: I/O threads per NIC in use, in one pool serving every path of the process; "
       "0..64 (0: 2 on hosts with 8 or more cores, else 1)"},
      {"RECCL_CHUNK_BYTES", "1048576",
       "striping and resync unit in bytes; 4096..67108864"},
      {"RECCL_FAILBACK", "1", "return to the primary path when it heals; 0 or 1"},
      {"RECCL_BACKUP", "1", "open a backup path per connection; 0 or 1 (0 disables failover)"},
      {"RECCL_DEBUG", "WARN", "log level: NONE, WARN, INFO or TRACE"},
      {"RECCL_CHANNELS", "0",
       "CPU engine: connections per peer pair and direction, channel c on NIC c % NICs; "
       "0..64 (0: one per NIC)"},
      {"RECCL_WINDOW", "4", "CPU engine: chunks each channel receives ahead; 1..64"},
      {"RECCL_DCR", "1",
       "CPU engine: move data off channels whose path runs over a backup NIC; 0 or 1"},
      {"RECCL_DCR_PERIOD_MS", "1000",
       "job-wide fault picture: while a rank is degraded it republishes its fault state this "
       "often (ms); nothing is published while it is healthy; 10..60000"},
      {"RECCL_DCR_OFFSET", "0",
       "CPU engine: a new channel plan starts this many collectives after the one at which the "
       "ranks agreed on the fault state (0: that same collective); 0..1000000"},
      {"RECCL_SMALL_BYTES", "65536",
       "CPU engine: a collective whose largest message is at most this many bytes runs by "
       "recursive doubling (log2 N steps); larger ones by rings; 0..4194304"},
      {"RECCL_HOST_ID", "(this kernel's boot id and network namespace)",
       "CPU engine: which host this rank is on; ranks with equal values share a host, and groups "
       "whose hosts hold several ranks use the two-level layout (docs/collectives.md); any "
       "non-empty string, the same on every rank of a host (emulates hosts on one machine)"},
      {"RECCL_TRANSPORT", "tcp",
       "NCCL net plugin: tcp, auto or ib; auto = ib when libibverbs loads and lists RDMA "
       "devices, else tcp (ib is verified only against the verbs emulation so far)"},
      {"RECCL_IB_HCA", "(every RDMA device)",
       "IB transport: comma list of RDMA device names; order is the rail order"},
      {"RECCL_IB_BOOTSTRAP", "(the first RECCL_NICS NIC)",
       "IB transport: interface name or local IPv4 address of the TCP bootstrap sockets that "
       "set up queue pairs"},
      {"RECCL_IB_TIMEOUT", "20",
       "IB transport: QP ACK timeout exponent, 4.096 us * 2^n per try; 1..31"},
      {"RECCL_IB_RETRY_CNT", "7",
       "IB transport: QP retries before a request fails with retry-exceeded; 0..7"},
      {"RECCL_IB_ZERO_COPY", "on",
       "IB transport: on or off. on: registered buffers (the NCCL plugin's regMr/regMrDmaBuf) "
       "are written straight into the peer's registered buffer (no CPU copy); off: nothing is "
       "registered, every byte is staged and copied at both ends, and dma-buf is unsupported"},
      {"RECCL_NVL", "off",
       "NCCL plugin: off or on. on: NCCL hands the plugin its GPU buffers (cuMem allocations), "
       "which the plugin stages to host memory in its own CUDA contexts, and a message whose "
       "active NIC sits next to another GPU crosses NVLink to that GPU first (docs/nvl.md)"},
      {"RECCL_NVL_MAX_BYTES", "33554432",
       "NVL: transit GPU memory per registered GPU buffer and transit GPU in bytes (larger "
       "messages go in pieces); 1048576..1073741824"},
      {"RECCL_NIC_GPUS", "(from PCI paths)",
       "NVL: comma list of CUDA device indices, the GPU next to each NIC in rail order, for "
       "NICs without a PCI path (emulated fabrics)"},
  };
  return kVars;
}

namespace {

std::string validNames() {
  std::string out;
  for (const auto& var : configVars()) {
    if (!out.empty()) out += ", ";
    out += var.name;
  }
  return out;
}

int64_t parseInt(const std::string& name, const std::string& value, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  // strtoll skips leading blanks; accept exactly what we print: digits, maybe a sign.
  bool clean = !value.empty() && (std::isdigit(static_cast<unsigned char>(value[0])) || value[0] == '-');
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  if (!clean || errno != 0 || *end != '\0' || parsed < lo || parsed > hi) {
    throw ConfigError(name + "=" + value + " is not valid: expected an integer in " +
                      std::to_string(lo) + ".." + std::to_string(hi));
  }
  return parsed;
}

bool parseBool(const std::string& name, const std::string& value) {
  if (value == "1") return true;
  if (value == "0") return false;
  throw ConfigError(name + "=" + value + " is not valid: expected 0 or 1");
}

std::vector<std::string> splitList(const std::string& name, const std::string& value) {
  // No iostreams here: this runs inside NCCL's dlopen of the library too.
  std::vector<std::string> items;
  size_t start = 0;
  for (;;) {
    size_t comma = value.find(',', start);
    std::string item = value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (item.empty()) {
      throw ConfigError(name + "=" + value + " is not valid: expected a comma list without empty entries");
    }
    items.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return items;
}

}  // namespace

Config Config::fromEnv(const std::map<std::string, std::string>& env) {
  Config config;
  for (const auto& [name, value] : env) {
    if (name.rfind("RECCL_", 0) != 0) continue;
    if (name == "RECCL_NICS") {
      config.nics = splitList(name, value);
    } else if (name == "RECCL_HEARTBEAT_MS") {
      config.heartbeatMs = static_cast<int>(parseInt(name, value, 10, 60000));
    } else if (name == "RECCL_NO_PATH_TIMEOUT_MS") {
      config.noPathTimeoutMs = static_cast<int>(parseInt(name, value, 100, 600000));
    } else if (name == "RECCL_CONNECT_TIMEOUT_MS") {
      config.connectTimeoutMs = static_cast<int>(parseInt(name, value, 100, 120000));
    } else if (name == "RECCL_NSOCKS") {
      config.socketsPerPath = static_cast<int>(parseInt(name, value, 1, 16));
    } else if (name == "RECCL_IO_THREADS") {
      config.ioThreads = static_cast<int>(parseInt(name, value, 0, 64));
    } else if (name == "RECCL_CHUNK_BYTES") {
      config.chunkBytes = parseInt(name, value, 4096, 64 << 20);
    } else if (name == "RECCL_FAILBACK") {
      config.failback = parseBool(name, value);
    } else if (name == "RECCL_BACKUP") {
      config.backup = parseBool(name, value);
    } else if (name == "RECCL_CHANNELS") {
      config.channels = static_cast<int>(parseInt(name, value, 0, 64));
    } else if (name == "RECCL_WINDOW") {
      config.window = static_cast<int>(parseInt(name, value, 1, 64));
    } else if (name == "RECCL_DCR") {
      config.dcr = parseBool(name, value);
    } else if (name == "RECCL_DCR_PERIOD_MS") {
      config.dcrPeriodMs = static_cast<int>(parseInt(name, value, 10, 60000));
    } else if (name == "RECCL_DCR_OFFSET") {
      config.dcrOffset = static_cast<int>(parseInt(name, value, 0, 1000000));
    } else if (name == "RECCL_SMALL_BYTES") {
      config.smallBytes = parseInt(name, value, 0, 4 << 20);
    } else if (name == "RECCL_HOST_ID") {
      if (value.empty()) throw ConfigError(name + " is not valid: expected a non-empty string");
      config.hostId = value;
    } else if (name == "RECCL_TRANSPORT") {
      if (value != "auto" && value != "tcp" && value != "ib") {
        throw ConfigError(name + "=" + value + " is not valid: expected auto, tcp or ib");
      }
      config.transport = value;
    } else if (name == "RECCL_IB_BOOTSTRAP") {
      if (value.empty() || value.find(',') != std::string::npos) {
        throw ConfigError(name + "=" + value +
                          " is not valid: expected one interface name or local IPv4 address");
      }
      config.ibBootstrap = value;
    } else if (name == "RECCL_IB_HCA") {
      config.ibDevices = splitList(name, value);
    } else if (name == "RECCL_IB_TIMEOUT") {
      config.ibTimeout = static_cast<int>(parseInt(name, value, 1, 31));
    } else if (name == "RECCL_IB_RETRY_CNT") {
      config.ibRetryCount = static_cast<int>(parseInt(name, value, 0, 7));
    } else if (name == "RECCL_IB_ZERO_COPY") {
      if (value != "on" && value != "off") {
        throw ConfigError(name + "=" + value + " is not valid: expected on or off");
      }
      config.ibZeroCopy = value == "on";
    } else if (name == "RECCL_NVL") {
      if (value != "off" && value != "on") {
        throw ConfigError(name + "=" + value + " is not valid: expected off or on");
      }
      config.nvl = value;
    } else if (name == "RECCL_NVL_MAX_BYTES") {
      config.nvlMaxBytes = parseInt(name, value, 1 << 20, 1 << 30);
    } else if (name == "RECCL_NIC_GPUS") {
      config.nicGpus.clear();
      for (const auto& item : splitList(name, value)) {
        config.nicGpus.push_back(static_cast<int>(parseInt(name + " entry", item, 0, 1023)));
      }
    } else if (name == "RECCL_DEBUG") {
      if (value != "NONE" && value != "WARN" && value != "INFO" && value != "TRACE") {
        throw ConfigError(name + "=" + value +
                          " is not valid: expected NONE, WARN, INFO or TRACE");
      }
      config.debug = value;
    } else {
      throw ConfigError("unknown setting " + name + "; valid RECCL_* variables are: " +
                        validNames());
    }
  }
  return config;
}

Config Config::fromProcessEnv() {
  std::map<std::string, std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string pair(*entry);
    auto eq = pair.find('=');
    if (eq == std::string::npos) continue;
    env[pair.substr(0, eq)] = pair.substr(eq + 1);
  }
  return fromEnv(env);
}

void Config::applyLogLevel() const {
  static const std::map<std::string, LogLevel> kLevels = {
      {"NONE", LogLevel::kNone}, {"WARN", LogLevel::kWarn},
      {"INFO", LogLevel::kInfo}, {"TRACE", LogLevel::kTrace}};
  setLogLevel(kLevels.at(debug));
}

}  // namespace reccl
