// Python bindings of the reccl process group (torch_reccl._C): the creator the
// Python backend registration calls, and a few engine facts for tests/tools.
// Called from the module definition in bindings.cc.
#include <optional>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "pg/process_group_reccl.h"

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

}  // namespace

void bindProcessGroup(py::module_& m) {
  m.def(
      "_create_reccl_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeoutSeconds,
         const std::string& group, int channels, int64_t chunkBytes, int window) {
        reccl::ProcessGroupReccl::Options options;
        options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0));
        options.group = group;
        options.channels = channels;
        options.chunkBytes = static_cast<size_t>(chunkBytes);
        options.window = window;
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
      "Creates the c10d backend of one reccl process group (rendezvous through `store`).");
  m.def(
      "_reccl_backend_info",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) {
        reccl::ProcessGroupReccl* pg = asReccl(backend);
        py::dict d;
        d["group"] = pg->options().group;
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
        }
        return d;
      },
      py::arg("backend"), "Engine facts of a reccl backend: channels, chunk size, ops done, plan.");
  m.def(
      "_reccl_fault_picture",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) {
        std::shared_ptr<reccl::Communicator> comm = asReccl(backend)->communicatorForTools();
        if (!comm) throw py::value_error("the reccl process group has been shut down");
        reccl::GroupView view = comm->groupView();
        py::dict d;
        d["round"] = view.round;
        d["max_ops_done"] = view.maxOpsDone;
        py::dict plan;
        plan["id"] = view.plan.id;
        plan["start_op"] = view.plan.startOp;
        plan["channels_without_data"] = channelList(view.plan.avoidMask, comm->channels());
        d["plan"] = plan;
        py::list degraded;
        for (const auto& r : view.degraded) {
          py::dict e;
          e["rank"] = r.rank;
          e["ops_done"] = r.state.opsDone;
          e["channels_on_backup"] = channelList(r.state.backupChannels, comm->channels());
          e["nics_down"] = channelList(r.state.nicsDown, 64);
          e["device_ops_done"] = r.state.deviceOps;
          degraded.append(e);
        }
        d["degraded"] = degraded;
        return d;
      },
      py::arg("backend"), "The job-wide fault picture the control plane shares.");
  m.def(
      "_reccl_attach_device_backend",
      [](const c10::intrusive_ptr<c10d::Backend>& backend,
         const c10::intrusive_ptr<c10d::Backend>& device) {
        std::shared_ptr<reccl::Communicator> comm = asReccl(backend)->communicatorForTools();
        if (!comm) throw py::value_error("the reccl process group has been shut down");
        // A weak reference: the process group owns both backends, and the
        // control plane must not keep NCCL's alive past destroy_process_group.
        c10::weak_intrusive_ptr<c10d::Backend> weak(device);
        comm->setDeviceOpsCounter([weak]() -> uint64_t {
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
      "Lets the control plane count the collectives the group's GPU backend issues.");
  m.def(
      "_dcr_plan_to_adopt",
      [](uint64_t currentId, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& carried,
         uint64_t seq) -> py::object {
        std::vector<reccl::PlanProposal> proposals;
        for (const auto& [id, startOp, avoid] : carried) proposals.push_back({id, startOp, avoid});
        std::optional<reccl::PlanProposal> plan = reccl::planToAdopt(currentId, proposals, seq);
        if (!plan) return py::none();
        return py::make_tuple(plan->id, plan->startOp, plan->avoidMask);
      },
      py::arg("current_id"), py::arg("carried"), py::arg("seq"),
      "For tests: the (id, start_op, avoid_mask) op `seq` switches to, or None.");
  m.def(
      "_dcr_plan_weights",
      [](uint64_t avoidMask, int channels, uint64_t count) {
        reccl::ChannelPlan plan = reccl::planOf({1, 0, avoidMask}, channels);
        py::list out;
        for (const auto& range : plan.split(count)) out.append(py::make_tuple(range.offset, range.count));
        return out;
      },
      py::arg("avoid_mask"), py::arg("channels"), py::arg("count"),
      "For tests: how a plan avoiding `avoid_mask` splits `count` elements over channels.");
  m.def(
      "_decode_group_view",
      [](py::bytes data, int groupSize) {
        std::string raw = data;
        reccl::GroupView view =
            reccl::decodeGroupView(std::vector<uint8_t>(raw.begin(), raw.end()), groupSize);
        py::list degraded;
        for (const auto& d : view.degraded) {
          degraded.append(py::make_tuple(d.rank, d.state.opsDone, d.state.backupChannels,
                                         d.state.nicsDown, d.state.deviceOps));
        }
        return py::make_tuple(view.round, view.plan.id, view.plan.startOp, view.plan.avoidMask,
                              view.maxOpsDone, degraded);
      },
      py::arg("data"), py::arg("group_size"),
      "For tests: decodes a control-plane group view; raises ProtocolError on bad input.");
  m.def(
      "_encode_group_view",
      [](uint64_t round, uint64_t planId, uint64_t startOp, uint64_t avoid, uint64_t maxOps,
         const std::vector<std::tuple<int, uint64_t, uint64_t, uint64_t, uint64_t>>& degraded) {
        reccl::GroupView view;
        view.round = round;
        view.plan = {planId, startOp, avoid};
        view.maxOpsDone = maxOps;
        for (const auto& [rank, ops, backup, down, device] : degraded) {
          view.degraded.push_back({rank, {ops, backup, down, device}});
        }
        std::vector<uint8_t> bytes = reccl::encodeGroupView(view);
        return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      },
      "For tests: encodes a control-plane group view.");
}
