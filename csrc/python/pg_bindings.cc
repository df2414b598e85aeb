// Python bindings of the reccl process group (torch_reccl._C): the creator the
// Python backend registration calls, and a few engine facts for tests/tools.
// Called from the module definition in bindings.cc.
#include <map>
#include <optional>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "engine/proportional.h"
#include "engine/shares.h"
#include "pg/process_group_reccl.h"
#include "pg/store_rendezvous.h"

namespace py = pybind11;

namespace {

[[noreturn]] void raiseDistBackendError(const std::string& message) {
  py::object error = py::module_::import("torch.distributed").attr("DistBackendError");
  PyErr_SetString(error.ptr(), message.c_str());
  throw py::error_already_set();
}

reccl::ProcessGroupReccl* asReccl(const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto* pg = dynamic_cast<reccl::ProcessGroupReccl*>(backend.get());
  if (!pg) throw py::type_error("not a reccl backend");
  return pg;
}

py::list channelList(uint64_t mask, int channels) {
  py::list out;
  for (int c = 0; c < channels && c < 64; ++c) {
    if (mask & (uint64_t{1} << c)) out.append(c);
  }
  return out;
}

// The creator the Python backend registration calls.
void bindBackendCreation(py::module_& m) {
  m.def(
      "_create_reccl_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeoutSeconds,
         const std::string& group, int channels, int64_t chunkBytes, int window,
         std::vector<int> globalRanks) {
        reccl::ProcessGroupReccl::Options options;
        options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0));
        options.group = group;
        options.channels = channels;
        options.chunkBytes = static_cast<size_t>(chunkBytes);
        options.window = window;
        options.globalRanks = std::move(globalRanks);
        std::string error;
        c10::intrusive_ptr<c10d::Backend> backend;
        {
          py::gil_scoped_release release;
          try {
            backend = reccl::createRecclBackend(store, rank, size, options);
          } catch (const c10::Error& e) {
            error = e.what_without_backtrace();
          } catch (const std::exception& e) {
            error = e.what();
          }
        }
        if (!error.empty()) raiseDistBackendError(error);
        return backend;
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group"),
      py::arg("channels") = -1, py::arg("chunk_bytes") = 0, py::arg("window") = 0,
      py::arg("global_ranks") = std::vector<int>{},
      "Creates the c10d backend of one reccl process group (rendezvous through `store` at its "
      "first CPU collective).");
}

// What tools and tests read of a live backend, and its link to the GPU backend.
void bindBackendTools(py::module_& m) {
  m.def(
      "_reccl_process_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
        return c10::intrusive_ptr<c10d::ProcessGroup>(
            c10::make_intrusive<reccl::RecclProcessGroup>(store, rank, size));
      },
      py::arg("store"), py::arg("rank"), py::arg("size"),
      "A ProcessGroup that names itself \"reccl\" (no backends registered yet).");
  m.def(
      "_reccl_backend_info",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) {
        reccl::ProcessGroupReccl* pg = asReccl(backend);
        py::dict d;
        d["group"] = pg->options().group;
        d["global_ranks"] = pg->options().globalRanks;  // empty: the group is the job
        d["channels"] = pg->channels();
        d["chunk_bytes"] = pg->options().chunkBytes;
        d["window"] = pg->options().window;
        d["timeout_s"] = static_cast<double>(pg->options().timeout.count()) / 1000.0;
        d["ops_done"] = pg->opsDone();
        std::shared_ptr<reccl::Communicator> comm = pg->communicatorForTools();
        if (comm) {
          reccl::PlanProposal plan = comm->currentPlan();
          d["plan"] = plan.id;
          d["channels_without_data"] = channelList(plan.avoidMask, comm->channels());
          // Each rank's share of a large all_reduce (None: equal shares).
          const std::vector<uint64_t> weights = comm->currentShares();
          if (weights.empty()) {
            d["shares"] = py::none();
          } else {
            uint64_t total = 0;
            for (uint64_t w : weights) total += w;
            std::vector<double> shares;
            for (uint64_t w : weights) shares.push_back(static_cast<double>(w) / total);
            d["shares"] = shares;
          }
          // This rank's own state now; the group agrees on it at its next collective.
          d["channels_on_backup"] =
              channelList(comm->localFaults().backupChannels, comm->channels());
          // The layout (known from the first collective on): hosts by rank, ring order.
          if (std::shared_ptr<const reccl::Layout> layout = comm->knownLayout()) {
            std::vector<int> hosts;
            for (int r = 0; r < layout->size(); ++r) hosts.push_back(layout->hostOf(r));
            d["hosts"] = hosts;
            d["ring_order"] = layout->order();
            d["two_level"] = layout->twoLevel();
            d["agreement_partners"] = comm->agreementPartners();
          }
          py::dict peers;
          for (int c = 0; c < comm->channels(); ++c) peers[py::int_(c)] = comm->sendPeers(c);
          d["send_peers"] = peers;  // by channel: the peers this rank sent collectives to
        }
        return d;
      },
      py::arg("backend"),
      "Engine facts of a reccl backend: channels, chunk size, ops done, plan, and this rank's "
      "channels on backup now.");
  m.def(
      "_reccl_fault_picture",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) {
        reccl::ProcessGroupReccl* pg = asReccl(backend);
        std::shared_ptr<reccl::Communicator> comm = pg->communicatorForTools();
        reccl::FaultPicture picture = comm ? comm->faultPicture() : reccl::FaultPicture{};
        const int channels = comm ? comm->channels() : 0;
        std::vector<reccl::BoardRecord> board;
        {
          py::gil_scoped_release release;
          board = pg->degradedMembers();
        }
        py::dict d;
        d["agreed_at_op"] = picture.agreedAtOp;
        d["max_ops_done"] = picture.maxOpsDone;
        py::dict plan;
        plan["id"] = picture.plan.id;
        plan["start_op"] = picture.plan.startOp;
        plan["channels_without_data"] = channelList(picture.plan.avoidMask, channels);
        d["plan"] = plan;
        py::list degraded;
        std::map<int, py::dict> byRank;
        for (const auto& r : picture.listed) {
          py::dict e;
          e["rank"] = r.rank;
          e["ops_done"] = r.faults.opsDone;
          e["channels_on_backup"] = channelList(r.faults.backupChannels, channels);
          e["nics_down"] = channelList(r.faults.nicsDown, 64);
          e["nics_degraded"] = py::list();  // the board knows grey verdicts; the agreement does not
          e["device_ops_done"] = r.faults.deviceOps;
          byRank[r.rank] = e;
        }
        // The board is fresher for NICs and NCCL ops; the agreement knows channels.
        for (const auto& r : board) {
          py::dict e = byRank.count(r.rank) ? byRank[r.rank] : py::dict();
          if (!byRank.count(r.rank)) {
            e["rank"] = r.rank;
            e["ops_done"] = py::none();
            e["channels_on_backup"] = py::list();
          }
          e["nics_down"] = channelList(r.nicsDown, 64);
          e["nics_degraded"] = channelList(r.nicsSlow, 64);
          e["device_ops_done"] = r.deviceOps;
          byRank[r.rank] = e;
        }
        for (auto& [rank, e] : byRank) degraded.append(e);
        d["degraded"] = degraded;
        d["degraded_ranks"] = std::max<size_t>(picture.degradedRanks, byRank.size());
        return d;
      },
      py::arg("backend"),
      "The group's fault picture: the agreement of its last CPU collective, and the job's fault "
      "board for NICs down (store reads, in proportion to faults).");
  m.def(
      "_reccl_control_stats",
      [] {
        py::dict d;
        d["store_requests"] =
            reccl::StoreRendezvous::requests() + reccl::FaultBoard::storeRequests();
        d["rendezvous_store_requests"] = reccl::StoreRendezvous::requests();
        d["fault_board_store_requests"] = reccl::FaultBoard::storeRequests();
        d["agreements"] = reccl::agreementsRun();
        return d;
      },
      "Process-wide control-plane counters: store requests (rendezvous, fault board) and "
      "per-op agreements run.");
  m.def(
      "_reccl_connections",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> size_t {
        std::shared_ptr<reccl::Communicator> comm = asReccl(backend)->communicatorForTools();
        return comm ? comm->connections() : 0;
      },
      py::arg("backend"), "Connections the group's CPU engine has made (0: no engine yet).");
  m.def(
      "_reccl_attach_device_backend",
      [](const c10::intrusive_ptr<c10d::Backend>& backend,
         const c10::intrusive_ptr<c10d::Backend>& device) {
        // A weak reference: the process group owns both backends, and the
        // engine must not keep NCCL's alive past destroy_process_group.
        c10::weak_intrusive_ptr<c10d::Backend> weak(device);
        asReccl(backend)->setDeviceOpsCounter([weak]() -> uint64_t {
          c10::intrusive_ptr<c10d::Backend> strong = weak.lock();
          if (!strong) return 0;
          try {
            return strong->getSequenceNumberForGroup();
          } catch (const std::exception&) {
            return 0;  // a backend without sequence numbers
          }
        });
      },
      py::arg("backend"), py::arg("device_backend"),
      "Lets the fault picture count the collectives the group's GPU backend issues.");
}

// The engine's pure rules (DCR, per-op agreements), for tests.
void bindEngineRules(py::module_& m) {
  m.def(
      "_dcr_advance_plan",
      [](std::tuple<uint64_t, uint64_t, uint64_t> current,
         std::optional<std::tuple<uint64_t, uint64_t, uint64_t>> pending, uint64_t agreedAvoid,
         uint64_t seq, uint64_t offset) {
        auto proposal = [](const std::tuple<uint64_t, uint64_t, uint64_t>& t) {
          return reccl::PlanProposal{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
        };
        auto tuple = [](const reccl::PlanProposal& p) {
          return py::make_tuple(p.id, p.startOp, p.avoidMask);
        };
        reccl::PlanState state;
        state.current = proposal(current);
        if (pending) state.pending = proposal(*pending);
        std::optional<reccl::PlanProposal> next =
            reccl::advancePlan(state, agreedAvoid, seq, offset);
        return py::make_tuple(next ? py::object(tuple(*next)) : py::none(), tuple(state.current),
                              state.pending ? py::object(tuple(*state.pending)) : py::none());
      },
      py::arg("current"), py::arg("pending"), py::arg("agreed_avoid"), py::arg("seq"),
      py::arg("offset"),
      "For tests: DCR's rule; returns (plan switched to or None, current, pending).");
  m.def(
      "_dcr_plan_weights",
      [](uint64_t avoidMask, int channels, uint64_t count) {
        reccl::ChannelPlan plan = reccl::planOf({1, 0, avoidMask}, channels);
        py::list out;
        for (const auto& range : plan.split(count))
          out.append(py::make_tuple(range.offset, range.count));
        return out;
      },
      py::arg("avoid_mask"), py::arg("channels"), py::arg("count"),
      "For tests: how a plan avoiding `avoid_mask` splits `count` elements over channels.");
  m.def(
      "_share_weights",
      [](int size, const std::vector<std::pair<int, uint32_t>>& reduced) {
        std::vector<reccl::RankCapacity> capacities;
        for (const auto& [rank, capacity] : reduced) capacities.push_back({rank, capacity});
        return reccl::shareWeights(size, capacities);
      },
      py::arg("size"), py::arg("reduced"),
      "For tests: share weights of `size` ranks with (rank, capacity of 4096) reduced ones; "
      "empty for equal shares.");
  m.def(
      "_share_rule_run",
      [](const std::vector<std::optional<std::vector<std::pair<int, uint32_t>>>>& agreed,
         uint64_t offset, uint64_t riseHold) {
        // Feeds the agreed capacities of ops 0, 1, ... to the share rule;
        // returns, per op, the id of the plan in force and its reduced ranks.
        reccl::ShareState state;
        py::list out;
        for (uint64_t seq = 0; seq < agreed.size(); ++seq) {
          std::optional<std::vector<reccl::RankCapacity>> capacities;
          if (agreed[seq]) {
            capacities.emplace();
            for (const auto& [rank, capacity] : *agreed[seq])
              capacities->push_back({rank, capacity});
          }
          reccl::advanceShares(state, capacities, seq, offset, riseHold);
          py::list reduced;
          for (const auto& c : state.current.reduced)
            reduced.append(py::make_tuple(c.rank, c.capacity));
          out.append(py::make_tuple(state.current.id, reduced));
        }
        return out;
      },
      py::arg("agreed"), py::arg("offset"), py::arg("rise_hold"),
      "For tests: the share rule over a sequence of agreed capacities (None: not known).");
  m.def(
      "_ring_reduction_order",
      [](uint64_t count, int channels, int size) {
        py::list out;
        for (const auto& s : reccl::ringReductionOrder(count, channels, size))
          out.append(py::make_tuple(s.elements.offset, s.elements.count, s.finalPosition));
        return out;
      },
      py::arg("count"), py::arg("channels"), py::arg("size"),
      "For tests: the fault-free ring all_reduce's segments (offset, count, final position).");
  m.def(
      "_agreement_fold",
      [](int groupSize, const std::vector<std::tuple<uint64_t, int, uint64_t, int>>& ops,
         const std::vector<std::vector<uint64_t>>& faults,
         const std::vector<std::pair<int, int>>& steps,
         const std::map<int, std::tuple<int, std::string, int32_t, int64_t, int64_t>>& rejections) {
        // Every rank's own agreement, merged as `steps` say (state[i] takes in
        // state[j]); returns state[0]'s wire form.
        std::vector<reccl::Agreement> states;
        for (int r = 0; r < groupSize; ++r) {
          const auto& [seq, kind, count, root] = ops.at(r);
          reccl::OpDescriptor desc =
              reccl::OpDescriptor::of(static_cast<reccl::OpKind>(kind), reccl::DataType::kFloat32,
                                      count, root);
          desc.seq = seq;
          auto rejected = rejections.find(r);
          if (rejected != rejections.end()) {
            const auto& [reason, argument, index, got, want] = rejected->second;
            desc.rejection = {static_cast<reccl::Rejection::Reason>(reason), argument, index, got,
                              want};
          }
          const std::vector<uint64_t>& f = faults.at(r);
          if (f.size() != 3 && f.size() != 4) {
            throw reccl::ConfigError(
                "a rank's faults are (ops_done, backup_channels, nics_down"
                "[, nics]), got " +
                std::to_string(f.size()) + " values");
          }
          reccl::RankFaults rankFaults{f[0], f[1], f[2], 0,
                                       f.size() == 4 ? static_cast<uint32_t>(f[3]) : 0};
          states.push_back(reccl::Agreement::of(r, desc, rankFaults, 0));
        }
        for (const auto& [into, from] : steps) states.at(into).merge(states.at(from));
        std::vector<uint8_t> bytes(reccl::kAgreementBytes);
        reccl::encodeAgreement(states.at(0), groupSize, bytes.data());
        return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      },
      py::arg("group_size"), py::arg("ops"), py::arg("faults"), py::arg("steps"),
      py::arg("rejections") =
          std::map<int, std::tuple<int, std::string, int32_t, int64_t, int64_t>>{},
      "For tests: merges per-rank agreements (ops: (seq, kind, count, root); faults: "
      "(ops_done, backup_channels, nics_down[, nics]); rejections: rank -> (reason, argument, "
      "index, "
      "got, want)) in the given order; returns the wire form.");
  m.def(
      "_agreement_decode",
      [](py::bytes data, int groupSize, const std::string& group) {
        std::string raw = data;
        reccl::Agreement a = reccl::decodeAgreement(reinterpret_cast<const uint8_t*>(raw.data()),
                                                    raw.size(), groupSize);
        py::dict d;
        d["first_rank"] = a.firstRank;
        d["odd_rank"] = a.oddRank;
        try {
          a.check(group);
          d["mismatch"] = py::none();
        } catch (const reccl::MismatchError& e) {
          d["mismatch"] = std::string(e.what());
        }
        d["failed"] = a.failed;
        d["missing"] = a.missing;
        d["backup_channels"] = a.backupChannels;
        d["max_ops_done"] = a.maxOpsDone;
        d["degraded_ranks"] = a.degradedRanks;
        d["reduced_ranks"] = a.reducedRanks;
        py::list listed;
        for (const auto& r : a.listed) {
          listed.append(py::make_tuple(r.rank, r.faults.opsDone, r.faults.backupChannels,
                                       r.faults.nicsDown, r.faults.nics));
        }
        d["listed"] = listed;
        // The reduced ranks' capacities (shares.h), None when not all are listed.
        std::optional<std::vector<reccl::RankCapacity>> capacities = reccl::agreedCapacities(a);
        if (capacities) {
          py::list out;
          for (const auto& c : *capacities) out.append(py::make_tuple(c.rank, c.capacity));
          d["capacities"] = out;
        } else {
          d["capacities"] = py::none();
        }
        return d;
      },
      py::arg("data"), py::arg("group_size"), py::arg("group") = "g",
      "For tests: decodes an agreement (ProtocolError on bad input).");
}

}  // namespace

void bindProcessGroup(py::module_& m) {
  bindBackendCreation(m);
  bindBackendTools(m);
  bindEngineRules(m);
}
