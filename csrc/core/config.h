// RECCL_* settings. Every variable has a default, a meaning and a valid range;
// an unknown RECCL_* name or a bad value is a ConfigError naming what is valid.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace reccl {

struct Config {
  std::vector<std::string> nics;   // RECCL_NICS; empty = auto-detect
  int heartbeatMs = 1000;          // RECCL_HEARTBEAT_MS: silence that fails a path
  int noPathTimeoutMs = 10000;     // RECCL_NO_PATH_TIMEOUT_MS: no path -> ops fail
  int connectTimeoutMs = 5000;     // RECCL_CONNECT_TIMEOUT_MS: one dial attempt
  int socketsPerPath = 4;          // RECCL_NSOCKS: data sockets per path
  int ioThreads = 0;               // RECCL_IO_THREADS: I/O threads per NIC; 0 = by cores
  int64_t chunkBytes = 1 << 20;    // RECCL_CHUNK_BYTES: unit of striping and resync
  bool failback = true;            // RECCL_FAILBACK
  bool backup = true;              // RECCL_BACKUP: 0 = no backup path (baseline runs)
  std::string debug = "WARN";      // RECCL_DEBUG: NONE | WARN | INFO | TRACE
  // The CPU engine (defaults of a process group's options; pg_options override them).
  int channels = 0;                // RECCL_CHANNELS: connections per peer pair; 0 = one per NIC
  int window = 4;                  // RECCL_WINDOW: chunks a channel receives ahead
  // The control plane and DCR.
  bool dcr = true;                 // RECCL_DCR: rebalance channels away from backup NICs
  int dcrPeriodMs = 1000;          // RECCL_DCR_PERIOD_MS: republish period while degraded
  int dcrOffset = 0;               // RECCL_DCR_OFFSET: ops after the agreement a new plan starts
  int64_t smallBytes = 65536;      // RECCL_SMALL_BYTES: recursive doubling up to this size
  std::string hostId;              // RECCL_HOST_ID; empty = this kernel and network namespace
  std::string transport = "tcp";   // RECCL_TRANSPORT: tcp | auto | ib (the NCCL plugin's)
  std::vector<std::string> ibDevices;  // RECCL_IB_HCA; empty = every RDMA device
  std::string ibBootstrap;         // RECCL_IB_BOOTSTRAP; empty = the first RECCL_NICS NIC
  int ibTimeout = 20;              // RECCL_IB_TIMEOUT: ACK timeout 4.096 us * 2^n per try
  int ibRetryCount = 7;            // RECCL_IB_RETRY_CNT: retries before a QP errors out
  bool ibZeroCopy = true;          // RECCL_IB_ZERO_COPY: registered buffers placed directly
  // NVL: the NCCL plugin's transit through the GPU next to the NIC carrying the data.
  std::string nvl = "off";         // RECCL_NVL: off | on (docs/nvl.md)
  int64_t nvlMaxBytes = 32 << 20;  // RECCL_NVL_MAX_BYTES: transit memory per connection
  std::vector<int> nicGpus;        // RECCL_NIC_GPUS: GPU next to each NIC; empty = PCI paths

  // Reads every RECCL_* variable from `env` (name -> value).
  static Config fromEnv(const std::map<std::string, std::string>& env);
  // Reads the process environment.
  static Config fromProcessEnv();
  // Sets the process log level from `debug`.
  void applyLogLevel() const;
};

// The documented variables: name, default, meaning. Used by error messages and
// by the Python docs helper.
struct ConfigVar {
  const char* name;
  const char* defaultValue;
  const char* meaning;
};
const std::vector<ConfigVar>& configVars();

}  // namespace reccl
