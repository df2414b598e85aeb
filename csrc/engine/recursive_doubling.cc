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

RdSchedule::RdSchedule(int rank, int size) : rank_(rank), size_(size) {
  while (pow2_ * 2 <= size) {
    pow2_ *= 2;
    ++steps_;
  }
  rem_ = size - pow2_;
  if (rank < 2 * rem_) {
    newRank_ = rank % 2 == 1 ? rank / 2 : -1;
    foldPartner_ = rank % 2 == 1 ? rank - 1 : rank + 1;
  } else {
    newRank_ = rank - rem_;
  }
}

int RdSchedule::firstOriginal(int newRank) const {
  return newRank < rem_ ? 2 * newRank : std::min(size_, newRank + rem_);
}

int RdSchedule::original(int newRank) const {
  return newRank < rem_ ? 2 * newRank + 1 : newRank + rem_;
}

int RdSchedule::partner(int step) const { return original(newRank_ ^ (1 << step)); }

std::pair<int, int> RdSchedule::heldBefore(int step, bool partnerSide) const {
  if (step >= steps_) return {0, size_};
  const int block = 1 << step;
  const int v = partnerSide ? (newRank_ ^ block) : newRank_;
  const int first = v & ~(block - 1);
  return {firstOriginal(first), firstOriginal(first + block)};
}

namespace {

std::function<void(const uint8_t*, size_t, size_t, bool)> reduceMerge(uint8_t* state, DataType dtype,
                                                                   ReduceOp op) {
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

RdPayload broadcastPayload(uint8_t* state, size_t bytes, int root) {
  RdPayload p;
  p.data = state;
  p.bytes = bytes;
  p.held = [bytes, root](int lo, int hi) {
    return std::pair<size_t, size_t>{0, lo <= root && root < hi ? bytes : 0};
  };
  p.merge = [state](const uint8_t* theirs, size_t offset, size_t length, bool) {
    std::memcpy(state + offset, theirs, length);
  };
  return p;
}

RecursiveDoubling::RecursiveDoubling(std::shared_ptr<Links> links, int rank, int size,
                                     size_t payloadCapacity)
    : links_(std::move(links)),
      rank_(rank),
      size_(size),
      payloadCapacity_(payloadCapacity),
      schedule_(rank, size) {
  slots_.resize(static_cast<size_t>(schedule_.steps()) + 2);
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
  if (span.second) std::memcpy(slot.tx.data() + kAgreementBytes, payload.data + span.first, span.second);
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
                                     const Request& request, Clock::time_point until,
                                     uint64_t* got, std::vector<int>* failure) {
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
  const Clock::time_point until =
      Clock::now() + stageMargin(ctx.timeout(), static_cast<int>(slots_.size()));
  std::vector<std::shared_ptr<Request>> notices;
  for (const auto& [slotIndex, peer] : waiting) {
    try {
      Slot& slot = slots_[slotIndex];
      if (slot.pending && !slot.pending->wait(Millis(0))) continue;
      if (slot.tx.size() < kAgreementBytes) slot.tx.resize(kAgreementBytes);
      encodeAgreement(verdict, size_, slot.tx.data());
      slot.pending = links_->sender(peer, 0, Lane::kCollective)->isend(slot.tx.data(), kAgreementBytes);
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
  const int steps = schedule_.steps();
  if (!dialed_) {
    std::vector<int> partners;
    if (schedule_.foldPartner() >= 0) partners.push_back(schedule_.foldPartner());
    if (!schedule_.foldedOut()) {
      for (int s = 0; s < steps; ++s) partners.push_back(schedule_.partner(s));
    }
    links_->dialAhead(partners, 0, Lane::kCollective);
    dialed_ = true;
  }
  const int backSlot = steps + 1;
  const Millis margin = stageMargin(ctx.timeout(), static_cast<int>(slots_.size()));
  auto stageUntil = [&](int slotIndex) { return ctx.deadline() - margin * (backSlot - slotIndex); };
  auto span = [&](std::pair<int, int> ranks) {
    return payload.bytes ? payload.held(ranks.first, ranks.second) : std::pair<size_t, size_t>{0, 0};
  };
  if (payload.bytes > payloadCapacity_) throw Error("internal: recursive-doubling payload too large");
  const size_t maxBytes = kAgreementBytes + payloadCapacity_;
  // Receives from `peer` into `slotIndex`, accepting its connection first if
  // needed; both bounded by the stage's deadline.
  uint64_t got = 0;
  auto exchange = [&](int slotIndex, int peer, std::shared_ptr<Request> request,
                      std::vector<int>* failure) -> Agreement {
    const Clock::time_point until = stageUntil(slotIndex);
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
  // The partner's message must hold exactly the part of the payload its ranks have.
  auto checkLength = [&](int peer, size_t expected) {
    if (got != kAgreementBytes + expected) {
      throw ProtocolError("reccl: " + ctx.label() + ": rank " + std::to_string(peer) + " sent " +
                          std::to_string(got) + " bytes of agreement and payload, expected " +
                          std::to_string(kAgreementBytes + expected));
    }
  };
  // Later partners that wait for this rank, for the failure verdict.
  auto waitingAfter = [&](int step) {
    std::vector<std::pair<int, int>> waiting;
    for (int s = step + 1; s < steps; ++s) waiting.push_back({1 + s, schedule_.partner(s)});
    if (schedule_.foldPartner() >= 0) waiting.push_back({backSlot, schedule_.foldPartner()});
    return waiting;
  };
  std::vector<int> failure;

  if (schedule_.foldedOut()) {
    const int peer = schedule_.foldPartner();
    std::shared_ptr<Request> request = postReceive(backSlot, peer, maxBytes);
    send(ctx, 0, peer, agreement, payload, span({rank_, rank_ + 1}));
    Agreement result = exchange(backSlot, peer, request, &failure);
    if (!failure.empty()) fail(ctx, failure, {}, agreement);
    agreement = result;
    if (agreement.oddRank >= 0) return;  // a mismatch: the payload is moot
    const std::pair<size_t, size_t> all = span({0, size_});
    checkLength(peer, all.second);
    if (all.second) {
      std::memcpy(payload.data + all.first, slots_[backSlot].rx.data() + kAgreementBytes, all.second);
    }
    return;
  }
  if (schedule_.foldPartner() >= 0) {
    const int peer = schedule_.foldPartner();
    Agreement theirs = exchange(0, peer, postReceive(0, peer, maxBytes), &failure);
    if (!failure.empty()) fail(ctx, failure, waitingAfter(-1), agreement);
    agreement.merge(theirs);
    // Once a mismatch is known the payloads may differ in size: they are moot.
    if (agreement.oddRank < 0) {
      const std::pair<size_t, size_t> part = span({peer, peer + 1});
      checkLength(peer, part.second);
      if (part.second) payload.merge(slots_[0].rx.data() + kAgreementBytes, part.first, part.second, true);
    }
  }
  for (int step = 0; step < steps; ++step) {
    const int slotIndex = 1 + step;
    const int peer = schedule_.partner(step);
    std::shared_ptr<Request> request = postReceive(slotIndex, peer, maxBytes);
    send(ctx, slotIndex, peer, agreement, payload, span(schedule_.heldBefore(step, false)));
    Agreement theirs = exchange(slotIndex, peer, request, &failure);
    if (!failure.empty()) fail(ctx, failure, waitingAfter(step), agreement);
    agreement.merge(theirs);
    if (agreement.oddRank < 0) {
      const std::pair<size_t, size_t> part = span(schedule_.heldBefore(step, true));
      checkLength(peer, part.second);
      if (part.second) {
        payload.merge(slots_[slotIndex].rx.data() + kAgreementBytes, part.first, part.second,
                      peer < rank_);
      }
    }
  }
  if (schedule_.foldPartner() >= 0) {
    send(ctx, backSlot, schedule_.foldPartner(), agreement, payload, span({0, size_}));
  }
}

}  // namespace reccl
