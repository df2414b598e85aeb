#include "engine/communicator.h"

#include <algorithm>
#include <cstdio>
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

std::string seconds(Millis ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

uint8_t* bytesOf(void* p) { return static_cast<uint8_t*>(p); }
const uint8_t* bytesOf(const void* p) { return static_cast<const uint8_t*>(p); }

void copyIfDistinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memmove(dst, src, bytes);
}


}  // namespace

Communicator::Communicator(std::shared_ptr<Transport> transport, Rendezvous& rendezvous,
                           const std::string& prefix, int rank, int size, CommOptions options)
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
  ControlSettings control = options_.control;
  control.enabled = control.enabled && size > 1;
  // Before the handles' rendezvous, so every rank's control keys exist once it is done.
  control_ = std::make_unique<ControlPlane>(control.enabled ? rendezvous.sideChannel() : nullptr,
                                            prefix, rank, size, plan_.channels(), control,
                                            [this] { return sampleState(); });
  links_ = std::make_shared<Links>(std::move(transport), rendezvous, prefix, rank, size,
                                   plan_.channels(), options_.rendezvousTimeout);
  p2p_ = std::make_shared<P2p>(links_, options_.group);
  pool_ = std::make_unique<WorkerPool>(plan_.channels() - 1);
  scratch_.resize(plan_.channels());
  txBuffers_.resize(size_);
  txPending_.resize(size_);
  rxBuffers_.resize(size_);
  control_->start();
}

Communicator::~Communicator() {
  control_->stop();
  links_->close();
  pool_.reset();
}

std::string Communicator::error() const {
  std::lock_guard<std::mutex> lock(errorMutex_);
  return error_;
}

void Communicator::flush(Millis timeout) {
  std::lock_guard<std::mutex> lock(opMutex_);
  const Clock::time_point deadline = Clock::now() + timeout;
  for (auto& pending : txPending_) {
    if (!pending) continue;
    Millis left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (left.count() <= 0 || !pending->wait(left)) return;
    pending.reset();
  }
}

void Communicator::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(errorMutex_);
    if (error_.empty()) error_ = why;
  }
  aborted_.store(true);
  control_->stop();
  links_->close();
}

uint8_t* Communicator::opScratch(size_t bytes) {
  // Kept between ops: a fresh allocation this large is mmapped by malloc and
  // page-faulted in again by every op (a 5x cliff from 32 MiB up).
  if (opScratch_.size() < bytes) opScratch_.resize(bytes);
  return opScratch_.data();
}

RankState Communicator::sampleState() const {
  RankState state;
  state.opsDone = opsDone_.load();
  state.nicsDown = links_->nicsDown();
  state.backupChannels = links_->channelsOnBackup(state.nicsDown);
  std::lock_guard<std::mutex> lock(planMutex_);
  if (deviceOps_) state.deviceOps = deviceOps_();
  return state;
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

GroupView Communicator::groupView() const { return control_->view(); }

void Communicator::adoptPlan(const std::vector<OpDescriptor>& all, uint64_t seq) {
  std::vector<PlanProposal> carried;
  carried.reserve(all.size());
  for (const auto& d : all) carried.push_back(d.proposal);
  std::optional<PlanProposal> next = planToAdopt(plan_.id(), carried, seq);
  if (!next) return;
  {
    std::lock_guard<std::mutex> lock(planMutex_);
    plan_ = planOf(*next, plan_.channels());
    current_ = *next;
  }
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

void Communicator::run(OpDescriptor desc, Millis timeout,
                       const std::function<Inline(int peer)>& payloadTo, const Body& body) {
  std::lock_guard<std::mutex> lock(opMutex_);
  std::string broken = error();
  if (!broken.empty()) {
    throw AbortedError("reccl: process group '" + options_.group +
                       "' cannot run more operations after an earlier failure: " + broken);
  }
  desc.seq = seq_++;
  desc.planId = plan_.id();
  desc.proposal = control_->view().plan;
  desc.chunkBytes = options_.chunkBytes;
  desc.channels = static_cast<uint32_t>(plan_.channels());
  OpContext ctx(label(desc), Clock::now(), timeout, &aborted_);
  try {
    std::vector<OpDescriptor> all;
    std::vector<Inline> inlineFrom;
    exchange(ctx, desc, payloadTo, &all, &inlineFrom);
    checkConsistent(all, options_.group);
    adoptPlan(all, desc.seq);
    body(ctx, inlineFrom);
    opsDone_.fetch_add(1);
  } catch (const MismatchError&) {
    throw;  // every rank saw it after a complete exchange: the streams are intact
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

void Communicator::exchange(const OpContext& ctx, const OpDescriptor& mine,
                            const std::function<Inline(int peer)>& payloadTo,
                            std::vector<OpDescriptor>* all, std::vector<Inline>* inlineFrom) {
  all->assign(size_, OpDescriptor{});
  (*all)[rank_] = mine;
  inlineFrom->assign(size_, Inline{});
  if (size_ == 1) return;
  const size_t capacity = kDescriptorBytes + 2 * sizeof(uint64_t) * size_ + kInlineBytes;
  std::vector<std::shared_ptr<SendConnection>> to(size_);
  std::vector<std::shared_ptr<RecvConnection>> from(size_);
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) to[p] = links_->sender(p, 0, Lane::kCollective);
  }
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) from[p] = links_->receiver(p, 0, Lane::kCollective, ctx);
  }
  std::vector<std::shared_ptr<Request>> recvs(size_);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    if (rxBuffers_[p].size() < capacity) rxBuffers_[p].resize(capacity);
    recvs[p] = from[p]->irecv(rxBuffers_[p].data(), capacity);
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    // The previous op's descriptor to p completed long ago (p answered it);
    // its buffer is reused only now, so no op waits for the ACK of its own.
    if (txPending_[p]) ctx.wait(*txPending_[p], "the previous descriptor to", p, 0);
    txPending_[p].reset();
    Inline payload = payloadTo(p);
    if (payload.bytes > kInlineBytes) throw Error("internal: inline payload too large");
    if (txBuffers_[p].size() < capacity) txBuffers_[p].resize(capacity);
    size_t head = encodeDescriptor(mine, rank_, size_, static_cast<uint32_t>(payload.bytes),
                                   txBuffers_[p].data());
    if (payload.bytes) std::memcpy(txBuffers_[p].data() + head, payload.data, payload.bytes);
    txPending_[p] = to[p]->isend(txBuffers_[p].data(), head + payload.bytes);
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    uint64_t got = 0;
    try {
      got = ctx.wait(*recvs[p], "the descriptor from", p, 0);
    } catch (const TimeoutError&) {
      std::string missing;
      for (int q = 0; q < size_; ++q) {
        uint64_t bytes;
        std::string err;
        if (q != rank_ && !recvs[q]->test(&bytes, &err)) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(q);
        }
      }
      throw TimeoutError("reccl: " + ctx.label() + " timed out after " + seconds(ctx.timeout()) +
                         ": rank(s) " + missing +
                         " did not join it (every rank of the group must call the same "
                         "collectives in the same order), or their network paths are gone");
    }
    DecodedDescriptor d = decodeDescriptor(rxBuffers_[p].data(), got, size_);
    if (d.sender != p) {
      throw ProtocolError("descriptor from rank " + std::to_string(p) + " claims to be from rank " +
                          std::to_string(d.sender));
    }
    (*all)[p] = d.desc;
    (*inlineFrom)[p] = Inline{d.payload, d.payloadBytes};
  }
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

void checkInlineBytes(const char* what, int peer, size_t got, size_t expected) {
  if (got != expected) {
    throw ProtocolError(std::string("reccl: ") + what + ": rank " + std::to_string(peer) +
                        " sent " + std::to_string(got) + " inline bytes, expected " +
                        std::to_string(expected));
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

// Small messages: reduces every rank's payload (this rank's at `mine`, the
// peers' inline) into `out`.
void Communicator::reduceInline(const char* what, const std::vector<Inline>& from, int rank,
                                const void* mine, void* out, size_t count, DataType dtype,
                                ReduceOp op) {
  const size_t bytes = count * elementSize(dtype);
  std::vector<const void*> inputs(from.size());
  for (size_t p = 0; p < from.size(); ++p) {
    const int peer = static_cast<int>(p);
    if (peer != rank) checkInlineBytes(what, peer, from[p].bytes, bytes);
    inputs[p] = peer == rank ? mine : from[p].data;
  }
  reduceAll(out, inputs.data(), static_cast<int>(from.size()), count, dtype, op);
}

// Small messages: copies every peer's inline payload into its block of `out`.
void Communicator::gatherInline(const char* what, const std::vector<Inline>& from, int rank,
                                void* out, size_t bytes) {
  for (size_t p = 0; p < from.size(); ++p) {
    const int peer = static_cast<int>(p);
    if (peer == rank) continue;
    checkInlineBytes(what, peer, from[p].bytes, bytes);
    if (bytes) std::memcpy(bytesOf(out) + p * bytes, from[p].data, bytes);
  }
}

void Communicator::allreduce(const void* in, void* out, size_t count, DataType dtype,
                             ReduceOp op, Millis timeout) {
  checkReduceOp(op, dtype);
  const size_t bytes = count * elementSize(dtype);
  const bool small = bytes <= kInlineBytes;
  const OpDescriptor desc = OpDescriptor::of(OpKind::kAllreduce, dtype, count, -1, op);
  run(desc, timeout,
      [&](int) { return small ? Inline{bytesOf(in), bytes} : Inline{}; },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        if (size_ == 1) return copyIfDistinct(out, in, bytes);
        if (small) {
          reduceInline("all_reduce", from, rank_, in, out, count, dtype, op);
          return;
        }
        copyIfDistinct(out, in, bytes);
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
  const bool small = bytes <= kInlineBytes;
  const OpDescriptor desc = OpDescriptor::of(OpKind::kBroadcast, dtype, count, root);
  run(desc, timeout,
      [&](int) { return small && rank_ == root ? Inline{bytesOf(buffer), bytes} : Inline{}; },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        if (size_ == 1) return;
        if (small) {
          if (rank_ != root) {
            checkInlineBytes("broadcast", root, from[root].bytes, bytes);
            if (bytes) std::memcpy(buffer, from[root].data, bytes);
          }
          return;
        }
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
  const bool small = bytes <= kInlineBytes;
  const OpDescriptor desc = OpDescriptor::of(OpKind::kReduce, dtype, count, root, op);
  run(desc, timeout,
      [&](int peer) { return small && peer == root ? Inline{bytesOf(in), bytes} : Inline{}; },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        if (size_ == 1) return copyIfDistinct(out, in, bytes);
        if (small) {
          if (rank_ != root) return;
          reduceInline("reduce", from, rank_, in, out, count, dtype, op);
          return;
        }
        // Ring reduce-scatter (rank r ends with segment r reduced), then every
        // rank sends its segment to the root.
        uint8_t* work;
        if (rank_ == root) {
          copyIfDistinct(out, in, bytes);
          work = bytesOf(out);
        } else {
          work = opScratch(bytes);
          std::memcpy(work, in, bytes);
        }
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
  const bool small = bytes <= kInlineBytes;
  const OpDescriptor desc = OpDescriptor::of(OpKind::kAllgather, dtype, count);
  run(desc, timeout, [&](int) { return small ? Inline{bytesOf(in), bytes} : Inline{}; },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        copyIfDistinct(bytesOf(out) + rank_ * bytes, in, bytes);
        if (size_ == 1) return;
        if (small) {
          gatherInline("all_gather", from, rank_, out, bytes);
          return;
        }
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
  const bool small = bytes <= kInlineBytes;
  const OpDescriptor desc = OpDescriptor::of(OpKind::kReduceScatter, dtype, count, -1, op);
  run(desc, timeout,
      [&](int peer) { return small ? Inline{bytesOf(in) + peer * bytes, bytes} : Inline{}; },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        if (size_ == 1) return copyIfDistinct(out, in, bytes);
        if (small) {
          reduceInline("reduce_scatter", from, rank_, bytesOf(in) + rank_ * bytes, out, count,
                       dtype, op);
          return;
        }
        uint8_t* work = opScratch(bytes * size_);
        std::memcpy(work, in, bytes * size_);
        const std::vector<Range> ranges = plan_.split(count);
        const size_t unit = chunkElems(dtype, largestRange(ranges), size_ - 1);
        forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
          const Range range = ranges[job.channel];
          SegmentFn seg = [&](int j) { return Range{j * count + range.offset, range.count}; };
          RegionSends regions(size_);
          ringReduceScatter(job, work, seg, rank_, op, regions, sends);
        });
        std::memcpy(out, work + rank_ * bytes, bytes);
      });
}

void Communicator::gather(const void* in, void* out, size_t count, DataType dtype, int root,
                          Millis timeout) {
  checkRoot(root, size_);
  const size_t bytes = count * elementSize(dtype);
  const bool small = bytes <= kInlineBytes;
  const OpDescriptor desc = OpDescriptor::of(OpKind::kGather, dtype, count, root);
  run(desc, timeout,
      [&](int peer) { return small && peer == root ? Inline{bytesOf(in), bytes} : Inline{}; },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        if (rank_ == root) copyIfDistinct(bytesOf(out) + root * bytes, in, bytes);
        if (size_ == 1) return;
        if (small) {
          if (rank_ != root) return;
          gatherInline("gather", from, rank_, out, bytes);  // only on the root
          return;
        }
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
  const bool small = bytes <= kInlineBytes;
  const OpDescriptor desc = OpDescriptor::of(OpKind::kScatter, dtype, count, root);
  run(desc, timeout,
      [&](int peer) {
        return small && rank_ == root ? Inline{bytesOf(in) + peer * bytes, bytes} : Inline{};
      },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        if (rank_ == root) copyIfDistinct(out, bytesOf(in) + root * bytes, bytes);
        if (size_ == 1) return;
        if (small) {
          if (rank_ == root) return;
          checkInlineBytes("scatter", root, from[root].bytes, bytes);
          if (bytes) std::memcpy(out, from[root].data, bytes);
          return;
        }
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
  auto isInline = [&](uint64_t count) { return count * elem <= kInlineBytes; };
  auto pairUnit = [&](uint64_t count) {
    size_t base = std::max<size_t>(1, options_.chunkBytes / elem);
    return std::max<size_t>(base, (count + kMaxChunksPerTransfer - 1) / kMaxChunksPerTransfer);
  };
  OpDescriptor desc;
  desc.kind = OpKind::kAlltoall;
  desc.dtype = dtype;
  desc.sendCounts = sendCounts;
  desc.recvCounts = recvCounts;
  run(desc, timeout,
      [&](int peer) {
        return isInline(sendCounts[peer])
                   ? Inline{bytesOf(in) + sendOffsets[peer] * elem, sendCounts[peer] * elem}
                   : Inline{};
      },
      [&](const OpContext& ctx, const std::vector<Inline>& from) {
        copyIfDistinct(bytesOf(out) + recvOffsets[rank_] * elem,
                       bytesOf(in) + sendOffsets[rank_] * elem, sendCounts[rank_] * elem);
        bool large = false;
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          if (isInline(recvCounts[p])) {
            checkInlineBytes("all_to_all", p, from[p].bytes, recvCounts[p] * elem);
            if (recvCounts[p]) {
              std::memcpy(bytesOf(out) + recvOffsets[p] * elem, from[p].data, recvCounts[p] * elem);
            }
          } else {
            large = true;
          }
          if (!isInline(sendCounts[p])) large = true;
        }
        if (!large) return;
        forChannels(ctx, dtype, 1, [&](ChannelJob& job, SendList& sends) {
          std::vector<Transfer> sendTo, recvFrom;
          for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            if (!isInline(sendCounts[p])) {
              Range r = plan_.split(sendCounts[p])[job.channel];
              r.offset += sendOffsets[p];
              sendTo.push_back({p, const_cast<uint8_t*>(bytesOf(in)), r, -1, pairUnit(sendCounts[p])});
            }
            if (!isInline(recvCounts[p])) {
              Range r = plan_.split(recvCounts[p])[job.channel];
              r.offset += recvOffsets[p];
              recvFrom.push_back({p, bytesOf(out), r, -1, pairUnit(recvCounts[p])});
            }
          }
          directExchange(job, sendTo, recvFrom, sends);
        });
      });
}

void Communicator::barrier(Millis timeout) {
  OpDescriptor desc;
  desc.kind = OpKind::kBarrier;
  run(desc, timeout, [](int) { return Inline{}; },
      [](const OpContext&, const std::vector<Inline>&) {});
}

}  // namespace reccl
