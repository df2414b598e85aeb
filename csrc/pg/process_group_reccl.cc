#include "pg/process_group_reccl.h"

#include <algorithm>
#include <map>
#include <numeric>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "core/error.h"
#include "core/topology.h"
#include "engine/all_gather.h"
#include "engine/all_reduce.h"
#include "engine/all_to_all.h"
#include "engine/barrier.h"
#include "engine/broadcast.h"
#include "engine/collective.h"
#include "engine/gather.h"
#include "engine/op_context.h"
#include "engine/reduce.h"
#include "engine/reduce_scatter.h"
#include "engine/scatter.h"
#include "pg/monitored_barrier.h"
#include "pg/shared_transport.h"
#include "pg/store_rendezvous.h"
#include "pg/tensor_args.h"
#include "transport/descriptor_table.h"

namespace reccl {

namespace {

using std::chrono::milliseconds;

// A contiguous tensor with `t`'s data: `t` itself when it already is one.
at::Tensor contiguousOf(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// A contiguous buffer to produce `t`'s new contents in (`t` when contiguous).
at::Tensor outputBuffer(const at::Tensor& t) {
  return t.is_contiguous()
             ? t
             : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
}

void copyBack(const at::Tensor& t, const at::Tensor& buffer) {
  if (!buffer.is_same(t)) t.copy_(buffer);
}

// One flat contiguous tensor holding `tensors` back to back.
at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copies consecutive pieces of `flat` into `tensors`.
void unflattenInto(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

std::string messageOf(const std::exception& e) {
  if (auto* c10error = dynamic_cast<const c10::Error*>(&e))
    return c10error->what_without_backtrace();
  return e.what();
}

void checkRoot(int64_t root, int size, const char* op) {
  TORCH_CHECK(root >= 0 && root < size, "reccl ", op, ": root rank ", root,
              " is not in this group of ", size, " ranks");
}

// What a survivor can do about members gone (PeerGoneError::ranks).
std::string goneHint(const std::vector<int>& ranks) {
  std::string list;
  for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
  return ". This group can run no more operations; to go on without " +
         std::string(ranks.size() == 1 ? "it" : "them") +
         ", every other member calls torch.distributed.shrink_group([" + list +
         "], group=<this group>)";
}

void checkPeer(int peer, int rank, int size, const char* op) {
  TORCH_CHECK(peer >= 0 && peer < size && peer != rank, "reccl ", op, ": rank ", peer,
              " is not another rank of this group of ", size, " (this is rank ", rank, ")");
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> createRecclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     ProcessGroupReccl::Options options) {
  return c10::make_intrusive<ProcessGroupReccl>(store, rank, size, std::move(options));
}

ProcessGroupReccl::ProcessGroupReccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                     int size, Options options)
    : c10d::Backend(rank, size), options_(std::move(options)), store_(store) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "reccl: rank ", rank, " is not in a group of ",
              size);
  TORCH_CHECK(options_.globalRanks.empty() ||
                  options_.globalRanks.size() == static_cast<size_t>(size),
              "reccl: process group '", options_.group, "' names ", options_.globalRanks.size(),
              " global ranks for ", size, " members");
  const int globalRank = options_.globalRanks.empty() ? rank : options_.globalRanks[rank];
  // The first group of the process starts growing the fd table, so its engine's
  // sockets, opened at first use, find the room there (transport/descriptor_table.h).
  reserveDescriptorTable();
  try {
    board_ = FaultBoard::join(store, globalRank, Config::fromProcessEnv().dcrPeriodMs);
  } catch (const Error& e) {
    C10_THROW_ERROR(DistBackendError, std::string("reccl: creating process group '") +
                                          options_.group + "' failed: " + e.what());
  }
  init();
}

ProcessGroupReccl::~ProcessGroupReccl() { release(false); }

milliseconds ProcessGroupReccl::timeoutOf(milliseconds requested) const {
  return requested.count() > 0 ? requested : options_.timeout;
}

void ProcessGroupReccl::setDeviceOpsCounter(std::function<uint64_t()> counter) {
  std::lock_guard<std::mutex> lock(releaseMutex_);
  deviceOps_ = counter;
  if (!board_) return;  // released
  if (boardToken_) board_->removeDeviceOps(boardToken_);
  boardToken_ = board_->addDeviceOps(counter);
  if (comm_) comm_->setDeviceOpsCounter(std::move(counter));
}

std::vector<BoardRecord> ProcessGroupReccl::degradedMembers() {
  std::shared_ptr<FaultBoard> board;
  {
    std::lock_guard<std::mutex> lock(releaseMutex_);
    board = board_;
  }
  if (!board) return {};  // released
  std::map<int, int> groupRankOf;
  for (int r = 0; r < size_; ++r)
    groupRankOf[options_.globalRanks.empty() ? r : options_.globalRanks[r]] = r;
  std::vector<BoardRecord> members;
  for (BoardRecord record : board->degraded()) {
    auto it = groupRankOf.find(record.rank);
    if (it == groupRankOf.end()) continue;
    record.rank = it->second;
    members.push_back(record);
  }
  return members;
}

std::shared_ptr<Communicator> ProcessGroupReccl::communicator(const char* op) {
  std::lock_guard<std::mutex> lock(releaseMutex_);
  TORCH_CHECK(!released_, "reccl ", op, ": process group '", options_.group,
              "' has been shut down or aborted");
  if (!comm_) startEngine();
  return comm_;
}

void ProcessGroupReccl::startEngine() {
  // The first CPU operation builds the engine; a group that only ever runs
  // CUDA tensors never does. Costs two store requests (this incarnation, this
  // rank's handles), no reads of other ranks and no thread.
  auto rendezvous = std::make_shared<StoreRendezvous>(store_);
  try {
    // Keys unique to this incarnation of the group on this store: a group made
    // again on the same store (after destroy_process_group) never reads stale
    // handles. Every rank counts its own incarnations, so they agree.
    const int64_t incarnation = rendezvous->add("reccl/incarnation/" + std::to_string(rank_), 1);
    const std::string prefix = "reccl/" + std::to_string(incarnation) + "/";
    std::shared_ptr<Transport> transport = sharedTransport();
    const Config& config = transport->config();
    if (options_.channels < 0) options_.channels = config.channels;
    if (options_.chunkBytes == 0) options_.chunkBytes = static_cast<size_t>(config.chunkBytes);
    if (options_.window == 0) options_.window = config.window;
    CommOptions commOptions(config);
    commOptions.channels = options_.channels;
    commOptions.chunkBytes = options_.chunkBytes;
    commOptions.window = options_.window;
    commOptions.group = options_.group;
    commOptions.host = hostIdentity(config.hostId);
    commOptions.rendezvousTimeout = std::max(options_.timeout, milliseconds(1000));
    commOptions.globalRanks = options_.globalRanks;
    comm_ = std::make_shared<Communicator>(std::move(transport), std::move(rendezvous), prefix,
                                           rank_, size_, commOptions);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, std::string("reccl: starting the engine of process group '") +
                                          options_.group + "' failed: " + e.what());
  }
  if (deviceOps_) comm_->setDeviceOpsCounter(deviceOps_);
  queue_ = std::make_unique<OpQueue>();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::enqueue(c10d::OpType type, const char* title,
                                                          std::vector<at::Tensor> outputs,
                                                          milliseconds timeout, Body body) {
  auto comm = communicator(title);
  auto work =
      c10::make_intrusive<RecclWork>(rank_, type, title, std::move(outputs), seq_.fetch_add(1) + 1);
  OpQueue::Job job;
  job.run = [comm, work, timeout, body = std::move(body), title, group = options_.group,
             rank = rank_, size = size_] {
    std::exception_ptr error;
    try {
      body(*comm, timeout);
    } catch (const TimeoutError& e) {
      error = backendError(timedOutMessage(title, group, rank, size, timeout, e.what()));
    } catch (const PeerGoneError& e) {
      error = backendError(std::string(e.what()) + goneHint(e.ranks()));
    } catch (const std::exception& e) {
      error = backendError(messageOf(e));
    } catch (...) {
      error = backendError("reccl: unknown error");
    }
    if (error) {
      work->fail(error);
    } else {
      work->succeed();
    }
    comm->releaseSpentKey();  // after the op completed: off its latency
  };
  job.cancel = [work, group = options_.group](const std::string& why) {
    work->fail(backendError("reccl: operation on process group '" + group + "' cancelled: " + why));
  };
  {
    std::lock_guard<std::mutex> lock(releaseMutex_);
    TORCH_CHECK(!released_ && queue_, "reccl ", title, ": process group '", options_.group,
                "' has been shut down or aborted");
    queue_->push(std::move(job));
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::reject(c10d::OpType type, const char* title,
                                                         OpDescriptor desc,
                                                         milliseconds requested) {
  return enqueue(type, title, {}, timeoutOf(requested),
                 [desc](Communicator& c, milliseconds t) { rejectCollective(c, desc, t); });
}

// ------------------------------------------------------------------ collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::broadcast(std::vector<at::Tensor>& tensors,
                                                            const c10d::BroadcastOptions& opts) {
  const at::Tensor t = singleTensor(tensors, "broadcast");
  TORCH_CHECK(opts.rootTensor == 0,
              "reccl broadcast: root_tensor must be 0 (one tensor per process)");
  checkRoot(opts.rootRank, size_, "broadcast");
  const DataType dt = toDataType(t.scalar_type(), "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, "reccl:broadcast", {t}, timeoutOf(opts.timeout),
                 [t, dt, root](Communicator& c, milliseconds timeout) {
                   at::Tensor buf = contiguousOf(t);
                   reccl::broadcast(c, buf.data_ptr(), buf.numel(), dt, root, timeout);
                   copyBack(t, buf);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::allreduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse) {
    return sparseAllreduce(tensors[0], opts);
  }
  const at::Tensor t = singleTensor(tensors, "all_reduce");
  const DataType dt = toDataType(t.scalar_type(), "all_reduce");
  const ReduceOp op = toReduceOp(opts.reduceOp, "all_reduce");
  try {
    checkReduceOp(op, dt);
  } catch (const Error& e) {
    TORCH_CHECK(false, "reccl all_reduce: ", e.what());
  }
  return enqueue(c10d::OpType::ALLREDUCE, "reccl:all_reduce", {t}, timeoutOf(opts.timeout),
                 [t, dt, op](Communicator& c, milliseconds timeout) {
                   at::Tensor buf = contiguousOf(t);
                   reccl::allreduce(c, buf.data_ptr(), buf.data_ptr(), buf.numel(), dt, op,
                                    timeout);
                   copyBack(t, buf);
                 });
}

namespace {

// Per rank, gathered before the indices and values: sparse_dim, dense_dim,
// nnz, then the sizes (unused entries 0).
constexpr int64_t kSparseMetaFixed = 3;
constexpr int64_t kSparseMaxDims = 64;
constexpr int64_t kSparseMetaLength = kSparseMetaFixed + kSparseMaxDims;

// The rows of `gathered` ([ranks, padded]) cut to each rank's `lengths`,
// reshaped by `shapeOf`.
std::vector<at::Tensor> unpad(const at::Tensor& gathered, const std::vector<int64_t>& lengths,
                              const std::function<std::vector<int64_t>(size_t)>& shapeOf) {
  std::vector<at::Tensor> pieces;
  for (size_t r = 0; r < lengths.size(); ++r) {
    pieces.push_back(
        gathered.select(0, static_cast<int64_t>(r)).narrow(0, 0, lengths[r]).reshape(shapeOf(r)));
  }
  return pieces;
}

// Gathers `flat` (1-D, contiguous) from every rank, each padded to `padded` elements.
at::Tensor allgatherPadded(Communicator& c, const at::Tensor& flat, int64_t padded, int size,
                           milliseconds timeout) {
  at::Tensor in = at::zeros({padded}, flat.options());
  in.narrow(0, 0, flat.numel()).copy_(flat);
  at::Tensor out = at::empty({size, padded}, flat.options());
  if (padded > 0) {
    reccl::allgather(c, in.data_ptr(), out.data_ptr(), static_cast<size_t>(padded),
                     toDataType(flat.scalar_type(), "all_reduce"), timeout);
  }
  return out;
}

}  // namespace

// Gloo's algorithm (ProcessGroupGloo's AsyncSparseAllreduceWork), so results are
// bit for bit Gloo's: coalesce, gather every rank's shape and nnz, gather the
// indices and values, add the ranks' tensors in rank order, coalesce.
c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::sparseAllreduce(
    const at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensor.device().is_cpu(), "reccl all_reduce: the sparse tensor is on ",
              tensor.device(), "; the reccl CPU engine takes CPU tensors");
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM,
              "reccl all_reduce: sparse tensors reduce with ReduceOp.SUM only (as with Gloo)");
  TORCH_CHECK(tensor.dim() <= kSparseMaxDims, "reccl all_reduce: a sparse tensor of ", tensor.dim(),
              " dimensions; at most ", kSparseMaxDims, " are supported");
  toDataType(tensor.scalar_type(), "all_reduce");
  const at::Tensor t = tensor;
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::ALLREDUCE, "reccl:sparse_all_reduce", {t}, timeoutOf(opts.timeout),
                 [t, rank, size](Communicator& c, milliseconds timeout) {
                   at::AutoDispatchBelowAutograd belowAutograd;
                   const at::Tensor input = t.coalesce();
                   at::Tensor meta = at::zeros({kSparseMetaLength}, at::kLong);
                   int64_t* m = meta.data_ptr<int64_t>();
                   m[0] = input.sparse_dim();
                   m[1] = input.dense_dim();
                   m[2] = input._nnz();
                   for (int64_t d = 0; d < input.dim(); ++d)
                     m[kSparseMetaFixed + d] = input.size(d);
                   const at::Tensor metas =
                       allgatherPadded(c, meta, kSparseMetaLength, size, timeout);
                   std::vector<int64_t> nnz(size);
                   for (int r = 0; r < size; ++r) {
                     TORCH_CHECK(metas[r].narrow(0, 0, 2).equal(meta.narrow(0, 0, 2)) &&
                                     metas[r]
                                         .narrow(0, kSparseMetaFixed, kSparseMaxDims)
                                         .equal(meta.narrow(0, kSparseMetaFixed, kSparseMaxDims)),
                                 "reccl all_reduce: sparse tensors differ in shape between ranks: "
                                 "rank ",
                                 rank, " has ", input.sizes(), " (sparse_dim ", input.sparse_dim(),
                                 "), rank ", r, " has sparse_dim ", metas[r][0].item<int64_t>(),
                                 ", dense_dim ", metas[r][1].item<int64_t>());
                     nnz[r] = metas[r][2].item<int64_t>();
                   }
                   const int64_t sparseDim = input.sparse_dim();
                   const std::vector<int64_t> valueShape = input.sizes().slice(sparseDim).vec();
                   int64_t denseNumel = 1;
                   for (int64_t d : valueShape) denseNumel *= d;
                   const int64_t maxNnz = *std::max_element(nnz.begin(), nnz.end());
                   std::vector<int64_t> indexLengths, valueLengths;
                   for (int64_t n : nnz) {
                     indexLengths.push_back(n * sparseDim);
                     valueLengths.push_back(n * denseNumel);
                   }
                   const std::vector<at::Tensor> indices =
                       unpad(allgatherPadded(c, input._indices().contiguous().reshape({-1}),
                                             maxNnz * sparseDim, size, timeout),
                             indexLengths,
                             [&](size_t r) { return std::vector<int64_t>{sparseDim, nnz[r]}; });
                   const std::vector<at::Tensor> values =
                       unpad(allgatherPadded(c, input._values().contiguous().reshape({-1}),
                                             maxNnz * denseNumel, size, timeout),
                             valueLengths, [&](size_t r) {
                               std::vector<int64_t> shape{nnz[r]};
                               shape.insert(shape.end(), valueShape.begin(), valueShape.end());
                               return shape;
                             });
                   at::Tensor output =
                       at::sparse_coo_tensor(indices[0], values[0], input.sizes(), input.options());
                   for (int r = 1; r < size; ++r) {
                     output += at::sparse_coo_tensor(indices[r], values[r], input.sizes(),
                                                     input.options());
                   }
                   t.copy_(output.coalesce());
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "reccl all_reduce_coalesced: no tensors");
  checkTensor(tensors[0], "all_reduce_coalesced", "tensors[0]");
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkTensor(tensors[i], "all_reduce_coalesced", "a tensor");
    TORCH_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type(),
                "reccl all_reduce_coalesced: tensors[", i, "] has dtype ", tensors[i].scalar_type(),
                " but tensors[0] has ", tensors[0].scalar_type(), "; all must share one dtype");
  }
  const DataType dt = toDataType(tensors[0].scalar_type(), "all_reduce_coalesced");
  const ReduceOp op = toReduceOp(opts.reduceOp, "all_reduce_coalesced");
  try {
    checkReduceOp(op, dt);
  } catch (const Error& e) {
    TORCH_CHECK(false, "reccl all_reduce_coalesced: ", e.what());
  }
  std::vector<at::Tensor> ts = tensors;
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "reccl:all_reduce_coalesced", ts,
                 timeoutOf(opts.timeout), [ts, dt, op](Communicator& c, milliseconds timeout) {
                   at::Tensor flat = flatten(ts);
                   reccl::allreduce(c, flat.data_ptr(), flat.data_ptr(), flat.numel(), dt, op,
                                    timeout);
                   unflattenInto(flat, ts);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::reduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::ReduceOptions& opts) {
  const at::Tensor t = singleTensor(tensors, "reduce");
  TORCH_CHECK(opts.rootTensor == 0, "reccl reduce: root_tensor must be 0 (one tensor per process)");
  checkRoot(opts.rootRank, size_, "reduce");
  const DataType dt = toDataType(t.scalar_type(), "reduce");
  const ReduceOp op = toReduceOp(opts.reduceOp, "reduce");
  try {
    checkReduceOp(op, dt);
  } catch (const Error& e) {
    TORCH_CHECK(false, "reccl reduce: ", e.what());
  }
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = root == rank_;
  return enqueue(c10d::OpType::REDUCE, "reccl:reduce", {t}, timeoutOf(opts.timeout),
                 [t, dt, op, root, isRoot](Communicator& c, milliseconds timeout) {
                   at::Tensor in = contiguousOf(t);
                   reccl::reduce(c, in.data_ptr(), in.data_ptr(), in.numel(), dt, op, root,
                                 timeout);
                   if (isRoot) copyBack(t, in);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const at::Tensor in = singleTensor(inputs, "all_gather");
  TORCH_CHECK(outputs.size() == 1, "reccl all_gather: takes one output list, got ", outputs.size());
  const DataType dt = toDataType(in.scalar_type(), "all_gather");
  OpDescriptor desc = OpDescriptor::of(OpKind::kAllgather, dt, in.numel());
  desc.rejection = checkPerRankList(outputs[0], size_, in, "all_gather", "tensor_list");
  if (desc.rejection)
    return reject(c10d::OpType::ALLGATHER, "reccl:all_gather", desc, opts.timeout);
  std::vector<at::Tensor> outs = outputs[0];
  const int size = size_;
  return enqueue(c10d::OpType::ALLGATHER, "reccl:all_gather", outs, timeoutOf(opts.timeout),
                 [in, outs, dt, size](Communicator& c, milliseconds timeout) {
                   at::Tensor src = contiguousOf(in);
                   at::Tensor flat = at::empty({size * src.numel()}, src.options());
                   reccl::allgather(c, src.data_ptr(), flat.data_ptr(), src.numel(), dt, timeout);
                   unflattenInto(flat, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  checkTensor(input, "all_gather_into_tensor", "input");
  checkTensor(output, "all_gather_into_tensor", "output");
  const DataType dt = toDataType(input.scalar_type(), "all_gather_into_tensor");
  OpDescriptor desc = OpDescriptor::of(OpKind::kAllgather, dt, input.numel());
  desc.rejection = checkTensorLike(output, input, input.numel() * size_, "output_tensor");
  if (desc.rejection) {
    return reject(c10d::OpType::_ALLGATHER_BASE, "reccl:all_gather_into_tensor", desc,
                  opts.timeout);
  }
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "reccl:all_gather_into_tensor", {out},
                 timeoutOf(opts.timeout), [in, out, dt](Communicator& c, milliseconds timeout) {
                   at::Tensor src = contiguousOf(in);
                   at::Tensor dst = outputBuffer(out);
                   reccl::allgather(c, src.data_ptr(), dst.data_ptr(), src.numel(), dt, timeout);
                   copyBack(out, dst);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "reccl all_gather_coalesced: no input tensors");
  TORCH_CHECK(outputLists.size() == static_cast<size_t>(size_),
              "reccl all_gather_coalesced: needs one output list per rank (", size_, "), got ",
              outputLists.size());
  std::vector<DataType> dts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "all_gather_coalesced", "input");
    dts.push_back(toDataType(inputs[i].scalar_type(), "all_gather_coalesced"));
  }
  std::vector<at::Tensor> flatOutputs;
  for (const auto& list : outputLists) {
    TORCH_CHECK(list.size() == inputs.size(),
                "reccl all_gather_coalesced: every output list needs ", inputs.size(), " tensors");
    for (size_t i = 0; i < list.size(); ++i) {
      checkSameShape({list[i]}, inputs[i], "all_gather_coalesced", "output");
      flatOutputs.push_back(list[i]);
    }
  }
  std::vector<at::Tensor> ins = inputs;
  std::vector<std::vector<at::Tensor>> lists = outputLists;
  const int size = size_;
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "reccl:all_gather_coalesced", flatOutputs,
                 timeoutOf(opts.timeout),
                 [ins, lists, dts, size](Communicator& c, milliseconds timeout) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     at::Tensor src = contiguousOf(ins[i]);
                     at::Tensor flat = at::empty({size * src.numel()}, src.options());
                     reccl::allgather(c, src.data_ptr(), flat.data_ptr(), src.numel(), dts[i],
                                      timeout);
                     for (int r = 0; r < size; ++r) {
                       lists[r][i].copy_(
                           flat.narrow(0, r * src.numel(), src.numel()).view(lists[r][i].sizes()));
                     }
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "reccl all_gather_into_tensor_coalesced: needs as many outputs as inputs (got ",
              outputs.size(), " and ", inputs.size(), ")");
  std::vector<DataType> dts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "all_gather_into_tensor_coalesced", "input");
    checkTensor(outputs[i], "all_gather_into_tensor_coalesced", "output");
    TORCH_CHECK(outputs[i].scalar_type() == inputs[i].scalar_type() &&
                    outputs[i].numel() == inputs[i].numel() * size_,
                "reccl all_gather_into_tensor_coalesced: output ", i,
                " must have the input's dtype and world size x its elements");
    dts.push_back(toDataType(inputs[i].scalar_type(), "all_gather_into_tensor_coalesced"));
  }
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return enqueue(c10d::OpType::COALESCED, "reccl:all_gather_into_tensor_coalesced", outs,
                 timeoutOf(opts.timeout), [ins, outs, dts](Communicator& c, milliseconds timeout) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     at::Tensor src = contiguousOf(ins[i]);
                     at::Tensor dst = outputBuffer(outs[i]);
                     reccl::allgather(c, src.data_ptr(), dst.data_ptr(), src.numel(), dts[i],
                                      timeout);
                     copyBack(outs[i], dst);
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const at::Tensor in = singleTensor(inputs, "gather");
  checkRoot(opts.rootRank, size_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(outputs.size() <= 1, "reccl gather: takes one output list, got ", outputs.size());
  std::vector<at::Tensor> outs = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  const DataType dt = toDataType(in.scalar_type(), "gather");
  OpDescriptor desc = OpDescriptor::of(OpKind::kGather, dt, in.numel(), root);
  if (rank_ == root) {
    desc.rejection = checkPerRankList(outs, size_, in, "gather", "gather_list");
  } else if (!outs.empty()) {
    desc.rejection = {Rejection::Reason::kNotRoot, "gather_list", -1,
                      static_cast<int64_t>(outs.size()), 0};
  }
  if (desc.rejection) return reject(c10d::OpType::GATHER, "reccl:gather", desc, opts.timeout);
  const int size = size_;
  return enqueue(c10d::OpType::GATHER, "reccl:gather", outs, timeoutOf(opts.timeout),
                 [in, outs, dt, root, size](Communicator& c, milliseconds timeout) {
                   at::Tensor src = contiguousOf(in);
                   at::Tensor flat;
                   if (!outs.empty()) flat = at::empty({size * src.numel()}, src.options());
                   reccl::gather(c, src.data_ptr(), outs.empty() ? nullptr : flat.data_ptr(),
                                 src.numel(), dt, root, timeout);
                   if (!outs.empty()) unflattenInto(flat, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const at::Tensor out = singleTensor(outputs, "scatter");
  checkRoot(opts.rootRank, size_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(inputs.size() <= 1, "reccl scatter: takes one input list, got ", inputs.size());
  std::vector<at::Tensor> ins = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];
  const DataType dt = toDataType(out.scalar_type(), "scatter");
  OpDescriptor desc = OpDescriptor::of(OpKind::kScatter, dt, out.numel(), root);
  if (rank_ == root) {
    desc.rejection = checkPerRankList(ins, size_, out, "scatter", "scatter_list");
  } else if (!ins.empty()) {
    desc.rejection = {Rejection::Reason::kNotRoot, "scatter_list", -1,
                      static_cast<int64_t>(ins.size()), 0};
  }
  if (desc.rejection) return reject(c10d::OpType::SCATTER, "reccl:scatter", desc, opts.timeout);
  return enqueue(c10d::OpType::SCATTER, "reccl:scatter", {out}, timeoutOf(opts.timeout),
                 [ins, out, dt, root](Communicator& c, milliseconds timeout) {
                   at::Tensor flat;
                   if (!ins.empty()) flat = flatten(ins);
                   at::Tensor dst = outputBuffer(out);
                   reccl::scatter(c, ins.empty() ? nullptr : flat.data_ptr(), dst.data_ptr(),
                                  dst.numel(), dt, root, timeout);
                   copyBack(out, dst);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const at::Tensor out = singleTensor(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "reccl reduce_scatter: takes one input list, got ",
              inputs.size());
  const DataType dt = toDataType(out.scalar_type(), "reduce_scatter");
  const ReduceOp op = toReduceOp(opts.reduceOp, "reduce_scatter");
  try {
    checkReduceOp(op, dt);
  } catch (const Error& e) {
    TORCH_CHECK(false, "reccl reduce_scatter: ", e.what());
  }
  OpDescriptor desc = OpDescriptor::of(OpKind::kReduceScatter, dt, out.numel(), -1, op);
  desc.rejection = checkPerRankList(inputs[0], size_, out, "reduce_scatter", "input_list");
  if (desc.rejection) {
    return reject(c10d::OpType::REDUCE_SCATTER, "reccl:reduce_scatter", desc, opts.timeout);
  }
  std::vector<at::Tensor> ins = inputs[0];
  return enqueue(c10d::OpType::REDUCE_SCATTER, "reccl:reduce_scatter", {out},
                 timeoutOf(opts.timeout),
                 [ins, out, dt, op](Communicator& c, milliseconds timeout) {
                   at::Tensor flat = flatten(ins);
                   at::Tensor dst = outputBuffer(out);
                   reccl::reduceScatter(c, flat.data_ptr(), dst.data_ptr(), dst.numel(), dt, op,
                                        timeout);
                   copyBack(out, dst);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  checkTensor(input, "reduce_scatter_tensor", "input");
  checkTensor(output, "reduce_scatter_tensor", "output");
  const DataType dt = toDataType(output.scalar_type(), "reduce_scatter_tensor");
  const ReduceOp op = toReduceOp(opts.reduceOp, "reduce_scatter_tensor");
  try {
    checkReduceOp(op, dt);
  } catch (const Error& e) {
    TORCH_CHECK(false, "reccl reduce_scatter_tensor: ", e.what());
  }
  OpDescriptor desc = OpDescriptor::of(OpKind::kReduceScatter, dt, output.numel(), -1, op);
  desc.rejection = checkTensorLike(input, output, output.numel() * size_, "input");
  if (desc.rejection) {
    return reject(c10d::OpType::_REDUCE_SCATTER_BASE, "reccl:reduce_scatter_tensor", desc,
                  opts.timeout);
  }
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "reccl:reduce_scatter_tensor", {out},
                 timeoutOf(opts.timeout), [in, out, dt, op](Communicator& c, milliseconds timeout) {
                   at::Tensor src = contiguousOf(in);
                   at::Tensor dst = outputBuffer(out);
                   reccl::reduceScatter(c, src.data_ptr(), dst.data_ptr(), dst.numel(), dt, op,
                                        timeout);
                   copyBack(out, dst);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "reccl reduce_scatter_tensor_coalesced: needs as many outputs as inputs");
  std::vector<DataType> dts;
  const ReduceOp op = toReduceOp(opts.reduceOp, "reduce_scatter_tensor_coalesced");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "reduce_scatter_tensor_coalesced", "input");
    checkTensor(outputs[i], "reduce_scatter_tensor_coalesced", "output");
    TORCH_CHECK(outputs[i].scalar_type() == inputs[i].scalar_type() &&
                    inputs[i].numel() == outputs[i].numel() * size_,
                "reccl reduce_scatter_tensor_coalesced: input ", i,
                " must have the output's dtype and world size x its elements");
    dts.push_back(toDataType(inputs[i].scalar_type(), "reduce_scatter_tensor_coalesced"));
    try {
      checkReduceOp(op, dts.back());
    } catch (const Error& e) {
      TORCH_CHECK(false, "reccl reduce_scatter_tensor_coalesced: ", e.what());
    }
  }
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  // COALESCED: torch before 2.13 has no REDUCE_SCATTER_TENSOR_COALESCED op type.
  return enqueue(c10d::OpType::COALESCED, "reccl:reduce_scatter_tensor_coalesced", outs,
                 timeoutOf(opts.timeout),
                 [ins, outs, dts, op](Communicator& c, milliseconds timeout) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     at::Tensor src = contiguousOf(ins[i]);
                     at::Tensor dst = outputBuffer(outs[i]);
                     reccl::reduceScatter(c, src.data_ptr(), dst.data_ptr(), dst.numel(), dts[i],
                                          op, timeout);
                     copyBack(outs[i], dst);
                   }
                 });
}

namespace {

// Element counts per rank along dim 0 from c10d split sizes (empty: equal
// parts); why they are invalid goes to `bad` unless it holds a problem already
// (`tensorArg` and `splitsArg` name the arguments). Only a tensor with no
// dimension to split throws.
std::vector<uint64_t> splitCounts(const at::Tensor& t, const std::vector<int64_t>& splits, int size,
                                  const char* tensorArg, const char* splitsArg, Rejection* bad) {
  std::vector<uint64_t> counts(size);
  if (splits.empty()) {
    if (t.numel() % size != 0 && !*bad) {
      *bad = {Rejection::Reason::kIndivisible, tensorArg, -1, t.numel(), size};
    }
    std::fill(counts.begin(), counts.end(), static_cast<uint64_t>(t.numel() / size));
    return counts;
  }
  if (splits.size() != static_cast<size_t>(size)) {
    if (!*bad) {
      *bad = {Rejection::Reason::kListLength, splitsArg, -1, static_cast<int64_t>(splits.size()),
              size};
    }
    return counts;
  }
  TORCH_CHECK(t.dim() >= 1, "reccl all_to_all_single: ", tensorArg, " needs a dimension to split");
  const int64_t rows = t.size(0);
  const int64_t rowElems = rows > 0 ? t.numel() / rows : 0;
  int64_t total = 0;
  bool negative = false;
  for (int r = 0; r < size; ++r) {
    negative = negative || splits[r] < 0;
    counts[r] = static_cast<uint64_t>(std::max<int64_t>(0, splits[r]) * rowElems);
    total += splits[r];
  }
  if ((negative || total != rows) && !*bad) {
    *bad = {Rejection::Reason::kSplitSizes, splitsArg, -1, total, rows};
  }
  return counts;
}

std::vector<uint64_t> offsetsOf(const std::vector<uint64_t>& counts) {
  std::vector<uint64_t> offsets(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) offsets[i] = offsets[i - 1] + counts[i - 1];
  return offsets;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::alltoall_base(at::Tensor& output,
                                                                at::Tensor& input,
                                                                std::vector<int64_t>& outputSplits,
                                                                std::vector<int64_t>& inputSplits,
                                                                const c10d::AllToAllOptions& opts) {
  checkTensor(input, "all_to_all_single", "input");
  checkTensor(output, "all_to_all_single", "output");
  const DataType dt = toDataType(input.scalar_type(), "all_to_all_single");
  OpDescriptor desc;
  desc.kind = OpKind::kAlltoall;
  desc.dtype = dt;
  desc.count = static_cast<uint64_t>(input.numel());
  std::vector<uint64_t> sendCounts =
      splitCounts(input, inputSplits, size_, "input", "input_split_sizes", &desc.rejection);
  std::vector<uint64_t> recvCounts =
      splitCounts(output, outputSplits, size_, "output", "output_split_sizes", &desc.rejection);
  if (!desc.rejection) desc.rejection = checkTensorLike(output, input, output.numel(), "output");
  if (desc.rejection) {
    return reject(c10d::OpType::ALLTOALL_BASE, "reccl:all_to_all_single", desc, opts.timeout);
  }
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::ALLTOALL_BASE, "reccl:all_to_all_single", {out},
                 timeoutOf(opts.timeout),
                 [in, out, dt, sendCounts, recvCounts](Communicator& c, milliseconds timeout) {
                   at::Tensor src = contiguousOf(in);
                   at::Tensor dst = outputBuffer(out);
                   if (dst.data_ptr() == src.data_ptr() && dst.numel() > 0)
                     dst = at::empty_like(dst);
                   reccl::alltoall(c, src.data_ptr(), sendCounts, offsetsOf(sendCounts),
                                   dst.data_ptr(), recvCounts, offsetsOf(recvCounts), dt, timeout);
                   copyBack(out, dst);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::alltoall(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(!inputs.empty() || !outputs.empty(), "reccl all_to_all: no input or output tensors");
  const at::Tensor& first = inputs.empty() ? outputs[0] : inputs[0];
  checkTensor(first, "all_to_all", "the first tensor");
  const DataType dt = toDataType(first.scalar_type(), "all_to_all");
  OpDescriptor desc;
  desc.kind = OpKind::kAlltoall;
  desc.dtype = dt;
  std::vector<uint64_t> sendCounts, recvCounts;
  for (const auto& [list, argument] : {std::make_pair(&inputs, "input_tensor_list"),
                                       std::make_pair(&outputs, "output_tensor_list")}) {
    if (list->size() != static_cast<size_t>(size_) && !desc.rejection) {
      desc.rejection = {Rejection::Reason::kListLength, argument, -1,
                        static_cast<int64_t>(list->size()), size_};
    }
    for (size_t r = 0; r < list->size(); ++r) {
      const at::Tensor& t = (*list)[r];
      checkTensor(t, "all_to_all", argument);
      if (t.scalar_type() != first.scalar_type() && !desc.rejection) {
        desc.rejection = {Rejection::Reason::kDtype, argument, static_cast<int32_t>(r), 0, 0};
      }
      (list == &inputs ? sendCounts : recvCounts).push_back(t.numel());
    }
  }
  for (uint64_t c : sendCounts) desc.count += c;
  if (desc.rejection) return reject(c10d::OpType::ALLTOALL, "reccl:all_to_all", desc, opts.timeout);
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return enqueue(c10d::OpType::ALLTOALL, "reccl:all_to_all", outs, timeoutOf(opts.timeout),
                 [ins, outs, dt, sendCounts, recvCounts](Communicator& c, milliseconds timeout) {
                   at::Tensor src = flatten(ins);
                   uint64_t total =
                       std::accumulate(recvCounts.begin(), recvCounts.end(), uint64_t{0});
                   at::Tensor dst = at::empty({static_cast<int64_t>(total)}, src.options());
                   reccl::alltoall(c, src.data_ptr(), sendCounts, offsetsOf(sendCounts),
                                   dst.data_ptr(), recvCounts, offsetsOf(recvCounts), dt, timeout);
                   unflattenInto(dst, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, "reccl:barrier", {}, timeoutOf(opts.timeout),
                 [](Communicator& c, milliseconds timeout) { reccl::barrier(c, timeout); });
}

void ProcessGroupReccl::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // c10d's "unset" is negative; 0 is a real (spent) bound, as for Gloo.
  const milliseconds timeout = opts.timeout.count() < 0 ? options_.timeout : opts.timeout;
  reccl::monitoredBarrier(*store_, monitoredBarriers_.fetch_add(1) + 1, rank_, size_, timeout,
                          waitAllRanks);
}

// ------------------------------------------------------------------ point to point

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::p2pWork(c10d::OpType type,
                                                          std::shared_ptr<P2pOp> op,
                                                          std::vector<at::Tensor> keepAlive,
                                                          std::function<void()> onSuccess) {
  std::weak_ptr<Communicator> weak = communicator("p2p");
  auto onFailure = [weak](const std::string& why) {
    // The connections may still hold the buffer (a timed-out or mismatched
    // receive stays posted): close them, which fails the group like any other
    // transport failure.
    if (auto comm = weak.lock()) comm->abort(why);
  };
  return c10::make_intrusive<RecclP2pWork>(rank_, size_, options_.group, type, std::move(op),
                                           std::move(keepAlive), options_.timeout,
                                           std::move(onSuccess), onFailure);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::send(std::vector<at::Tensor>& tensors,
                                                       int dstRank, int tag) {
  const at::Tensor t = singleTensor(tensors, "send");
  checkPeer(dstRank, rank_, size_, "send");
  const DataType dt = toDataType(t.scalar_type(), "send");
  auto comm = communicator("send");
  at::Tensor buf = contiguousOf(t);
  std::shared_ptr<P2pOp> op;
  try {
    op = comm->p2p().send(dstRank, tag, buf.data_ptr(), buf.numel(), dt);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, std::string("reccl send: ") + e.what());
  }
  return p2pWork(c10d::OpType::SEND, op, {buf}, nullptr);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::recv(std::vector<at::Tensor>& tensors,
                                                       int srcRank, int tag) {
  const at::Tensor t = singleTensor(tensors, "recv");
  checkPeer(srcRank, rank_, size_, "recv");
  const DataType dt = toDataType(t.scalar_type(), "recv");
  auto comm = communicator("recv");
  at::Tensor buf = outputBuffer(t);
  std::shared_ptr<P2pOp> op;
  try {
    op = comm->p2p().recv(srcRank, tag, buf.data_ptr(), buf.numel(), dt);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, std::string("reccl recv: ") + e.what());
  }
  std::vector<at::Tensor> keep{t};
  if (!buf.is_same(t)) keep.push_back(buf);
  return p2pWork(c10d::OpType::RECV, op, keep, [t, buf] { copyBack(t, buf); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupReccl::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                int tag) {
  const at::Tensor t = singleTensor(tensors, "recv");
  const DataType dt = toDataType(t.scalar_type(), "recv");
  auto comm = communicator("recv");
  at::Tensor buf = outputBuffer(t);
  std::shared_ptr<P2pOp> op;
  try {
    op = comm->p2p().recv(-1, tag, buf.data_ptr(), buf.numel(), dt);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, std::string("reccl recv: ") + e.what());
  }
  std::vector<at::Tensor> keep{t};
  if (!buf.is_same(t)) keep.push_back(buf);
  return p2pWork(c10d::OpType::RECVANYSOURCE, op, keep, [t, buf] { copyBack(t, buf); });
}

// ------------------------------------------------------------------ groups and lifetime

c10::intrusive_ptr<c10d::Backend> ProcessGroupReccl::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;  // not a member of the new group
  Options options = options_;
  if (opts) {
    if (opts->timeout.count() > 0) options.timeout = opts->timeout;
    if (!opts->group_name.empty()) options.group = opts->group_name;
  }
  return c10::make_intrusive<ProcessGroupReccl>(store, static_cast<int>(it - ranks.begin()),
                                                static_cast<int>(ranks.size()), options);
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupReccl::shrink(
    const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) {
  TORCH_CHECK_VALUE(shrinkFlags == kShrinkDefault || shrinkFlags == kShrinkAbort,
                    "reccl shrink: shrink_flags=", shrinkFlags,
                    " is not valid: SHRINK_DEFAULT (0) or SHRINK_ABORT (1)");
  TORCH_CHECK_VALUE(!ranksToExclude.empty(), "reccl shrink: ranks_to_exclude is empty");
  std::vector<bool> excluded(size_, false);
  for (int64_t r : ranksToExclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "reccl shrink: rank ", r, " is not in process group '",
                      options_.group, "' of ", size_, " ranks (valid: 0..", size_ - 1, ")");
    TORCH_CHECK_VALUE(!excluded[r], "reccl shrink: rank ", r, " is listed twice");
    TORCH_CHECK_VALUE(r != rank_, "reccl shrink: rank ", r,
                      " is this process: an excluded rank does not call shrink");
    excluded[r] = true;
  }
  if (shrinkFlags == kShrinkAbort) abort();
  Options options;
  {
    std::lock_guard<std::mutex> lock(releaseMutex_);  // startEngine settles options_
    options = options_;
  }
  const std::vector<int> parentGlobal = std::move(options.globalRanks);
  options.globalRanks.clear();
  std::string prefix = "reccl/shrink/";
  int newRank = 0;
  for (int r = 0; r < size_; ++r) {
    if (excluded[r]) {
      prefix += std::to_string(r) + ",";
      continue;
    }
    if (r < rank_) ++newRank;
    options.globalRanks.push_back(parentGlobal.empty() ? r : parentGlobal[r]);
  }
  prefix.pop_back();  // the trailing ','; PrefixStore puts a '/' after the prefix
  options.group += ":shrunk";  // until torch names it (setGroupUid)
  if (optsOverride) {
    if (optsOverride->timeout.count() > 0) options.timeout = optsOverride->timeout;
    if (!optsOverride->group_name.empty()) options.group = optsOverride->group_name;
  }
  const int newSize = static_cast<int>(options.globalRanks.size());
  return c10::make_intrusive<ProcessGroupReccl>(c10::make_intrusive<c10d::PrefixStore>(prefix,
                                                                                       store_),
                                                newRank, newSize, std::move(options));
}

void ProcessGroupReccl::setGroupUid(const std::string& pgUid) {
  c10d::Backend::setGroupUid(pgUid);
  // torch calls it as it makes the group, before any op reads the name.
  std::lock_guard<std::mutex> lock(releaseMutex_);
  options_.group = pgUid;
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupReccl::getBackendOptions() {
  auto options = c10::make_intrusive<c10d::Backend::Options>("reccl", options_.timeout);
  options->group_name = options_.group;
  return options;
}

void ProcessGroupReccl::release(bool orderly) {
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<OpQueue> queue;
  std::shared_ptr<FaultBoard> board;
  {
    std::lock_guard<std::mutex> lock(releaseMutex_);
    if (released_) return;
    released_ = true;
    comm = std::move(comm_);
    queue = std::move(queue_);
    if (boardToken_) board_->removeDeviceOps(boardToken_);
    boardToken_ = 0;
    board = std::move(board_);  // the last group's release stops the board's thread
  }
  if (orderly && queue) {
    const milliseconds grace = std::min(options_.timeout, milliseconds(30000));
    queue->drain(grace);
    if (comm) comm->flush(grace);  // the last descriptors reach the peers before we close
  }
  const std::string why =
      orderly ? "the process group was shut down" : "the process group was aborted";
  if (comm) comm->abort(why, orderly);  // fails a running op at once, closes every connection
  if (queue) queue->stop(why);
  queue.reset();
  comm.reset();  // the transport goes with the last group
}

void ProcessGroupReccl::shutdown() { release(true); }

void ProcessGroupReccl::abort() { release(false); }

}  // namespace reccl
