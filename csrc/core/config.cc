#include "core/config.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <type_traits>

#include "core/address_range.h"
#include "core/error.h"
#include "core/frame.h"
#include "core/log.h"
#include "core/topology.h"

extern char** environ;

namespace reccl {

namespace {

using Store = void (*)(Config&, SettingValue&&);

template <auto Field>
void storeNumber(Config& config, SettingValue&& value) {
  using T = std::remove_reference_t<decltype(config.*Field)>;
  config.*Field = static_cast<T>(value.number);
}

template <auto Field>
void storeFlag(Config& config, SettingValue&& value) {
  config.*Field = value.number != 0;
}

template <auto Field>
void storeText(Config& config, SettingValue&& value) {
  config.*Field = std::move(value.text);
}

template <auto Field>
void storeItems(Config& config, SettingValue&& value) {
  config.*Field = std::move(value.items);
}

template <auto Field>
void storeNumbers(Config& config, SettingValue&& value) {
  (config.*Field).assign(value.numbers.begin(), value.numbers.end());
}

// An off|on choice.
template <auto Field>
void storeOn(Config& config, SettingValue&& value) {
  config.*Field = value.text == "on";
}

// RECCL_SHARES: proportional (true) or equal.
void storeShares(Config& config, SettingValue&& value) {
  config.shares = value.text == "proportional";
}

constexpr char kAlgoChoices[] = "auto|ring|halving";
constexpr char kTransportChoices[] = "auto|tcp|ib";
// LogLevel's values in order: the parser stores the position of the value.
constexpr char kDebugChoices[] = "NONE|WARN|INFO|TRACE";
static_assert(static_cast<int>(LogLevel::kNone) == 0 && static_cast<int>(LogLevel::kWarn) == 1 &&
                  static_cast<int>(LogLevel::kInfo) == 2 && static_cast<int>(LogLevel::kTrace) == 3,
              "RECCL_DEBUG's choices follow LogLevel");

// The position of `text` in `choices` ("a|b|c"), which the parser has checked it is one of.
int choiceIndex(const std::string& choices, const std::string& text) {
  int index = 0;
  for (size_t start = 0;; ++index) {
    const size_t end = choices.find('|', start);
    if (choices.compare(start, end == std::string::npos ? std::string::npos : end - start, text) ==
        0)
      return index;
    if (end == std::string::npos) throw ConfigError(text + " is not one of " + choices);
    start = end + 1;
  }
}

std::string choiceName(const std::string& choices, int index) {
  size_t start = 0;
  for (int i = 0; i < index; ++i) start = choices.find('|', start) + 1;
  return choices.substr(start, choices.find('|', start) - start);
}

// A choice stored as the enum whose values follow `Choices`' order.
template <auto Field, const char* Choices>
void storeChoice(Config& config, SettingValue&& value) {
  using T = std::remove_reference_t<decltype(config.*Field)>;
  config.*Field = static_cast<T>(choiceIndex(Choices, value.text));
}

void storeRelaxedOrdering(Config& config, SettingValue&& value) {
  config.ibRelaxedOrdering = value.text == "auto";
}

void storeNvlinkPeers(Config& config, SettingValue&& value) {
  NvlinkPairs::parse(value.items);  // a malformed pair is an error here, not at plugin init
  config.nvlinkPeers = std::move(value.items);
}

constexpr SettingSpec integer(const char* name, const char* defaultValue, int64_t lo, int64_t hi,
                              Store store, const char* doc, const char* option = nullptr) {
  return {name, SettingType::kInt, defaultValue, nullptr, lo, hi, nullptr, option, doc, store};
}

constexpr SettingSpec flag(const char* name, const char* defaultValue, Store store,
                           const char* doc) {
  return {name, SettingType::kBool, defaultValue, nullptr, 0, 1, nullptr, nullptr, doc, store};
}

constexpr SettingSpec choice(const char* name, const char* defaultValue, const char* choices,
                             Store store, const char* doc) {
  return {name, SettingType::kChoice, defaultValue, nullptr, 0, 0, choices, nullptr, doc, store};
}

// A setting whose default is found at run time (`defaultDoc` says how); its field stays empty.
constexpr SettingSpec found(const char* name, SettingType type, const char* defaultDoc, Store store,
                            const char* doc, int64_t lo = 0, int64_t hi = 0) {
  return {name, type, nullptr, defaultDoc, lo, hi, nullptr, nullptr, doc, store};
}

constexpr SettingSpec kSettings[] = {
    found("RECCL_NICS", SettingType::kList, "all up, non-loopback IPv4 interfaces",
          storeItems<&Config::nics>,
          "comma list of interface names or local IPv4 addresses; the order is the rail order. "
          "Addresses in 127.0.0.0/8 may be listed to play several NICs on one host"),
    integer("RECCL_HEARTBEAT_MS", "1000", 10, 60000, storeNumber<&Config::heartbeatMs>,
            "silence (ms) between two NICs, while this process runs, after which every path "
            "between them is declared dead (catches silent drops); one beat per NIC pair every "
            "quarter of it when nothing else crosses"),
    integer("RECCL_NO_PATH_TIMEOUT_MS", "120000", 100, 3600000,
            storeNumber<&Config::noPathTimeoutMs>,
            "how long a connection with no usable path waits for one (ms): its requests stay "
            "pending and resume bit for bit when a path returns, so a host may lose every NIC, or "
            "two hosts every common rail, this long (a ToR reload, a link-maintenance window); "
            "then its operations fail with an error naming every path and why it is down. One "
            "setting for every process group and the NCCL plugin; a group's `timeout=` still "
            "bounds each of its operations (docs/transport.md, \"No path left\")"),
    integer("RECCL_PEER_GONE_TIMEOUT_MS", "10000", 100, 3600000,
            storeNumber<&Config::peerGoneTimeoutMs>,
            "how long a connection with no usable path waits when the peer's host answers for the "
            "peer but nothing is there: every failure since traffic last moved is a refused dial "
            "(nothing listens on the peer's port) or a path ended by an end of stream or a reset, "
            "i.e. the peer process died on a live host (ms); at most RECCL_NO_PATH_TIMEOUT_MS"),
    integer("RECCL_CONNECT_TIMEOUT_MS", "5000", 100, 120000, storeNumber<&Config::connectTimeoutMs>,
            "bound on one dial attempt and on a handshake (ms)"),
    integer("RECCL_NSOCKS", "0", 0, 16, storeNumber<&Config::socketsPerPath>,
            "data sockets per path; 0 = 2 in the NCCL plugin, where NCCL runs two or more "
            "channels per NIC, and 4 in the CPU engine, one channel per NIC. A path starts with "
            "one and grows to this many under bulk data; each is a TCP flow into its NIC's queue, "
            "and flows beyond what fills the NIC only add losses there (docs/transport.md)"),
    integer(
        "RECCL_IO_THREADS", "0", 0, 64, storeNumber<&Config::ioThreads>,
        "TCP transport: I/O threads per NIC in use, each an epoll loop in one process-wide pool "
        "serving every path's sockets (the CPU engine's and the NCCL plugin's alike), so threads "
        "do not grow with connections; 0 = 2 on hosts with 8 or more cores, else 1 "
        "(docs/transport.md)"),
    // The bound is the wire's (a data frame carries at most one chunk); the CPU
    // engine's pipelining unit shares it, so one setting has one range.
    integer("RECCL_CHUNK_BYTES", "1048576", 4096, kMaxChunkBytes, storeNumber<&Config::chunkBytes>,
            "unit of striping over sockets and of resync; also the CPU engine's pipelining unit "
            "of the rings",
            "chunk_bytes"),
    flag("RECCL_FAILBACK", "1", storeFlag<&Config::failback>,
         "return to the primary path when it heals"),
    flag("RECCL_BACKUP", "1", storeFlag<&Config::backup>,
         "open a backup path per connection; 0 disables failover (baseline runs)"),
    flag("RECCL_SAME_HOST_READS", "1", storeFlag<&Config::sameHostReads>,
         "CPU engine: a TCP path between two processes of one host (same kernel, network and "
         "pid namespace) carries payloads of 16 KiB or more by reference: the receiver copies "
         "them straight from the sender's memory (process_vm_readv), one copy instead of two "
         "through loopback TCP; headers, acknowledgements, heartbeats and failover stay on the "
         "path's sockets. Taken per path at its handshake, only where the receiver can read the "
         "sender (Yama ptrace_scope 1 or a seccomp profile may forbid it: the path then stays "
         "plain TCP). The NCCL plugin never uses it. 0: every byte through the sockets "
         "(docs/transport.md, \"Same-host reads\")"),
    choice("RECCL_SPREAD", "on", "on|off", storeOn<&Config::spread>,
           "on: a connection whose primary path is down spreads its chunks over one path per "
           "surviving NIC (the backup and the last-resort rails), weighted by each path's measured "
           "goodput, instead of loading the backup NIC alone; failback returns it to the primary. "
           "off: everything moves to the backup path (docs/transport.md, \"Spreading\")"),
    choice("RECCL_DEBUG", "WARN", kDebugChoices, storeChoice<&Config::debug, kDebugChoices>,
           "log level on stderr"),
    integer("RECCL_CHANNELS", "0", 0, 64, storeNumber<&Config::channels>,
            "CPU engine: connections per peer pair and direction, channel `c` pinned to NIC "
            "`c % NICs`; 0 = one per NIC",
            "channels"),
    integer("RECCL_WINDOW", "4", 1, 64, storeNumber<&Config::window>,
            "CPU engine: chunks each channel receives ahead", "window"),
    flag("RECCL_DCR", "1", storeFlag<&Config::dcr>,
         "CPU engine: DCR, move a collective's data off every channel whose path runs over a "
         "backup NIC on any rank (rank 0's setting decides for its group)"),
    integer("RECCL_DCR_PERIOD_MS", "1000", 10, 60000, storeNumber<&Config::dcrPeriodMs>,
            "job-wide fault picture: while a rank has a NIC down it republishes its fault state "
            "(NICs down, NCCL collectives issued) to the job's store this often (ms); nothing is "
            "published while it is healthy (docs/collectives.md, \"Fault picture\")"),
    integer("RECCL_DCR_OFFSET", "0", 0, 1000000, storeNumber<&Config::dcrOffset>,
            "CPU engine: a new channel plan starts this many collectives after the one at which "
            "the ranks agreed on the fault state (0: that same collective)"),
    choice("RECCL_SHARES", "proportional", "equal|proportional", storeShares,
           "CPU engine: proportional: while a host has NICs down or degraded, a large all_reduce "
           "gives each rank a share sized by its host's usable NICs, by direct transfers, so the "
           "other hosts absorb work the degraded one cannot carry (needs RECCL_SPREAD=on and one "
           "rank per host, else equal; docs/benchmarks.md, \"One degraded host among many\"). "
           "equal: every rank an equal share of a collective, DCR moves data off the failed "
           "channels. Either way results stay bit-identical to the "
           "fault-free run (docs/collectives.md, \"Shares sized by usable bandwidth\")"),
    flag("RECCL_GREY", "1", storeFlag<&Config::grey>,
         "grey-failure detection: a NIC that is up but far slower than its peers under load is "
         "marked degraded and traffic moves off it as if it were down (docs/grey_failures.md)"),
    integer("RECCL_GREY_PCT", "25", 1, 50, storeNumber<&Config::greyPct>,
            "a NIC whose goodput while busy stays below this percent of the median of its "
            "loaded peer NICs (or of its own history, with no loaded peer) is degraded"),
    integer("RECCL_GREY_RECOVER_PCT", "50", 50, 100, storeNumber<&Config::greyRecoverPct>,
            "a degraded NIC on trial is recovered once its goodput stays at or above this percent "
            "of the median (hysteresis: the ranges keep it at or above RECCL_GREY_PCT)"),
    integer("RECCL_GREY_MS", "2000", 100, 600000, storeNumber<&Config::greyMs>,
            "how long (ms of the NIC being busy) goodput must stay below (or, to recover, above) "
            "the threshold; windows without load do not count"),
    integer("RECCL_GREY_MIN_BYTES", "1048576", 1, int64_t{1} << 40,
            storeNumber<&Config::greyMinBytes>,
            "a NIC counts as loaded in a sample window (250 ms) only with at least this many "
            "bytes acknowledged; lighter windows are ignored, so small or bursty traffic never "
            "marks a NIC degraded"),
    integer("RECCL_GREY_RETRY_MS", "30000", 100, 3600000, storeNumber<&Config::greyRetryMs>,
            "a degraded NIC carries no traffic; after this long it is put on trial (traffic "
            "returns to it and is measured); a failed trial doubles the wait, up to 8 times this"),
    integer("RECCL_SMALL_BYTES", "65536", 0, 4 << 20, storeNumber<&Config::smallBytes>,
            "CPU engine: a collective whose largest message is at most this many bytes runs by "
            "recursive doubling (log2 N steps, its data riding with the per-op agreement); larger "
            "ones by rings and direct transfers; the same on every rank (docs/collectives.md)"),
    choice("RECCL_ALGO", "auto", kAlgoChoices, storeChoice<&Config::algo, kAlgoChoices>,
           "CPU engine: how an all_reduce, reduce_scatter or all_gather larger than "
           "RECCL_SMALL_BYTES moves its data. `auto` takes halving while the buffer is at most "
           "RECCL_HALVING_BYTES_PER_RANK x the group's ranks, the ring above; `ring` forces the "
           "ring (N-1 dependent steps per phase); `halving` "
           "forces recursive halving for the reduce-scatter phase and recursive doubling for the "
           "all-gather phase (log2 N steps per phase, the same bytes as the ring; all_reduce "
           "runs both: Rabenseifner's). Every channel and DCR plan runs either; the same on "
           "every rank (docs/collectives.md)"),
    integer("RECCL_HALVING_BYTES_PER_RANK", "1048576", 0, int64_t{1} << 30,
            storeNumber<&Config::halvingBytesPerRank>,
            "CPU engine, RECCL_ALGO=auto: an all_reduce, reduce_scatter or all_gather whose buffer "
            "(all_reduce's input, all_gather's output, reduce_scatter's input) is at most this "
            "many bytes times the group's ranks runs by recursive halving and doubling, a larger "
            "one by the ring: the ring's 2(N-1) dependent steps cost more than they save while "
            "each rank's share is small (measured on 16 cores at 4-32 ranks: docs/benchmarks.md, "
            "\"Halving against the ring\"). 0: always the ring. The same on every rank"),
    found("RECCL_HOST_ID", SettingType::kText, "this kernel's boot id and network namespace",
          storeText<&Config::hostId>,
          "CPU engine: which host this rank is on. Ranks with equal values share a host; by "
          "default processes that share a kernel and a network namespace do (so each of the "
          "fabric emulator's namespaces is a host). When a group has 2 or more hosts and some "
          "host holds 2 or more of its ranks it uses the two-level layout: rings visit a host's "
          "ranks one after another, and small collectives reduce within the host, run recursive "
          "doubling among the host leaders and hand back within the host (docs/collectives.md, "
          "\"Which algorithm runs\"). The same on every rank of a host; set it to emulate hosts "
          "on one machine, or to group ranks that the default splits"),
    choice("RECCL_TRANSPORT", "tcp", kTransportChoices,
           storeChoice<&Config::transport, kTransportChoices>,
           "NCCL net plugin: `auto` runs over IB verbs when `libibverbs.so.1` loads and lists RDMA "
           "devices, else over TCP; `ib` with no library or no devices is a `ConfigError` at the "
           "plugin's init saying which is missing. The default stays `tcp` until the IB transport "
           "has run on RDMA hardware (it is verified only against the in-process verbs "
           "emulation). The `\"reccl\"` process group always uses TCP (it ignores this setting). "
           "The plugin logs its choice (`RECCL_DEBUG=INFO`) and names the transport in its init "
           "message. See docs/ib.md"),
    found("RECCL_IB_HCA", SettingType::kList, "every RDMA device with an active port, by PCI path",
          storeItems<&Config::ibDevices>,
          "IB transport: comma list of RDMA device names (`mlx5_0,mlx5_1`); the order is the "
          "rail order, and named devices are used up or down. Unset: the devices the library "
          "lists whose port is active, ordered by PCI path (the same rails on identical hosts)"),
    found("RECCL_IB_BOOTSTRAP", SettingType::kAddress,
          "the first NIC `RECCL_NICS` selects, or the first up non-loopback IPv4 interface",
          storeText<&Config::ibBootstrap>,
          "IB transport: the interface for the TCP bootstrap sockets over which queue pairs are "
          "set up (the HELLO and QP exchange; no data)"),
    integer("RECCL_IB_TIMEOUT", "20", 1, 31, storeNumber<&Config::ibTimeout>,
            "IB transport: QP ACK timeout exponent, 4.096 us * 2^n per try (20 = 4.3 s, as "
            "`NCCL_IB_TIMEOUT`); a request unanswered for 2^n * 4.096 us * "
            "(`RECCL_IB_RETRY_CNT` + 1) fails its path with retry-exceeded"),
    integer("RECCL_IB_RETRY_CNT", "7", 0, 7, storeNumber<&Config::ibRetryCount>,
            "IB transport: QP retries before a request fails with retry-exceeded (as "
            "`NCCL_IB_RETRY_CNT`)"),
    integer("RECCL_IB_TC", "0", 0, 255, storeNumber<&Config::ibTrafficClass>,
            "IB transport: traffic class of every QP, in the GRH (on RoCE v2 the IP header's "
            "DSCP and ECN bits: DSCP * 4), as `NCCL_IB_TC`. A lossless (PFC) RoCE fabric "
            "carries RDMA in its own class: set that here (e.g. 106 for DSCP 26), or traffic "
            "goes in class 0 and may be dropped under congestion"),
    integer("RECCL_IB_SL", "0", 0, 15, storeNumber<&Config::ibServiceLevel>,
            "IB transport: service level of every QP (the address vector's SL: the virtual "
            "lane on InfiniBand, the priority the driver maps it to on RoCE), as `NCCL_IB_SL`"),
    integer("RECCL_IB_FENCE_DELAY_MS", "10", 0, 1000, storeNumber<&Config::ibFenceDelayMs>,
            "IB transport: after a receiver moves a failed path's QP to the error state it waits "
            "this long before it tells the sender which bytes arrived (RESYNC): writes the QP "
            "accepted just before may still be on their way to memory, and the sender re-sends "
            "what was not reported (as `NCCL_IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY`, 10 ms; "
            "docs/ib.md, \"Fence, then resync\")"),
    integer("RECCL_IB_BUSY_POLL_US", "0", 0, 10000, storeNumber<&Config::ibBusyPollUs>,
            "IB transport: while a path has work outstanding (data posted and not yet "
            "completed, data waiting for a grant or a credit, the connection's requests on its "
            "active path), and this long after, its event loop polls the completion queues "
            "instead of sleeping on the completion channel, as long as something completed "
            "within this many microseconds, as NCCL's proxy polls while requests are "
            "outstanding: no interrupt and wake-up per completion. Then, or when nothing is "
            "outstanding, the path re-arms the channel and sleeps (idle paths never poll). Loop "
            "threads are shared by paths, so a spin is one poll per loop turn, not a busy wait "
            "that holds other paths back; a turn with nothing new yields the core. 0 (the "
            "default until measured on RDMA hardware; on the emulation it costs more than it "
            "saves): off, every completion comes by a channel event. Try 50-200 where each I/O "
            "thread has a core to itself (docs/ib.md, \"Busy polling\")"),
    integer("RECCL_IB_GID_INDEX", "-1", -1, 255, storeNumber<&Config::ibGidIndex>,
            "IB transport: the source GID index of every QP, as `NCCL_IB_GID_INDEX`; -1 chooses "
            "per dial from the port's table as it is then (RoCE: the lowest-indexed RoCE v2 GID "
            "holding an IPv4 address, or one in `RECCL_IB_ADDR_RANGE`; never link-local, RoCE v1 "
            "or a GID of unknown type; chosen afresh after a link flap). A forced index must hold "
            "a GID on every device, or the dial fails naming the table (docs/ib.md)"),
    found("RECCL_IB_ADDR_RANGE", SettingType::kAddressRange,
          "IPv4-mapped RoCE v2 GIDs, any address", storeText<&Config::ibAddressRange>,
          "IB transport on RoCE: only a RoCE v2 GID whose address lies in this CIDR range is "
          "chosen (`10.0.0.0/16`, or an IPv6 range such as `fd00::/8` to use IPv6 GIDs), as "
          "`NCCL_IB_ADDR_RANGE`; a port without one fails its dials saying so"),
    choice("RECCL_IB_RELAXED_ORDERING", "auto", "auto|off", storeRelaxedOrdering,
           "IB transport: auto registers the buffers NCCL registers (`regMr`, dma-buf, GPU "
           "pointers) with `IBV_ACCESS_RELAXED_ORDERING` where libibverbs has "
           "`ibv_reg_mr_iova2` (rdma-core v29+; a device that cannot use it ignores the optional "
           "flag), as NCCL's default `NCCL_IB_PCI_RELAXED_ORDERING=2` does: PCIe relaxed ordering "
           "lets the NIC's writes pass each other, which matters for bandwidth on some CPUs and "
           "virtual machines. The transport's own rings and FIFOs never use it (their order is "
           "the protocol). off: never"),
    choice("RECCL_IB_ZERO_COPY", "on", "on|off", storeOn<&Config::ibZeroCopy>,
           "IB transport. on: buffers registered with the transport (the NCCL plugin's `regMr` / "
           "`regMrDmaBuf`) are RDMA-written straight into the peer's registered receive buffer, "
           "no CPU copy at either end (docs/ib.md, \"Direct placement\"); a message whose other "
           "end is unregistered is staged as before. off: nothing is registered, every byte is "
           "staged and copied at both ends, and dma-buf (GPUDirect) registration is unsupported"),
    choice("RECCL_NVL", "off", "off|on", storeOn<&Config::nvl>,
           "NCCL plugin. on: NCCL hands the plugin its GPU buffers (cuMem allocations, NCCL's "
           "default; set `NCCL_NET_GDR_LEVEL=SYS` where NICs have no PCI path), which the plugin "
           "stages to host memory in its own CUDA contexts, and a message whose active NIC sits "
           "next to another GPU crosses NVLink to that GPU first; off by default because staging "
           "costs small messages speed when no fault happens (docs/nvl.md)"),
    integer("RECCL_NVL_MAX_BYTES", "33554432", 1 << 20, 1 << 30, storeNumber<&Config::nvlMaxBytes>,
            "NVL: transit GPU memory per registered GPU buffer and transit GPU in bytes, allocated "
            "when NCCL registers the buffer, min(buffer size, this) (larger messages go in "
            "pieces); `stats()[\"nvl_transit_bytes\"]` shows what is held"),
    found("RECCL_NIC_GPUS", SettingType::kIntList, "from PCI paths", storeNumbers<&Config::nicGpus>,
          "NVL: CUDA device indices, the GPU next to each NIC in rail order, for NICs without a "
          "PCI path (loopback, veth, emulated fabrics)",
          0, 1023),
    found(
        "RECCL_NVLINK_PEERS", SettingType::kList,
        "set by `import torch_reccl` from NVML when RECCL_NVL=on and pynvml and the NVIDIA "
        "driver are present; else unknown: any GPU with CUDA peer access",
        storeNvlinkPeers,
        "NVL: the GPU pairs joined by NVLink, as PCI bus ids `0000:18:00.0-0000:2a:00.0` (comma "
        "list), or `none`; a transit GPU must be one of the buffer GPU's NVLink peers (a detour "
        "over PCIe peer access gains nothing). `reccl topo` shows what NVML reports (docs/nvl.md)"),
};

const SettingSpec* findSetting(const std::string& name) {
  for (const SettingSpec& spec : kSettings) {
    if (name == spec.name) return &spec;
  }
  return nullptr;
}

std::string validNames() {
  std::string out;
  for (const SettingSpec& spec : kSettings) {
    if (!out.empty()) out += ", ";
    out += spec.name;
  }
  return out;
}

std::vector<std::string> splitOn(const std::string& text, char separator) {
  std::vector<std::string> items;
  size_t start = 0;
  for (;;) {
    size_t at = text.find(separator, start);
    items.push_back(text.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return items;
    start = at + 1;
  }
}

[[noreturn]] void invalid(const SettingSpec& spec, const std::string& label,
                          const std::string& value) {
  throw ConfigError(label + "=" + value + " is not valid: expected " + describeValid(spec));
}

int64_t parseInt(const std::string& label, const std::string& value, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  // strtoll skips leading blanks; accept exactly what we print: digits, maybe a sign.
  bool clean =
      !value.empty() && (std::isdigit(static_cast<unsigned char>(value[0])) || value[0] == '-');
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  if (!clean || errno != 0 || *end != '\0' || parsed < lo || parsed > hi) {
    throw ConfigError(label + "=" + value + " is not valid: expected an integer in " +
                      std::to_string(lo) + ".." + std::to_string(hi));
  }
  return parsed;
}

}  // namespace

SettingTable settings() { return {kSettings, sizeof(kSettings) / sizeof(kSettings[0])}; }

std::string describeValid(const SettingSpec& spec) {
  const std::string range = std::to_string(spec.lo) + ".." + std::to_string(spec.hi);
  switch (spec.type) {
    case SettingType::kInt: return "an integer in " + range;
    case SettingType::kBool: return "0 or 1";
    case SettingType::kChoice: {
      std::vector<std::string> choices = splitOn(spec.choices, '|');
      std::string out;
      for (size_t i = 0; i < choices.size(); ++i) {
        out += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
      }
      return out;
    }
    case SettingType::kList: return "a comma list without empty entries";
    case SettingType::kIntList: return "a comma list of integers in " + range;
    case SettingType::kAddress: return "one interface name or local IPv4 address";
    case SettingType::kAddressRange:
      return "an IPv4 or IPv6 network in CIDR form (`10.0.0.0/16`, `fd00::/8`)";
    case SettingType::kText: break;
  }
  return "a non-empty string";
}

SettingValue parseSetting(const SettingSpec& spec, const std::string& value,
                          const std::string& label) {
  SettingValue out;
  switch (spec.type) {
    case SettingType::kInt: out.number = parseInt(label, value, spec.lo, spec.hi); break;
    case SettingType::kBool:
      if (value != "0" && value != "1") invalid(spec, label, value);
      out.number = value == "1";
      break;
    case SettingType::kChoice: {
      bool known = false;
      for (const std::string& choice : splitOn(spec.choices, '|')) known = known || choice == value;
      if (!known) invalid(spec, label, value);
      out.text = value;
      break;
    }
    case SettingType::kList:
    case SettingType::kIntList:
      // No iostreams here: this runs inside NCCL's dlopen of the library too.
      out.items = splitOn(value, ',');
      for (const std::string& item : out.items) {
        if (item.empty()) invalid(spec, label, value);
      }
      if (spec.type == SettingType::kIntList) {
        for (const std::string& item : out.items) {
          out.numbers.push_back(parseInt(label + " entry", item, spec.lo, spec.hi));
        }
        out.items.clear();
      }
      break;
    case SettingType::kAddress:
      if (value.empty() || value.find(',') != std::string::npos) invalid(spec, label, value);
      out.text = value;
      break;
    case SettingType::kText:
      if (value.empty()) invalid(spec, label, value);
      out.text = value;
      break;
    case SettingType::kAddressRange:
      AddressRange range;
      std::string why;
      if (!AddressRange::tryParse(value, &range, &why)) {
        throw ConfigError(label + "=" + value + " is not valid: " + why + "; " +
                          AddressRange::kValidForm);
      }
      out.text = value;
      break;
  }
  return out;
}

const SettingSpec& optionSpec(const std::string& option) {
  std::string options;
  for (const SettingSpec& spec : kSettings) {
    if (spec.option == nullptr) continue;
    if (option == spec.option) return spec;
    options += (options.empty() ? "" : ", ") + std::string(spec.option);
  }
  throw ConfigError("unknown process-group option " + option + "; valid options are: " + options);
}

void checkOption(const std::string& option, const std::string& value) {
  parseSetting(optionSpec(option), value, option);
}

Config::Config() {
  for (const SettingSpec& spec : kSettings) {
    if (spec.defaultValue != nullptr)
      spec.store(*this, parseSetting(spec, spec.defaultValue, spec.name));
  }
}

Config Config::fromEnv(const std::map<std::string, std::string>& env) {
  Config config;
  for (const auto& [name, value] : env) {
    if (name.rfind("RECCL_", 0) != 0) continue;
    const SettingSpec* spec = findSetting(name);
    if (spec == nullptr) {
      throw ConfigError("unknown setting " + name +
                        "; valid RECCL_* variables are: " + validNames());
    }
    spec->store(config, parseSetting(*spec, value, name));
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

std::string algoName(Algo algo) { return choiceName(kAlgoChoices, static_cast<int>(algo)); }

std::string transportName(TransportMode mode) {
  return choiceName(kTransportChoices, static_cast<int>(mode));
}

void Config::applyLogLevel() const { setLogLevel(debug); }

}  // namespace reccl
