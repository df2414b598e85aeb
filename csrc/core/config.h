// RECCL_* settings. Each one is declared once, in the table behind settings()
// (config.cc): name, type, default, valid range or choices, one-line doc, and
// the process-group option that overrides it. The parser, the defaults of
// Config, the engine's option checks, Python's backend.Options and
// docs/configuration.md all read that table. An unknown RECCL_* name or a bad
// value is a ConfigError naming what is valid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/log.h"

namespace reccl {

// The choices of RECCL_ALGO and RECCL_TRANSPORT, in the order the settings table lists
// them ("auto|ring|halving", "auto|tcp|ib"): the parser stores the position of the value.
enum class Algo { kAuto, kRing, kHalving };
enum class TransportMode { kAuto, kTcp, kIb };
// The setting's value as written: "halving", "ib".
std::string algoName(Algo algo);
std::string transportName(TransportMode mode);

// The fields have no initializers: Config() sets each from its setting's default.
struct Config {
  std::vector<std::string> nics;   // RECCL_NICS; empty = auto-detect
  int heartbeatMs;                 // RECCL_HEARTBEAT_MS: silence that fails a path
  int noPathTimeoutMs;             // RECCL_NO_PATH_TIMEOUT_MS: no path this long -> ops fail
  int peerGoneTimeoutMs;  // RECCL_PEER_GONE_TIMEOUT_MS: the same when the peer process is gone
  int connectTimeoutMs;  // RECCL_CONNECT_TIMEOUT_MS: one dial attempt
  int socketsPerPath;  // RECCL_NSOCKS: data sockets per path; 0 = the user's default
  int ioThreads;  // RECCL_IO_THREADS: I/O threads per NIC; 0 = by cores
  int64_t chunkBytes;  // RECCL_CHUNK_BYTES: unit of striping and resync
  bool failback;  // RECCL_FAILBACK
  bool backup;  // RECCL_BACKUP: false = no backup path (baseline runs)
  bool sameHostReads;  // RECCL_SAME_HOST_READS: same-host paths read payloads from the sender's
                       // memory
  bool spread;  // RECCL_SPREAD: stripe over surviving NICs while the primary is down
  LogLevel debug;  // RECCL_DEBUG: NONE | WARN | INFO | TRACE
  // The CPU engine (defaults of a process group's options; pg_options override them).
  int channels;  // RECCL_CHANNELS: connections per peer pair; 0 = one per NIC
  int window;  // RECCL_WINDOW: chunks a channel receives ahead
  // The control plane and DCR.
  bool dcr;  // RECCL_DCR: rebalance channels away from backup NICs
  int dcrPeriodMs;  // RECCL_DCR_PERIOD_MS: republish period while degraded
  int dcrOffset;  // RECCL_DCR_OFFSET: ops after the agreement a new plan starts
  bool shares;  // RECCL_SHARES: all_reduce shards sized by each host's usable NICs
  int64_t smallBytes;  // RECCL_SMALL_BYTES: recursive doubling up to this size
  int64_t halvingBytesPerRank;  // RECCL_HALVING_BYTES_PER_RANK: auto's halving/ring crossover
  Algo algo;  // RECCL_ALGO: large all_reduce, reduce_scatter, all_gather
  // Grey failures (core/grey_detector.h): a NIC up but far slower than its peers.
  bool grey;  // RECCL_GREY
  int greyPct;  // RECCL_GREY_PCT: below this % of the peer median: slow
  int greyRecoverPct;  // RECCL_GREY_RECOVER_PCT: at or above: recovered
  int greyMs;  // RECCL_GREY_MS: busy time a verdict must hold for
  int64_t greyMinBytes;  // RECCL_GREY_MIN_BYTES: load that makes a window count
  int greyRetryMs;  // RECCL_GREY_RETRY_MS: degraded -> on trial after this
  std::string hostId;  // RECCL_HOST_ID; empty = this kernel and network namespace
  TransportMode transport;  // RECCL_TRANSPORT (the NCCL plugin's)
  std::vector<std::string> ibDevices;  // RECCL_IB_HCA; empty = every RDMA device
  std::string ibBootstrap;  // RECCL_IB_BOOTSTRAP; empty = the first RECCL_NICS NIC
  int ibTimeout;  // RECCL_IB_TIMEOUT: ACK timeout 4.096 us * 2^n per try
  int ibRetryCount;  // RECCL_IB_RETRY_CNT: retries before a QP errors out
  int ibTrafficClass;  // RECCL_IB_TC: GRH traffic class of every QP
  int ibServiceLevel;  // RECCL_IB_SL: service level of every QP
  int ibFenceDelayMs;  // RECCL_IB_FENCE_DELAY_MS: wait after a QP's ERR before a RESYNC
  int ibBusyPollUs;  // RECCL_IB_BUSY_POLL_US: poll the CQs this long past the last completion while
                     // work is outstanding; 0 = off
  int ibGidIndex;  // RECCL_IB_GID_INDEX: -1 = chosen per dial from the table
  std::string ibAddressRange;  // RECCL_IB_ADDR_RANGE: CIDR the RoCE GID must be in; empty = IPv4
  bool ibRelaxedOrdering;  // RECCL_IB_RELAXED_ORDERING: auto = where the library has it
  bool ibZeroCopy;  // RECCL_IB_ZERO_COPY: registered buffers placed directly
  // NVL: the NCCL plugin's transit through the GPU next to the NIC carrying the data.
  bool nvl;  // RECCL_NVL: on (docs/nvl.md)
  int64_t nvlMaxBytes;  // RECCL_NVL_MAX_BYTES: transit memory per connection
  std::vector<int> nicGpus;  // RECCL_NIC_GPUS: GPU next to each NIC; empty = PCI paths
  std::vector<std::string> nvlinkPeers;  // RECCL_NVLINK_PEERS: NVML's NVLink pairs; empty = unknown

  // Every setting at its default.
  Config();
  // Reads every RECCL_* variable from `env` (name -> value).
  static Config fromEnv(const std::map<std::string, std::string>& env);
  // Reads the process environment.
  static Config fromProcessEnv();
  // Sets the process log level to `debug`.
  void applyLogLevel() const;
};

enum class SettingType {
  kInt,  // an integer in lo..hi
  kBool,  // 0 or 1
  kChoice,  // one of `choices`
  kList,  // a comma list of non-empty names
  kIntList,  // a comma list of integers, each in lo..hi
  kAddress,  // one interface name or local IPv4 address (no commas)
  kText,  // any non-empty string
  kAddressRange,  // an IPv4 or IPv6 network in CIDR form (core/address_range.h)
};

// The value of a setting once checked against its spec, in the field its type fills.
struct SettingValue {
  int64_t number = 0;  // kInt; kBool (0 or 1)
  std::string text;  // kChoice, kAddress, kText
  std::vector<std::string> items;  // kList
  std::vector<int64_t> numbers;  // kIntList
};

struct SettingSpec {
  const char* name;  // the environment variable
  SettingType type;
  const char* defaultValue;  // text the parser accepts; nullptr: found at run time
  const char* defaultDoc;  // what a run-time default is (nullptr with a defaultValue)
  int64_t lo, hi;  // kInt, kIntList
  const char* choices;  // kChoice: "a|b|c"
  const char* option;  // the process-group option overriding it (backend.Options), or nullptr
  const char* doc;  // one line for docs/configuration.md
  void (*store)(Config&, SettingValue&&);  // puts a checked value into its Config field
};

// The table, in documentation order.
struct SettingTable {
  const SettingSpec* first;
  size_t count;
  const SettingSpec* begin() const { return first; }
  const SettingSpec* end() const { return first + count; }
};
SettingTable settings();

// What the setting accepts, in words: "4096..67108864", "0 or 1", "NONE, WARN, INFO or TRACE".
std::string describeValid(const SettingSpec& spec);

// Checks `value` against `spec`; ConfigError "<label>=<value> is not valid: expected ...".
SettingValue parseSetting(const SettingSpec& spec, const std::string& value,
                          const std::string& label);

// The setting behind process-group option `option` (channels, chunk_bytes, window);
// ConfigError naming the options there are.
const SettingSpec& optionSpec(const std::string& option);
// ConfigError "<option>=<value> is not valid: expected an integer in lo..hi" unless
// `value` (as text, so Python's unbounded ints check like environment values) is.
void checkOption(const std::string& option, const std::string& value);

}  // namespace reccl
