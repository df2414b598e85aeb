#include "engine/communicator.h"

#include <algorithm>
#include <cstring>

#include "core/health.h"
#include "core/log.h"
#include "engine/direct.h"
#include "engine/ring.h"

namespace reccl {

namespace {

// Messages one connection may carry for one op: well below the transport's
// bound on outstanding requests, so the rings never block on it.
constexpr size_t kMessagesPerConnection = 512;
constexpr size_t kMaxChunksPerTransfer = 128;

uint8_t* bytesOf(void* p) { return static_cast<uint8_t*>(p); }
const uint8_t* bytesOf(const void* p) { return static_cast<const uint8_t*>(p); }

void copyIfDistinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memmove(dst, src, bytes);
}


}  // namespace

Communicator::Communicator(std::shared_ptr<Transport> transport,
                           std::shared_ptr<Rendezvous> rendezvous, const std::string& prefix,
                           int rank, int size, CommOptions options)
    : rank_(rank),
      size_(size),
      options_(std::move(options)),
      plan_(options_.channels > 0 ? options_.channels
                                  : std::max<int>(1, static_cast<int>(transport->nics().size()))) {
  if (options_.chunkBytes < 4096 || options_.chunkBytes > (256u << 20)) {
    throw ConfigError("chunk_bytes=" + std::to_string(options_.chunkBytes) +
                      " is not valid: expected 4096..268435456");
  }
  if (plan_.channels() > 64) {
    throw ConfigError("channels=" + std::to_string(plan_.channels()) +
                      " is not valid: expected 1..64");
  }
  if (options_.window < 1 || options_.window > 64) {
    throw ConfigError("window=" + std::to_string(options_.window) + " is not valid: expected 1..64");
  }
  links_ = std::make_shared<Links>(std::move(transport), std::move(rendezvous), prefix, rank, size,
                                   plan_.channels(), options_.rendezvousTimeout);
  agreement_ = std::make_unique<RecursiveDoubling>(links_, rank, size, options_.smallBytes);
  p2p_ = std::make_shared<P2p>(links_, options_.group);
  pool_ = std::make_unique<WorkerPool>(plan_.channels() - 1);
  scratch_.resize(plan_.channels());
}

Communicator::~Communicator() {
  links_->close();
  pool_.reset();
}

std::string Communicator::error() const {
  std::lock_guard<std::mutex> lock(errorMutex_);
  return error_;
}

void Communicator::flush(Millis timeout) {
  std::lock_guard<std::mutex> lock(opMutex_);
  agreement_->flush(timeout);
}

void Communicator::abort(const std::string& why, bool orderly) {
  {
    std::lock_guard<std::mutex> lock(errorMutex_);
    if (error_.empty()) error_ = why;
  }
  aborted_.store(true);
  links_->close(orderly);
}

uint8_t* Communicator::opScratch(size_t bytes) {
  // Kept between ops: a fresh allocation this large is mmapped by malloc and
  // page-faulted in again by every op (a 5x cliff from 32 MiB up).
  if (opScratch_.size() < bytes) opScratch_.resize(bytes);
  return opScratch_.data();
}

RankFaults Communicator::sampleFaults() const {
  RankFaults faults;
  faults.opsDone = opsDone_.load();
  faults.nicsDown = links_->nicsDown();
  faults.backupChannels = links_->channelsOnBackup(faults.nicsDown);
  std::lock_guard<std::mutex> lock(planMutex_);
  if (deviceOps_) faults.deviceOps = deviceOps_();
  return faults;
}

void Communicator::setDeviceOpsCounter(std::function<uint64_t()> counter) {
  std::lock_guard<std::mutex> lock(planMutex_);
  deviceOps_ = std::move(counter);
}

int Communicator::channels() const {
  std::lock_guard<std::mutex> lock(planMutex_);
  return plan_.channels();
}

PlanProposal Communicator::currentPlan() const {
  std::lock_guard<std::mutex> lock(planMutex_);
  return current_;
}

FaultPicture Communicator::faultPicture() const {
  std::lock_guard<std::mutex> lock(planMutex_);
  return picture_;
}

void Communicator::adoptAgreement(const Agreement& agreement, uint64_t seq) {
  const uint64_t avoid =
      options_.rebalance ? agreement.backupChannels & allChannelsMask(plan_.channels()) : 0;
  std::optional<PlanProposal> next = advancePlan(plans_, avoid, seq, options_.dcrOffset);
  {
    std::lock_guard<std::mutex> lock(planMutex_);
    if (next) {
      plan_ = planOf(*next, plan_.channels());
      current_ = *next;
    }
    picture_.agreedAtOp = static_cast<int64_t>(seq);
    picture_.plan = plans_.pending ? *plans_.pending : plans_.current;
    picture_.maxOpsDone = agreement.maxOpsDone;
    picture_.degradedRanks = agreement.degradedRanks;
    picture_.listed = agreement.listed;
  }
  if (!next) return;
  Event event;
  event.kind = EventKind::kRebalance;
  event.wallNs = wallNs();
  event.group = options_.group;
  event.op = static_cast<int64_t>(seq);
  event.plan = static_cast<int64_t>(next->id);
  const uint64_t avoided = next->avoidMask & allChannelsMask(plan_.channels());
  event.detail = avoided == 0
                     ? "every channel carries data"
                     : describeChannels(avoided) + " of " + std::to_string(plan_.channels()) +
                           " carry no data (their paths run over backup NICs)";
  RECCL_LOG(kInfo, "reccl: process group '" + options_.group + "' rank " + std::to_string(rank_) +
                       ": plan " + std::to_string(next->id) + " from op " + std::to_string(seq) +
                       ": " + event.detail);
  NicHealth::instance().emit(std::move(event));
}

std::string Communicator::label(const OpDescriptor& desc) const {
  return std::string(opKindName(desc.kind)) + " #" + std::to_string(desc.seq) +
         " in process group '" + options_.group + "' (rank " + std::to_string(rank_) + " of " +
         std::to_string(size_) + ")";
}

size_t Communicator::chunkElems(DataType dtype, size_t largestSegment,
                                int segmentsPerConnection) const {
  const size_t base = std::max<size_t>(1, options_.chunkBytes / elementSize(dtype));
  const size_t maxChunks =
      std::max<size_t>(1, kMessagesPerConnection / std::max(1, segmentsPerConnection));
  return std::max(base, (largestSegment + maxChunks - 1) / maxChunks);
}

void Communicator::run(OpDescriptor desc, Millis timeout, const RdPayload& payload,
                       const Body& body, uint64_t countsDigest) {
  std::lock_guard<std::mutex> lock(opMutex_);
  std::string broken = error();
  if (!broken.empty()) {
    throw AbortedError("reccl: process group '" + options_.group +
                       "' cannot run more operations after an earlier failure: " + broken);
  }
  desc.seq = seq_++;
  desc.planId = plan_.id();
  desc.chunkBytes = options_.chunkBytes;
  desc.channels = static_cast<uint32_t>(plan_.channels());
  OpContext ctx(label(desc), Clock::now(), timeout, &aborted_);
  try {
    if (size_ > 1) {
      Agreement agreement = Agreement::of(rank_, desc, sampleFaults(), countsDigest);
      agreement_->run(ctx, agreement, payload);
      agreement.check(options_.group);
      if (agreement.countsDigest != 0) diagnoseAlltoall(ctx, desc);
      adoptAgreement(agreement, desc.seq);
    }
    body(ctx);
    opsDone_.fetch_add(1);
  } catch (const MismatchError&) {
    throw;  // every rank saw it after a complete agreement: the streams are intact
  } catch (const std::exception& e) {
    // Aborted from outside (shutdown, abort, a failed p2p op): the connections
    // were closed under this op, so report why rather than what broke.
    if (aborted_.load()) {
      std::string why = error();
      if (!why.empty() && why != e.what()) {
        throw AbortedError("reccl: " + ctx.label() + " failed: " + why);
      }
    }
    abort(e.what());
    throw;
  }
}

void Communicator::diagnoseAlltoall(const OpContext& ctx, const OpDescriptor& desc) {
  // Every pair compares its own counts (what the peer sends me against what I
  // expect), then the ranks agree on the lowest (sender, receiver) pair that
  // differs, so every rank raises the same error. Only on this error path does
  // an all-to-all talk to every peer outside its data.
  struct PairVerdict {
    int64_t from = -1, to = -1;
    uint64_t sent = 0, expected = 0;
  };
  std::vector<uint64_t> theirs(size_, 0);
  std::vector<std::shared_ptr<Request>> recvs(size_), sends(size_);
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) recvs[p] = links_->receiver(p, 0, Lane::kCollective, ctx)->irecv(
                         reinterpret_cast<uint8_t*>(&theirs[p]), sizeof(uint64_t));
  }
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) sends[p] = links_->sender(p, 0, Lane::kCollective)->isend(
                         reinterpret_cast<uint8_t*>(const_cast<uint64_t*>(&desc.sendCounts[p])),
                         sizeof(uint64_t));
  }
  PairVerdict verdict;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    ctx.wait(*recvs[p], "the all_to_all counts from", p, 0);
    if (verdict.from < 0 && theirs[p] != desc.recvCounts[p]) {
      verdict = {p, rank_, theirs[p], desc.recvCounts[p]};
    }
  }
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) ctx.wait(*sends[p], "the all_to_all counts to", p, 0);
  }
  RdPayload payload;
  payload.data = reinterpret_cast<uint8_t*>(&verdict);
  payload.bytes = sizeof(verdict);
  payload.held = [](int, int) { return std::pair<size_t, size_t>{0, sizeof(PairVerdict)}; };
  payload.merge = [&verdict](const uint8_t* bytes, size_t, size_t, bool) {
    PairVerdict other;
    std::memcpy(&other, bytes, sizeof(other));
    auto key = [](const PairVerdict& v) {
      return v.from < 0 ? std::make_pair(INT64_MAX, INT64_MAX) : std::make_pair(v.from, v.to);
    };
    if (key(other) < key(verdict)) verdict = other;
  };
  Agreement agreement = Agreement::of(rank_, desc, RankFaults{}, 0);
  agreement_->run(ctx, agreement, payload);
  if (verdict.from < 0) {
    throw ProtocolError("reccl: " + ctx.label() +
                        ": the all_to_all counts disagree but no pair of ranks differs");
  }
  throw MismatchError(
      "reccl: collective mismatch in process group '" + options_.group + "' at op #" +
      std::to_string(desc.seq) + ": in " + opKindName(desc.kind) + "(" + dataTypeName(desc.dtype) +
      ") rank " + std::to_string(verdict.from) + " sends " + std::to_string(verdict.sent) +
      " elements to rank " + std::to_string(verdict.to) + " but rank " +
      std::to_string(verdict.to) + " expects " + std::to_string(verdict.expected) +
      " from rank " + std::to_string(verdict.from) +
      ". Every rank of a group must call the same collectives in the same order with matching "
      "dtype, size, root and reduce op.");
}

void Communicator::forChannels(const OpContext& ctx, DataType dtype, size_t unit,
                               const std::function<void(ChannelJob&, SendList&)>& fn) {
  std::vector<std::function<void()>> jobs;
  for (int c = 0; c < plan_.channels(); ++c) {
    if (plan_.weight(c) == 0) continue;  // DCR: no traffic at all on this channel
    jobs.push_back([&, c] {
      ChannelJob job{*links_, ctx, c, dtype, elementSize(dtype), unit, options_.window, scratch_[c]};
      SendList sends;
      fn(job, sends);
      sends.waitAll(job);
    });
  }
  pool_->runAll(jobs, [&ctx] { ctx.stop(); });
}

// ------------------------------------------------------------------ collectives

namespace {

void checkRoot(int root, int size) {
  if (root < 0 || root >= size) {
    throw ConfigError("root rank " + std::to_string(root) + " is not in this group of " +
                      std::to_string(size) + " ranks");
  }
}

// The ring segments of one channel's range: `parts` near-equal pieces.
std::vector<Range> ringSegments(const Range& range, int parts) {
  std::vector<Range> segs = splitEvenly(range.count, parts);
  for (auto& s : segs) s.offset += range.offset;
  return segs;
}

size_t largestRingSegment(const std::vector<Range>& ranges, int parts) {
  size_t largest = 0;
  for (const auto& r : ranges) largest = std::max(largest, (r.count + parts - 1) / parts);
  return largest;
}

size_t largestRange(const std::vector<Range>& ranges) {
  size_t largest = 0;
  for (const auto& r : ranges) largest = std::max(largest, r.count);
  return largest;
}

}  // namespace

void Communicator::allreduce(const void* in, void* out, size_t count, DataType dtype,
                             ReduceOp op, Millis timeout) {
  checkReduceOp(op, dtype);
  const size_t bytes = count * elementSize(dtype);
  const bool rd = small(bytes);
  OpDescriptor desc = OpDescriptor::of(OpKind::kAllreduce, dtype, count, -1, op);
  desc.algorithm = static_cast<uint8_t>(rd ? Algorithm::kRecursiveDoubling : Algorithm::kChannels);
  copyIfDistinct(out, in, bytes);
  run(desc, timeout, rd ? reducePayload(bytesOf(out), count, dtype, op) : RdPayload{},
      [&](const OpContext& ctx) {
        if (size_ == 1) return;
        if (rd) {
          if (op == ReduceOp::kAvg) divideBy(out, count, dtype, size_);
          return;
        }
        const std::vector<Range> ranges = plan_.split(count);
        const size_t unit = chunkElems(dtype, largestRingSegment(ranges, size_), 2 * (size_ - 1));
        forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
          const std::vector<Range> segs = ringSegments(ranges[job.channel], size_);
          SegmentFn seg = [&](int j) { return segs[j]; };
          RegionSends regions(size_);
          ringReduceScatter(job, bytesOf(out), seg, rank_, op, regions, sends);
          ringAllgather(job, bytesOf(out), seg, rank_, &regions, sends);
        });
      });
}

void Communicator::broadcast(void* buffer, size_t count, DataType dtype, int root,
                             Millis timeout) {
  checkRoot(root, size_);
  const size_t bytes = count * elementSize(dtype);
  const bool rd = small(bytes);
  OpDescriptor desc = OpDescriptor::of(OpKind::kBroadcast, dtype, count, root);
  desc.algorithm = static_cast<uint8_t>(rd ? Algorithm::kRecursiveDoubling : Algorithm::kChannels);
  run(desc, timeout, rd ? broadcastPayload(bytesOf(buffer), bytes, root) : RdPayload{},
      [&](const OpContext& ctx) {
        if (size_ == 1 || rd) return;
        const std::vector<Range> ranges = plan_.split(count);
        const size_t unit = chunkElems(dtype, largestRange(ranges), 1);
        forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
          chainBroadcast(job, bytesOf(buffer), ranges[job.channel], root, sends);
        });
      });
}

void Communicator::reduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                          int root, Millis timeout) {
  checkRoot(root, size_);
  checkReduceOp(op, dtype);
  const size_t bytes = count * elementSize(dtype);
  const bool rd = small(bytes);
  OpDescriptor desc = OpDescriptor::of(OpKind::kReduce, dtype, count, root, op);
  desc.algorithm = static_cast<uint8_t>(rd ? Algorithm::kRecursiveDoubling : Algorithm::kChannels);
  // The root reduces in place into `out`; the others in a work buffer (their
  // `out` stays untouched).
  uint8_t* work;
  if (rank_ == root) {
    copyIfDistinct(out, in, bytes);
    work = bytesOf(out);
  } else {
    work = opScratch(bytes);
    if (bytes) std::memcpy(work, in, bytes);
  }
  run(desc, timeout, rd ? reducePayload(work, count, dtype, op) : RdPayload{},
      [&](const OpContext& ctx) {
        if (size_ == 1) return;
        if (rd) {
          if (rank_ == root && op == ReduceOp::kAvg) divideBy(out, count, dtype, size_);
          return;
        }
        // Ring reduce-scatter (rank r ends with segment r reduced), then every
        // rank sends its segment to the root.
        const std::vector<Range> ranges = plan_.split(count);
        const size_t unit = chunkElems(dtype, largestRingSegment(ranges, size_), 2 * (size_ - 1));
        forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
          const std::vector<Range> segs = ringSegments(ranges[job.channel], size_);
          SegmentFn seg = [&](int j) { return segs[j]; };
          RegionSends regions(size_);
          ringReduceScatter(job, work, seg, rank_, op, regions, sends);
          std::vector<Transfer> sendTo, recvFrom;
          if (rank_ != root) {
            sendTo.push_back({root, work, segs[rank_], rank_, job.chunkElems});
          } else {
            for (int p = 0; p < size_; ++p) {
              if (p != root) recvFrom.push_back({p, work, segs[p], p, job.chunkElems});
            }
          }
          directExchange(job, sendTo, recvFrom, sends, &regions);
        });
      });
}

void Communicator::allgather(const void* in, void* out, size_t count, DataType dtype,
                             Millis timeout) {
  const size_t bytes = count * elementSize(dtype);
  const bool rd = small(bytes * size_);
  OpDescriptor desc = OpDescriptor::of(OpKind::kAllgather, dtype, count);
  desc.algorithm = static_cast<uint8_t>(rd ? Algorithm::kRecursiveDoubling : Algorithm::kChannels);
  copyIfDistinct(bytesOf(out) + rank_ * bytes, in, bytes);
  run(desc, timeout, rd ? gatherPayload(bytesOf(out), bytes, size_) : RdPayload{},
      [&](const OpContext& ctx) {
        if (size_ == 1 || rd) return;
        const std::vector<Range> ranges = plan_.split(count);
        const size_t unit = chunkElems(dtype, largestRange(ranges), size_ - 1);
        forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
          const Range range = ranges[job.channel];
          SegmentFn seg = [&](int j) { return Range{j * count + range.offset, range.count}; };
          ringAllgather(job, bytesOf(out), seg, rank_, nullptr, sends);
        });
      });
}

void Communicator::reduceScatter(const void* in, void* out, size_t count, DataType dtype,
                                 ReduceOp op, Millis timeout) {
  checkReduceOp(op, dtype);
  const size_t bytes = count * elementSize(dtype);  // per rank
  const bool rd = small(bytes * size_);
  OpDescriptor desc = OpDescriptor::of(OpKind::kReduceScatter, dtype, count, -1, op);
  desc.algorithm = static_cast<uint8_t>(rd ? Algorithm::kRecursiveDoubling : Algorithm::kChannels);
  uint8_t* work = opScratch(bytes * size_);
  if (bytes) std::memcpy(work, in, bytes * size_);
  run(desc, timeout, rd ? reducePayload(work, count * size_, dtype, op) : RdPayload{},
      [&](const OpContext& ctx) {
        if (size_ > 1 && !rd) {
          const std::vector<Range> ranges = plan_.split(count);
          const size_t unit = chunkElems(dtype, largestRange(ranges), size_ - 1);
          forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
            const Range range = ranges[job.channel];
            SegmentFn seg = [&](int j) { return Range{j * count + range.offset, range.count}; };
            RegionSends regions(size_);
            ringReduceScatter(job, work, seg, rank_, op, regions, sends);
          });
        }
        if (bytes) std::memcpy(out, work + rank_ * bytes, bytes);
        if (rd && op == ReduceOp::kAvg) divideBy(out, count, dtype, size_);
      });
}

void Communicator::gather(const void* in, void* out, size_t count, DataType dtype, int root,
                          Millis timeout) {
  checkRoot(root, size_);
  const size_t bytes = count * elementSize(dtype);
  const bool rd = small(bytes * size_);
  OpDescriptor desc = OpDescriptor::of(OpKind::kGather, dtype, count, root);
  desc.algorithm = static_cast<uint8_t>(rd ? Algorithm::kRecursiveDoubling : Algorithm::kChannels);
  // Small: every rank gathers every block (log2 N steps); only the root keeps them.
  uint8_t* blocks = rank_ == root ? bytesOf(out) : (rd ? opScratch(bytes * size_) : nullptr);
  if (blocks) copyIfDistinct(blocks + rank_ * bytes, in, bytes);
  run(desc, timeout, rd ? gatherPayload(blocks, bytes, size_) : RdPayload{},
      [&](const OpContext& ctx) {
        if (size_ == 1 || rd) return;
        const std::vector<Range> ranges = plan_.split(count);
        const size_t unit = chunkElems(dtype, largestRange(ranges), 1);
        forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
          const Range range = ranges[job.channel];
          std::vector<Transfer> sendTo, recvFrom;
          if (rank_ != root) {
            sendTo.push_back({root, const_cast<uint8_t*>(bytesOf(in)), range});
          } else {
            for (int p = 0; p < size_; ++p) {
              if (p != root) recvFrom.push_back({p, bytesOf(out), {p * count + range.offset, range.count}});
            }
          }
          directExchange(job, sendTo, recvFrom, sends);
        });
      });
}

void Communicator::scatter(const void* in, void* out, size_t count, DataType dtype, int root,
                           Millis timeout) {
  checkRoot(root, size_);
  const size_t bytes = count * elementSize(dtype);
  const bool rd = small(bytes * size_);
  OpDescriptor desc = OpDescriptor::of(OpKind::kScatter, dtype, count, root);
  desc.algorithm = static_cast<uint8_t>(rd ? Algorithm::kRecursiveDoubling : Algorithm::kChannels);
  // Small: the root's blocks reach every rank (log2 N steps); each keeps its own.
  uint8_t* blocks = rd ? opScratch(bytes * size_) : nullptr;
  if (rd && rank_ == root && bytes) std::memcpy(blocks, in, bytes * size_);
  run(desc, timeout, rd ? broadcastPayload(blocks, bytes * size_, root) : RdPayload{},
      [&](const OpContext& ctx) {
        if (rd) {
          if (bytes) std::memcpy(out, blocks + rank_ * bytes, bytes);
          return;
        }
        if (rank_ == root) copyIfDistinct(out, bytesOf(in) + root * bytes, bytes);
        if (size_ == 1) return;
        const std::vector<Range> ranges = plan_.split(count);
        const size_t unit = chunkElems(dtype, largestRange(ranges), 1);
        forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
          const Range range = ranges[job.channel];
          std::vector<Transfer> sendTo, recvFrom;
          if (rank_ == root) {
            for (int p = 0; p < size_; ++p) {
              if (p != root) {
                sendTo.push_back({p, const_cast<uint8_t*>(bytesOf(in)), {p * count + range.offset, range.count}});
              }
            }
          } else {
            recvFrom.push_back({root, bytesOf(out), range});
          }
          directExchange(job, sendTo, recvFrom, sends);
        });
      });
}

void Communicator::alltoall(const void* in, const std::vector<uint64_t>& sendCounts,
                            const std::vector<uint64_t>& sendOffsets, void* out,
                            const std::vector<uint64_t>& recvCounts,
                            const std::vector<uint64_t>& recvOffsets, DataType dtype,
                            Millis timeout) {
  const size_t n = static_cast<size_t>(size_);
  if (sendCounts.size() != n || sendOffsets.size() != n || recvCounts.size() != n ||
      recvOffsets.size() != n) {
    throw ConfigError("all_to_all needs one send and receive count and offset per rank (" +
                      std::to_string(size_) + ")");
  }
  const size_t elem = elementSize(dtype);
  auto pairUnit = [&](uint64_t count) {
    size_t base = std::max<size_t>(1, options_.chunkBytes / elem);
    return std::max<size_t>(base, (count + kMaxChunksPerTransfer - 1) / kMaxChunksPerTransfer);
  };
  OpDescriptor desc;
  desc.kind = OpKind::kAlltoall;
  desc.dtype = dtype;
  desc.algorithm = static_cast<uint8_t>(Algorithm::kChannels);
  desc.sendCounts = sendCounts;
  desc.recvCounts = recvCounts;
  for (uint64_t c : sendCounts) desc.count += c;
  // Counts are checked by a digest in the agreement; each pair's own counts
  // are compared only when the digest says some pair disagrees.
  const uint64_t digest = alltoallCountsDigest(rank_, size_, sendCounts, recvCounts);
  run(desc, timeout, RdPayload{},
      [&](const OpContext& ctx) {
        copyIfDistinct(bytesOf(out) + recvOffsets[rank_] * elem,
                       bytesOf(in) + sendOffsets[rank_] * elem, sendCounts[rank_] * elem);
        if (size_ == 1) return;
        forChannels(ctx, dtype, 1, [&](ChannelJob& job, SendList& sends) {
          std::vector<Transfer> sendTo, recvFrom;
          for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            Range s = plan_.split(sendCounts[p])[job.channel];
            s.offset += sendOffsets[p];
            sendTo.push_back({p, const_cast<uint8_t*>(bytesOf(in)), s, -1, pairUnit(sendCounts[p])});
            Range r = plan_.split(recvCounts[p])[job.channel];
            r.offset += recvOffsets[p];
            recvFrom.push_back({p, bytesOf(out), r, -1, pairUnit(recvCounts[p])});
          }
          directExchange(job, sendTo, recvFrom, sends);
        });
      },
      digest);
}

void Communicator::barrier(Millis timeout) {
  OpDescriptor desc;
  desc.kind = OpKind::kBarrier;
  run(desc, timeout, RdPayload{}, [](const OpContext&) {});
}

}  // namespace reccl
