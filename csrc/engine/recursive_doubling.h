// Recursive doubling: every rank ends with the merge of every rank's state
// (an Agreement, plus an op payload such as a partial sum or gathered blocks).
// It runs over the group's positions (layout.h) cut into units of adjacent
// positions: flat, every position is a unit; two-level, every host is one.
// A unit's other members fold into its first position (the host leader: one
// message each, over the host), the leaders exchange log2(p) times with one
// partner each, p the largest power of two <= units, and the leader hands
// the result back to its members. When the units are not a power of two, the
// first 2(units-p) leaders first fold in pairs (even into odd) and the odd one
// hands the result back at the end: two more messages. It runs over channel
// 0's collective connections, so a rank connects to O(log N) peers for it.
//
// Every merge combines the lower positions' state with the higher ones' in
// that order, and a leader merges its members in position order, so a payload
// reduction is computed the same way wherever it is computed and every rank
// ends with the same bits.
//
// A rank that never answers: each stage gives up a little before the op's
// deadline (the later the stage, the later; the deeper in a fold, the earlier
// at the fold and the later for the result), names the missing rank and sends
// that verdict to every rank still waiting for this one, so every rank reports
// the rank that really did not join, not just its own partner.
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

// Who talks to whom, by position.
class RdSchedule {
 public:
  // `units[u]`: the first position of unit u; units.back(): the group size.
  RdSchedule(int position, const std::vector<int>& units);
  int position() const { return position_; }

  // A state folded into this position before the steps, in merge order.
  struct Fold {
    int position;
    int lo, hi;  // the positions its state holds
    int stage;
  };
  const std::vector<Fold>& children() const { return children_; }
  // Where this position folds into (-1: it takes part in the steps) and the
  // stage at which the result comes back from there.
  int parent() const { return parent_; }
  int parentStage() const { return parentStage_; }
  // The positions this position's state holds once its children are merged.
  std::pair<int, int> held() const { return held_; }
  // Steps between the leaders; 0 for a position with a parent.
  int steps() const { return parent_ < 0 ? steps_ : 0; }
  int partner(int step) const;
  int stepStage(int step) const { return depth_ + step; }
  // The positions [lo, hi) a participant's state holds before `step`
  // (step == steps(): every position), for this position or for its partner.
  std::pair<int, int> heldBefore(int step, bool partnerSide) const;
  // Stages of the whole exchange (the same at every position).
  int stages() const { return 2 * depth_ + steps_; }

 private:
  int leaderOfNewUnit(int newUnit) const;  // the unit that takes part as `newUnit`
  int firstUnit(int newUnit) const;        // the lowest unit new unit `newUnit` holds

  std::vector<int> units_;
  int position_, size_, pow2_ = 1, rem_ = 0, steps_ = 0, depth_ = 1;
  int newUnit_ = -1;
  std::vector<Fold> children_;
  int parent_ = -1, parentStage_ = -1;
  std::pair<int, int> held_;
};

// The part of an op that travels with the agreement.
struct RdPayload {
  uint8_t* data = nullptr;  // this rank's state, merged in place
  size_t bytes = 0;
  // The bytes {offset, length} of the state that holders of positions [lo, hi) have.
  std::function<std::pair<size_t, size_t>(int lo, int hi)> held;
  // Merges a partner's bytes (its state at [offset, offset + length)) into
  // data; `theirsLower`: the partner's positions come before this rank's.
  std::function<void(const uint8_t* theirs, size_t offset, size_t length, bool theirsLower)> merge;
};

// The payloads of small collectives, `state` being this rank's buffer:
// - a reduction of `count` elements (every rank holds the whole vector; AVG
//   sums, the caller divides);
RdPayload reducePayload(uint8_t* state, size_t count, DataType dtype, ReduceOp op);
// - a gather of one `blockBytes` block per position (position p's at
//   p * blockBytes);
RdPayload gatherPayload(uint8_t* state, size_t blockBytes, int size);
// - the bytes of the root (at position `rootPosition`) reaching everyone.
RdPayload broadcastPayload(uint8_t* state, size_t bytes, int rootPosition);

// Exchanges run by every RecursiveDoubling of the process (for stats).
uint64_t agreementsRun();

class RecursiveDoubling {
 public:
  // Over the positions `order` (position -> rank) cut into `units` (see
  // RdSchedule). Receives are posted for up to `payloadCapacity` bytes of
  // payload, so a peer that (wrongly) calls another op cannot overrun them;
  // every payload must fit.
  RecursiveDoubling(std::shared_ptr<Links> links, std::vector<int> order, std::vector<int> units,
                    size_t payloadCapacity);

  // One exchange. `agreement`: this rank's in, the group's out. Throws
  // TimeoutError naming the ranks that did not join, or what the transport or
  // OpContext throw. The payload may be empty (bytes 0).
  void run(const OpContext& ctx, Agreement& agreement, const RdPayload& payload);
  // Waits (up to `timeout`) until the sends of the last exchange reached their
  // peers: an op completes without waiting for them.
  void flush(Millis timeout);
  // The ranks this rank exchanges with: parent, children, step partners.
  std::vector<int> partners() const;

 private:
  struct Slot {
    std::vector<uint8_t> tx, rx;
    std::shared_ptr<Request> pending;  // the last send from tx
  };
  // Sends `agreement` and payload bytes [span) to `peer` (a rank) from slot `slot`.
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
  const std::vector<int> order_;  // position -> rank
  const size_t payloadCapacity_;
  const RdSchedule schedule_;
  std::vector<Slot> slots_;  // children..., steps..., parent
  bool dialed_ = false;      // every partner's connection started
};

}  // namespace reccl
