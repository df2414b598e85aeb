// Recursive doubling: every rank ends with the merge of every rank's state
// (an Agreement, plus an op payload such as a partial sum or gathered blocks)
// after log2(p) exchanges with one partner each, p the largest power of two
// <= N. When N is not a power of two the first 2(N-p) ranks first fold in
// pairs (even into odd) and the odd rank hands the result back at the end:
// two more messages. It runs over channel 0's collective connections, so a
// rank connects to O(log N) peers for it.
//
// Merges always combine the lower ranks' state with the higher ranks' in that
// order, so a payload reduction is computed the same way on both partners and
// every rank ends with the same bits.
//
// A partner that never answers: each step gives up a little before the op's
// deadline (the later the step, the later), names the missing partner and
// sends that verdict to every partner still waiting for it, so every rank
// reports the rank that really did not join, not just its own partner.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/request.h"
#include "engine/agreement.h"
#include "engine/data_type.h"
#include "engine/links.h"
#include "engine/op_context.h"
#include "engine/reduce_op.h"

namespace reccl {

// Who talks to whom, by original rank.
class RdSchedule {
 public:
  RdSchedule(int rank, int size);
  int steps() const { return steps_; }
  // Folded-out ranks give their state to foldPartner() first and get the
  // result back from it last; a folding-in rank (odd, < 2(N-p)) takes part
  // for both. foldPartner() is -1 for every other rank.
  bool foldedOut() const { return newRank_ < 0; }
  int foldPartner() const { return foldPartner_; }
  // The partner at `step` (0..steps-1); participants only.
  int partner(int step) const;
  // The original ranks [lo, hi) a participant's state holds before `step`
  // (step == steps(): every rank), for this rank or for its partner there.
  std::pair<int, int> heldBefore(int step, bool partnerSide) const;

 private:
  int firstOriginal(int newRank) const;  // the lowest original rank new rank `newRank` holds
  int original(int newRank) const;       // the original rank that takes part as `newRank`

  int rank_, size_, pow2_ = 1, rem_ = 0, steps_ = 0;
  int newRank_ = -1;
  int foldPartner_ = -1;
};

// The part of an op that travels with the agreement.
struct RdPayload {
  uint8_t* data = nullptr;  // this rank's state, merged in place
  size_t bytes = 0;
  // The bytes {offset, length} of the state that holders of ranks [lo, hi) have.
  std::function<std::pair<size_t, size_t>(int lo, int hi)> held;
  // Merges a partner's bytes (its state at [offset, offset + length)) into
  // data; `theirsLower`: the partner's ranks come before this rank's.
  std::function<void(const uint8_t* theirs, size_t offset, size_t length, bool theirsLower)> merge;
};

// The payloads of small collectives, `state` being this rank's buffer:
// - a reduction of `count` elements (every rank holds the whole vector; AVG
//   sums, the caller divides);
RdPayload reducePayload(uint8_t* state, size_t count, DataType dtype, ReduceOp op);
// - a gather of one `blockBytes` block per rank (rank r's at r * blockBytes);
RdPayload gatherPayload(uint8_t* state, size_t blockBytes, int size);
// - the root's `bytes` reaching everyone.
RdPayload broadcastPayload(uint8_t* state, size_t bytes, int root);

// Exchanges run by every RecursiveDoubling of the process (for stats).
uint64_t agreementsRun();

class RecursiveDoubling {
 public:
  // Receives are posted for up to `payloadCapacity` bytes of payload, so a
  // peer that (wrongly) calls another op cannot overrun them; every payload
  // must fit.
  RecursiveDoubling(std::shared_ptr<Links> links, int rank, int size, size_t payloadCapacity);

  // One exchange. `agreement`: this rank's in, the group's out. Throws
  // TimeoutError naming the ranks that did not join, or what the transport or
  // OpContext throw. The payload may be empty (bytes 0).
  void run(const OpContext& ctx, Agreement& agreement, const RdPayload& payload);
  // Waits (up to `timeout`) until the sends of the last exchange reached their
  // peers: an op completes without waiting for them.
  void flush(Millis timeout);

 private:
  struct Slot {
    std::vector<uint8_t> tx, rx;
    std::shared_ptr<Request> pending;  // the last send from tx
  };
  // Sends `agreement` and payload bytes [span) to `peer` from slot `slot`.
  void send(const OpContext& ctx, int slot, int peer, const Agreement& agreement,
            const RdPayload& payload, std::pair<size_t, size_t> span);
  // Posts a receive from `peer` into `slot` if its connection is accepted
  // already; nullptr otherwise (the caller accepts it, bounded).
  std::shared_ptr<Request> postReceive(int slot, int peer, size_t bytes);
  // Waits for a posted receive until the slot's stage deadline; decodes it.
  // A partner's failure verdict, or no answer in time, becomes `failure`.
  Agreement receive(const OpContext& ctx, int slot, int peer, const Request& request,
                    Clock::time_point until, uint64_t* got, std::vector<int>* failure);
  [[noreturn]] void fail(const OpContext& ctx, std::vector<int> missing,
                         const std::vector<std::pair<int, int>>& waiting, const Agreement& mine);

  std::shared_ptr<Links> links_;
  const int rank_, size_;
  const size_t payloadCapacity_;
  const RdSchedule schedule_;
  std::vector<Slot> slots_;  // fold, steps..., back
  bool dialed_ = false;      // every partner's connection started
};

}  // namespace reccl
