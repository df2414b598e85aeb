#include "engine/communicator.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <set>

#include "core/config.h"
#include "core/health.h"
#include "core/log.h"
#include "core/topology.h"

namespace reccl {

CommOptions::CommOptions(const Config& config)
    : channels(config.channels),
      chunkBytes(static_cast<size_t>(config.chunkBytes)),
      window(config.window),
      smallBytes(static_cast<size_t>(config.smallBytes)),
      algo(config.algo),
      halvingBytesPerRank(static_cast<size_t>(config.halvingBytesPerRank)),
      rebalance(config.dcr),
      shares(config.shares && config.spread),
      dcrOffset(static_cast<uint64_t>(config.dcrOffset)) {}

Communicator::Communicator(std::shared_ptr<Transport> transport,
                           std::shared_ptr<Rendezvous> rendezvous, const std::string& prefix,
                           int rank, int size, CommOptions options)
    : rank_(rank),
      size_(size),
      options_(std::move(options)),
      plan_(options_.channels > 0 ? options_.channels
                                  : std::max<int>(1, static_cast<int>(transport->nics().size()))) {
  // The ranges are the settings table's (core/config.cc), as for RECCL_* values.
  checkOption("chunk_bytes", std::to_string(options_.chunkBytes));
  checkOption("channels", std::to_string(options_.channels));
  checkOption("window", std::to_string(options_.window));
  links_ = std::make_shared<Links>(std::move(transport), std::move(rendezvous), prefix, rank, size,
                                   plan_.channels(), options_.rendezvousTimeout);
  std::vector<int> ranks(size), units(size + 1);
  for (int r = 0; r <= size; ++r) {
    if (r < size) ranks[r] = r;
    units[r] = r;
  }
  // Large enough for the host exchange (one 64-bit identity per rank).
  flat_ =
      std::make_unique<RecursiveDoubling>(links_, ranks, units,
                                          std::max(options_.smallBytes, sizeof(uint64_t) * size));
  p2p_ = std::make_shared<P2p>(links_, options_.group);
  pool_ = std::make_unique<WorkerPool>();
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
  const Clock::time_point deadline = Clock::now() + timeout;
  flat_->flush(timeout);
  if (twoLevel_) {
    twoLevel_->flush(
        std::max(Millis(0), std::chrono::duration_cast<Millis>(deadline - Clock::now())));
  }
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
  if (opScratch_.size() < bytes) opScratch_.resize(bytes);
  return opScratch_.data();
}

RankFaults Communicator::sampleFaults() const {
  RankFaults faults;
  faults.opsDone = opsDone_.load();
  faults.nicsDown = links_->nicsDown();
  faults.nics = static_cast<uint32_t>(links_->nics());
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

std::vector<uint64_t> Communicator::currentShares() const {
  std::lock_guard<std::mutex> lock(planMutex_);
  return shareWeights_;
}

bool Communicator::sharesApply() const {
  return options_.shares && options_.algo != Algo::kHalving && size_ > 2 && layout_ &&
         !layout_->twoLevel();
}

bool Communicator::directFormLocked() const { return !shareWeights_.empty() || !plan_.equal(); }

void Communicator::adoptAgreement(const Agreement& agreement, uint64_t seq) {
  const uint64_t avoid =
      options_.rebalance ? agreement.backupChannels & allChannelsMask(plan_.channels()) : 0;
  std::optional<PlanProposal> next = advancePlan(plans_, avoid, seq, options_.dcrOffset);
  std::optional<SharePlan> nextShares;
  if (sharesApply()) {
    nextShares = advanceShares(shares_, agreedCapacities(agreement), seq, options_.dcrOffset);
  }
  bool directEnds = false;
  {
    std::lock_guard<std::mutex> lock(planMutex_);
    const bool directBefore = directFormLocked();
    if (nextShares) shareWeights_ = reccl::shareWeights(size_, nextShares->reduced);
    if (next || nextShares) {
      // Unequal shares keep every channel: a degraded host's connections
      // spread over its surviving NICs while the other hosts use all of theirs.
      plan_ = shareWeights_.empty()
                  ? planOf(plans_.current, plan_.channels())
                  : ChannelPlan(std::vector<uint64_t>(plan_.channels(), 1), plans_.current.id);
      current_ = plans_.current;
    }
    picture_.agreedAtOp = static_cast<int64_t>(seq);
    picture_.plan = plans_.pending ? *plans_.pending : plans_.current;
    picture_.maxOpsDone = agreement.maxOpsDone;
    picture_.degradedRanks = agreement.degradedRanks;
    picture_.listed = agreement.listed;
    directEnds = directBefore && !directFormLocked();
  }
  // Every rank adopts the same agreement at the same op, after every rank has
  // finished the ops before it: the direct form's connections are idle at both ends.
  if (directEnds) links_->releaseDirect();
  if (next) {
    const uint64_t avoided = next->avoidMask & allChannelsMask(plan_.channels());
    std::string detail = avoided == 0 ? "every channel carries data"
                                      : describeChannels(avoided) + " of " +
                                            std::to_string(plan_.channels()) +
                                            " carry no data (their paths run over backup NICs)";
    if (avoided != 0 && !shareWeights_.empty()) {
      detail += "; not in force while shares are unequal (every channel carries data)";
    }
    announce(seq, next->id, detail);
  }
  if (nextShares) {
    std::string detail = describeShares(shareWeights_);
    for (const RankCapacity& c : nextShares->reduced) {
      detail += (&c == &nextShares->reduced.front() ? " (usable bandwidth: rank " : ", rank ") +
                std::to_string(c.rank) + " " + std::to_string(c.capacity * 100 / kFullCapacity) +
                "%";
    }
    if (!nextShares->reduced.empty()) detail += ")";
    const uint64_t avoided = plans_.current.avoidMask & allChannelsMask(plan_.channels());
    if (shareWeights_.empty() && avoided != 0) {
      detail += "; DCR's plan in force: " + describeChannels(avoided) + " carry no data";
    }
    announce(seq, plan_.id(), detail);
  }
}

void Communicator::announce(uint64_t seq, uint64_t plan, const std::string& detail) const {
  Event event;
  event.kind = EventKind::kRebalance;
  event.wallNs = wallNs();
  event.group = options_.group;
  event.op = static_cast<int64_t>(seq);
  event.plan = static_cast<int64_t>(plan);
  event.detail = detail;
  RECCL_LOG(kInfo, "reccl: process group '" + options_.group + "' rank " + std::to_string(rank_) +
                       ": plan " + std::to_string(plan) + " from op " + std::to_string(seq) + ": " +
                       detail);
  NicHealth::instance().emit(std::move(event));
}

std::string Communicator::label(const OpDescriptor& desc) const {
  return std::string(opKindName(desc.kind)) + " #" + std::to_string(desc.seq) +
         " in process group '" + options_.group + "' (rank " + std::to_string(rank_) + " of " +
         std::to_string(size_) + ")";
}

void Communicator::checkUsable() const {
  std::string broken = error();
  if (!broken.empty()) {
    throw AbortedError("reccl: process group '" + options_.group +
                       "' cannot run more operations after an earlier failure: " + broken);
  }
}

void Communicator::guarded(const OpContext& ctx, const std::function<void()>& body) {
  try {
    body();
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
    std::string why = e.what();
    std::vector<int> gone = findGone(ctx, &why);
    abort(why);
    if (!gone.empty()) throw PeerGoneError(why, std::move(gone));
    throw;
  }
}

std::string Communicator::memberName(int rank) const {
  const int global = options_.globalRanks.empty() ? rank : options_.globalRanks.at(rank);
  return "rank " + std::to_string(rank) + " (global rank " + std::to_string(global) + ")";
}

std::vector<int> Communicator::findGone(const OpContext& ctx, std::string* why) {
  std::vector<int> gone = links_->peersGone();
  std::string foundBy = "this rank";
  if (!gone.empty()) {
    links_->reportGone(gone);  // before abort() closes the connections the others fail by
  } else {
    std::set<int> peers, reporters;
    for (const Links::GoneReport& report : links_->goneReports()) {
      if (report.peer < 0 || report.peer >= size_ || report.peer == rank_) continue;
      peers.insert(report.peer);
      reporters.insert(report.reporter);
    }
    if (peers.empty()) return {};
    gone.assign(peers.begin(), peers.end());
    foundBy = reporters.size() == 1 ? "rank " : "ranks ";
    for (int reporter : reporters) {
      foundBy += (reporter == *reporters.begin() ? "" : ", ") + std::to_string(reporter);
    }
  }
  std::string names;
  for (int rank : gone) names += (names.empty() ? "" : ", ") + memberName(rank);
  std::string here = *why;
  const std::string own = "reccl: " + ctx.label() + ": ";
  if (here.rfind(own, 0) == 0) here.erase(0, own.size());
  *why = "reccl: " + ctx.label() + " failed: the process of " + names +
         (gone.size() == 1 ? " is gone (" : " are gone (") + foundBy +
         (gone.size() == 1 ? " found its host" : " found their hosts") +
         " refusing connections and nothing coming from it for RECCL_PEER_GONE_TIMEOUT_MS); "
         "what failed here: " +
         here;
  return gone;
}

const Layout& Communicator::layout(OpKind kind, Millis timeout) {
  std::lock_guard<std::mutex> lock(opMutex_);
  checkUsable();
  return layoutLocked(kind, timeout);
}

std::shared_ptr<const Layout> Communicator::knownLayout() const {
  std::lock_guard<std::mutex> lock(planMutex_);
  return layout_;
}

std::vector<int> Communicator::agreementPartners() const {
  std::lock_guard<std::mutex> lock(planMutex_);
  return layout_ ? agreement_->partners() : std::vector<int>{};
}

const Layout& Communicator::layoutLocked(OpKind kind, Millis timeout) {
  if (agreement_) return *layout_;
  std::vector<uint64_t> hosts(size_, 0);
  hosts[rank_] = hostKeyOf(options_.host);
  if (size_ > 1) {
    OpDescriptor desc;
    desc.kind = kind;
    desc.seq = seq_;
    OpContext ctx(label(desc), Clock::now(), timeout, &aborted_);
    // The same descriptor on every rank: a mismatch of the op itself is the
    // agreement's to report, and must not cut the exchange short.
    Agreement agreement = Agreement::of(rank_, OpDescriptor{}, RankFaults{}, 0);
    guarded(ctx, [&] {
      flat_->run(ctx, agreement,
                 gatherPayload(reinterpret_cast<uint8_t*>(hosts.data()), sizeof(uint64_t), size_));
    });
  }
  auto layout = std::make_shared<const Layout>(hosts);
  if (layout->twoLevel()) {
    twoLevel_ = std::make_unique<RecursiveDoubling>(links_, layout->order(), layout->hostStarts(),
                                                    options_.smallBytes);
  }
  agreement_ = twoLevel_ ? twoLevel_.get() : flat_.get();
  std::lock_guard<std::mutex> lock(planMutex_);
  layout_ = std::move(layout);
  return *layout_;
}

void Communicator::run(OpDescriptor desc, Millis timeout, const RdPayload& payload,
                       const DataPhase& dataPhase, uint64_t countsDigest) {
  std::lock_guard<std::mutex> lock(opMutex_);
  checkUsable();
  layoutLocked(desc.kind, timeout);
  desc.seq = seq_++;
  // The share plan's id in the high half: ranks out of step on either fail the agreement.
  desc.planId = plan_.id() | (shares_.current.id << 32);
  desc.chunkBytes = options_.chunkBytes;
  desc.channels = static_cast<uint32_t>(plan_.channels());
  OpContext ctx(label(desc), Clock::now(), timeout, &aborted_);
  guarded(ctx, [&] {
    if (size_ > 1) {
      Agreement agreement = Agreement::of(rank_, desc, sampleFaults(), countsDigest);
      agreement_->run(ctx, agreement, payload);
      agreement.check(options_.group);
      if (agreement.countsDigest != 0) diagnoseAlltoall(ctx, desc);
      adoptAgreement(agreement, desc.seq);
    }
    // check() threw for a rejection already, but a group of one has no agreement.
    if (desc.rejection) throw MismatchError(rejectionMessage(options_.group, rank_, desc));
    dataPhase(ctx);
    opsDone_.fetch_add(1);
  });
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
  // It crosses the wire as raw bytes (the agreement's payload): pinned like the packed structs.
  static_assert(sizeof(PairVerdict) == 32 && offsetof(PairVerdict, sent) == 16,
                "all_to_all verdict wire size");
  std::vector<uint64_t> theirs(size_, 0);
  std::vector<std::shared_ptr<Request>> recvs(size_), sends(size_);
  for (int p = 0; p < size_; ++p) {
    if (p != rank_)
      recvs[p] = links_->receiver(p, 0, Lane::kCollective, ctx)
                     ->irecv(reinterpret_cast<uint8_t*>(&theirs[p]), sizeof(uint64_t));
  }
  for (int p = 0; p < size_; ++p) {
    if (p != rank_)
      sends[p] = links_->sender(p, 0, Lane::kCollective)
                     ->isend(reinterpret_cast<uint8_t*>(const_cast<uint64_t*>(&desc.sendCounts[p])),
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
      std::to_string(verdict.to) + " expects " + std::to_string(verdict.expected) + " from rank " +
      std::to_string(verdict.from) +
      ". Every rank of a group must call the same collectives in the same order with matching "
      "dtype, size, root and reduce op.");
}

void Communicator::forChannels(const OpContext& ctx, DataType dtype, size_t unit,
                               const std::function<void(ChannelJob&, SendList&)>& fn) {
  std::vector<std::function<void()>> jobs;
  for (int c = 0; c < plan_.channels(); ++c) {
    if (plan_.weight(c) == 0) continue;  // DCR: no traffic at all on this channel
    jobs.push_back([&, c] {
      ChannelJob job{*links_, *layout_,        ctx,        c, dtype, elementSize(dtype),
                     unit,    options_.window, scratch_[c]};
      SendList sends;
      fn(job, sends);
      sends.waitAll(job);
    });
  }
  pool_->runAll(jobs, [&ctx] { ctx.stop(); });
}

}  // namespace reccl
