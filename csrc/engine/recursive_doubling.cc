#include "engine/recursive_doubling.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

namespace reccl {

namespace {

// How much earlier each earlier stage gives up, so the rank nearest a missing
// one reports it before the others do.
Millis stageMargin(Millis timeout, int slots) {
  return std::clamp(Millis(timeout.count() / (2 * std::max(1, slots))), Millis(5), Millis(1000));
}

std::string seconds(Millis ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

std::atomic<uint64_t> exchangesRun{0};

std::string rankList(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace

uint64_t agreementsRun() { return exchangesRun.load(); }

RdSchedule::RdSchedule(int position, const std::vector<int>& units)
    : units_(units), position_(position), size_(units.back()) {
  const int count = static_cast<int>(units.size()) - 1;
  while (pow2_ * 2 <= count) {
    pow2_ *= 2;
    ++steps_;
  }
  rem_ = count - pow2_;
  for (int u = 0; u < count; ++u) {
    if (units[u + 1] - units[u] > 1) depth_ = 2;
  }
  const int unit =
      static_cast<int>(std::upper_bound(units.begin(), units.end(), position) - units.begin()) - 1;
  const int leader = units[unit];
  held_ = {position, position + 1};
  if (position != leader) {  // a member: its state goes to the leader, the result comes last
    parent_ = leader;
    parentStage_ = stages() - 1;
    return;
  }
  for (int p = leader + 1; p < units[unit + 1]; ++p) children_.push_back({p, p, p + 1, 0});
  held_ = {leader, units[unit + 1]};
  if (unit < 2 * rem_) {
    if (unit % 2 == 0) {  // folds into the next unit's leader
      parent_ = units[unit + 1];
      parentStage_ = depth_ + steps_;
      return;
    }
    children_.push_back({units[unit - 1], units[unit - 1], leader, depth_ - 1});
    held_.first = units[unit - 1];
  }
  newUnit_ = unit < 2 * rem_ ? unit / 2 : unit - rem_;
}

int RdSchedule::firstUnit(int newUnit) const {
  const int count = static_cast<int>(units_.size()) - 1;
  return newUnit < rem_ ? 2 * newUnit : std::min(count, newUnit + rem_);
}

int RdSchedule::leaderOfNewUnit(int newUnit) const {
  return units_[newUnit < rem_ ? 2 * newUnit + 1 : newUnit + rem_];
}

int RdSchedule::partner(int step) const { return leaderOfNewUnit(newUnit_ ^ (1 << step)); }

std::pair<int, int> RdSchedule::heldBefore(int step, bool partnerSide) const {
  if (step >= steps_) return {0, size_};
  const int block = 1 << step;
  const int v = partnerSide ? (newUnit_ ^ block) : newUnit_;
  const int first = v & ~(block - 1);
  return {units_[firstUnit(first)], units_[firstUnit(first + block)]};
}

namespace {

std::function<void(const uint8_t*, size_t, size_t, bool)> reduceMerge(uint8_t* state,
                                                                      DataType dtype, ReduceOp op) {
  const ReduceOp pairwise = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const size_t elem = elementSize(dtype);
  return [state, dtype, pairwise, elem](const uint8_t* theirs, size_t offset, size_t length,
                                        bool theirsLower) {
    uint8_t* mine = state + offset;
    const void* inputs[2] = {theirsLower ? static_cast<const void*>(theirs) : mine,
                             theirsLower ? static_cast<const void*>(mine) : theirs};
    reduceAll(mine, inputs, 2, length / elem, dtype, pairwise);
  };
}

}  // namespace

RdPayload reducePayload(uint8_t* state, size_t count, DataType dtype, ReduceOp op) {
  RdPayload p;
  p.data = state;
  p.bytes = count * elementSize(dtype);
  p.held = [bytes = p.bytes](int, int) { return std::pair<size_t, size_t>{0, bytes}; };
  p.merge = reduceMerge(state, dtype, op);
  return p;
}

RdPayload gatherPayload(uint8_t* state, size_t blockBytes, int size) {
  RdPayload p;
  p.data = state;
  p.bytes = blockBytes * static_cast<size_t>(size);
  p.held = [blockBytes](int lo, int hi) {
    return std::pair<size_t, size_t>{lo * blockBytes, (hi - lo) * blockBytes};
  };
  p.merge = [state](const uint8_t* theirs, size_t offset, size_t length, bool) {
    std::memcpy(state + offset, theirs, length);
  };
  return p;
}

RdPayload broadcastPayload(uint8_t* state, size_t bytes, int rootPosition) {
  RdPayload p;
  p.data = state;
  p.bytes = bytes;
  p.held = [bytes, rootPosition](int lo, int hi) {
    return std::pair<size_t, size_t>{0, lo <= rootPosition && rootPosition < hi ? bytes : 0};
  };
  p.merge = [state](const uint8_t* theirs, size_t offset, size_t length, bool) {
    std::memcpy(state + offset, theirs, length);
  };
  return p;
}

namespace {

int positionOf(const std::vector<int>& order, int rank) {
  return static_cast<int>(std::find(order.begin(), order.end(), rank) - order.begin());
}

}  // namespace

RecursiveDoubling::RecursiveDoubling(std::shared_ptr<Links> links, std::vector<int> order,
                                     std::vector<int> units, size_t payloadCapacity)
    : links_(std::move(links)),
      rank_(links_->rank()),
      size_(links_->size()),
      order_(std::move(order)),
      payloadCapacity_(payloadCapacity),
      schedule_(positionOf(order_, rank_), units) {
  slots_.resize(schedule_.children().size() + static_cast<size_t>(schedule_.steps()) + 1);
}

void RecursiveDoubling::flush(Millis timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (Slot& slot : slots_) {
    if (!slot.pending) continue;
    Millis left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (left.count() <= 0 || !slot.pending->wait(left)) return;
    slot.pending.reset();
  }
}

std::vector<int> RecursiveDoubling::partners() const {
  std::vector<int> ranks;
  if (schedule_.parent() >= 0) ranks.push_back(order_[schedule_.parent()]);
  for (const RdSchedule::Fold& child : schedule_.children())
    ranks.push_back(order_[child.position]);
  for (int s = 0; s < schedule_.steps(); ++s) ranks.push_back(order_[schedule_.partner(s)]);
  return ranks;
}

void RecursiveDoubling::send(const OpContext& ctx, int slotIndex, int peer,
                             const Agreement& agreement, const RdPayload& payload,
                             std::pair<size_t, size_t> span) {
  Slot& slot = slots_[slotIndex];
  // The previous op's send from this slot reached its peer long ago (the peer
  // answered it); the buffer is reused only now, so no op waits for its own.
  if (slot.pending) ctx.wait(*slot.pending, "the previous agreement message to", peer, 0);
  slot.pending.reset();
  const size_t bytes = kAgreementBytes + span.second;
  if (slot.tx.size() < bytes) slot.tx.resize(bytes);
  encodeAgreement(agreement, size_, slot.tx.data());
  if (span.second)
    std::memcpy(slot.tx.data() + kAgreementBytes, payload.data + span.first, span.second);
  slot.pending = links_->sender(peer, 0, Lane::kCollective)->isend(slot.tx.data(), bytes);
}

std::shared_ptr<Request> RecursiveDoubling::postReceive(int slotIndex, int peer, size_t bytes) {
  Slot& slot = slots_[slotIndex];
  if (slot.rx.size() < bytes) slot.rx.resize(bytes);
  std::shared_ptr<RecvConnection> from = links_->tryReceiver(peer, 0, Lane::kCollective);
  if (!from) return nullptr;  // not connected yet: receive() accepts it, bounded
  return from->irecv(slot.rx.data(), bytes);
}

Agreement RecursiveDoubling::receive(const OpContext& ctx, int slotIndex, int peer,
                                     const Request& request, Clock::time_point until, uint64_t* got,
                                     std::vector<int>* failure) {
  if (!ctx.waitUntil(request, until, "the agreement message from", peer, 0, got)) {
    *failure = {peer};
    return {};
  }
  Agreement theirs = decodeAgreement(slots_[slotIndex].rx.data(), *got, size_);
  if (theirs.failed) *failure = theirs.missing.empty() ? std::vector<int>{peer} : theirs.missing;
  return theirs;
}

void RecursiveDoubling::fail(const OpContext& ctx, std::vector<int> missing,
                             const std::vector<std::pair<int, int>>& waiting,
                             const Agreement& mine) {
  std::sort(missing.begin(), missing.end());
  Agreement verdict = mine;
  verdict.failed = true;
  verdict.missing = missing;
  if (verdict.missing.size() > static_cast<size_t>(kListedDegradedRanks)) {
    verdict.missing.resize(kListedDegradedRanks);
  }
  // Tell every partner still waiting for this rank, best effort and briefly:
  // they would otherwise blame this rank for what it waits on.
  const Clock::time_point until = Clock::now() + stageMargin(ctx.timeout(), schedule_.stages() + 1);
  std::vector<std::shared_ptr<Request>> notices;
  for (const auto& [slotIndex, peer] : waiting) {
    try {
      Slot& slot = slots_[slotIndex];
      if (slot.pending && !slot.pending->wait(Millis(0))) continue;
      if (slot.tx.size() < kAgreementBytes) slot.tx.resize(kAgreementBytes);
      encodeAgreement(verdict, size_, slot.tx.data());
      slot.pending =
          links_->sender(peer, 0, Lane::kCollective)->isend(slot.tx.data(), kAgreementBytes);
      notices.push_back(slot.pending);
    } catch (const std::exception&) {
      // The partner is unreachable too; it will time out on its own.
    }
  }
  for (const auto& notice : notices) {
    Millis left = std::chrono::duration_cast<Millis>(until - Clock::now());
    if (left.count() > 0) notice->wait(left);
  }
  throw TimeoutError("reccl: " + ctx.label() + " timed out after " + seconds(ctx.timeout()) +
                     ": rank(s) " + rankList(missing) +
                     " did not join it (every rank of the group must call the same collectives in "
                     "the same order), or their network paths are gone");
}

void RecursiveDoubling::run(const OpContext& ctx, Agreement& agreement, const RdPayload& payload) {
  if (size_ == 1) return;
  exchangesRun.fetch_add(1);
  const std::vector<RdSchedule::Fold>& children = schedule_.children();
  const int folds = static_cast<int>(children.size());
  const int steps = schedule_.steps();
  const int parentSlot = folds + steps;
  const int parent = schedule_.parent() >= 0 ? order_[schedule_.parent()] : -1;
  auto childRank = [&](int i) { return order_[children[i].position]; };
  auto partnerRank = [&](int step) { return order_[schedule_.partner(step)]; };
  if (!dialed_) {
    links_->dialAhead(partners(), 0, Lane::kCollective);
    dialed_ = true;
  }
  // The last stage too gives up a margin early, so a rank waiting for the
  // result from a missing parent names it as the verdict does.
  const Millis margin = stageMargin(ctx.timeout(), schedule_.stages() + 1);
  auto stageUntil = [&](int stage) {
    return ctx.deadline() - margin * (schedule_.stages() - stage);
  };
  auto span = [&](std::pair<int, int> positions) {
    return payload.bytes ? payload.held(positions.first, positions.second)
                         : std::pair<size_t, size_t>{0, 0};
  };
  if (payload.bytes > payloadCapacity_)
    throw Error("internal: recursive-doubling payload too large");
  const size_t maxBytes = kAgreementBytes + payloadCapacity_;
  // Receives from `peer` into `slotIndex`, accepting its connection first if
  // needed; both bounded by the stage's deadline.
  uint64_t got = 0;
  auto exchange = [&](int slotIndex, int stage, int peer, std::shared_ptr<Request> request,
                      std::vector<int>* failure) -> Agreement {
    const Clock::time_point until = stageUntil(stage);
    if (!request) {
      std::shared_ptr<RecvConnection> from =
          links_->receiverUntil(peer, 0, Lane::kCollective, ctx, until);
      if (!from) {
        *failure = {peer};
        return {};
      }
      request = from->irecv(slots_[slotIndex].rx.data(), maxBytes);
    }
    return receive(ctx, slotIndex, peer, *request, until, &got, failure);
  };
  // The peer's message must hold exactly the part of the payload its positions have.
  auto checkLength = [&](int peer, size_t expected) {
    if (got != kAgreementBytes + expected) {
      throw ProtocolError("reccl: " + ctx.label() + ": rank " + std::to_string(peer) + " sent " +
                          std::to_string(got) + " bytes of agreement and payload, expected " +
                          std::to_string(kAgreementBytes + expected));
    }
  };
  // Merges the payload part in `slotIndex` from `peer`, whose state holds `positions`.
  auto mergeFrom = [&](int slotIndex, int peer, std::pair<int, int> positions) {
    const std::pair<size_t, size_t> part = span(positions);
    checkLength(peer, part.second);
    if (part.second) {
      payload.merge(slots_[slotIndex].rx.data() + kAgreementBytes, part.first, part.second,
                    positions.first < schedule_.position());
    }
  };
  // The ranks still waiting for this one after `step`: the parent (until this
  // rank's state went to it), later partners, and the children for the result.
  auto waitingAfter = [&](int step, bool parentToo) {
    std::vector<std::pair<int, int>> waiting;
    if (parentToo && parent >= 0) waiting.push_back({parentSlot, parent});
    for (int s = step + 1; s < steps; ++s) waiting.push_back({folds + s, partnerRank(s)});
    for (int i = 0; i < folds; ++i) waiting.push_back({i, childRank(i)});
    return waiting;
  };
  std::vector<int> failure;

  std::vector<std::shared_ptr<Request>> foldRequests(folds);
  for (int i = 0; i < folds; ++i) foldRequests[i] = postReceive(i, childRank(i), maxBytes);
  for (int i = 0; i < folds; ++i) {
    const RdSchedule::Fold& child = children[i];
    Agreement theirs = exchange(i, child.stage, childRank(i), foldRequests[i], &failure);
    if (!failure.empty()) fail(ctx, failure, waitingAfter(-1, true), agreement);
    agreement.merge(theirs);
    // Once a mismatch is known the payloads may differ in size: they are moot.
    if (agreement.oddRank < 0) mergeFrom(i, childRank(i), {child.lo, child.hi});
  }
  if (parent >= 0) {
    std::shared_ptr<Request> request = postReceive(parentSlot, parent, maxBytes);
    send(ctx, parentSlot, parent, agreement, payload, span(schedule_.held()));
    Agreement result = exchange(parentSlot, schedule_.parentStage(), parent, request, &failure);
    if (!failure.empty()) fail(ctx, failure, waitingAfter(steps, false), agreement);
    agreement = result;
    const std::pair<size_t, size_t> all = span({0, size_});
    if (agreement.oddRank < 0) {
      checkLength(parent, all.second);
      if (all.second) {
        std::memcpy(payload.data + all.first, slots_[parentSlot].rx.data() + kAgreementBytes,
                    all.second);
      }
    }
  }
  for (int step = 0; step < steps; ++step) {
    const int slotIndex = folds + step;
    const int peer = partnerRank(step);
    std::shared_ptr<Request> request = postReceive(slotIndex, peer, maxBytes);
    send(ctx, slotIndex, peer, agreement, payload, span(schedule_.heldBefore(step, false)));
    Agreement theirs = exchange(slotIndex, schedule_.stepStage(step), peer, request, &failure);
    if (!failure.empty()) fail(ctx, failure, waitingAfter(step, false), agreement);
    agreement.merge(theirs);
    if (agreement.oddRank < 0) mergeFrom(slotIndex, peer, schedule_.heldBefore(step, true));
  }
  for (int i = 0; i < folds; ++i) send(ctx, i, childRank(i), agreement, payload, span({0, size_}));
}

}  // namespace reccl
