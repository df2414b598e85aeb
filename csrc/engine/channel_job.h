// What one channel of one collective works with: the connections (through
// Links), the group's layout (the ring order), the op's context, the element type, the pipelining
// unit and the channel's staging memory; plus the bookkeeping of sends in flight.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/request.h"
#include "engine/channel_plan.h"
#include "engine/data_type.h"
#include "engine/layout.h"
#include "engine/links.h"
#include "engine/op_context.h"

namespace reccl {

struct ChannelJob {
  Links& links;
  const Layout& layout;
  const OpContext& ctx;
  int channel;
  DataType dtype;
  size_t elem;          // bytes per element
  size_t chunkElems;    // pipelining unit, in elements (>= 1)
  int window;           // receives posted ahead
  std::vector<uint8_t>& scratch;  // staging, grown as needed

  int rank() const { return links.rank(); }
  int size() const { return links.size(); }
  int mod(int i) const { return ((i % size()) + size()) % size(); }
  // This rank's place in the ring order, and the rank `steps` places on.
  int position() const { return layout.position(rank()); }
  int ringRank(int steps) const { return layout.rankAt(mod(position() + steps)); }
  size_t chunksOf(size_t count) const { return (count + chunkElems - 1) / chunkElems; }
};

// Every send of one channel of one op, awaited before the op completes (a send
// completes when the receiver has every byte, so the buffer is free again).
class SendList {
 public:
  void add(std::shared_ptr<Request> request, int peer) {
    sends_.push_back({std::move(request), peer});
  }
  void waitAll(const ChannelJob& job) {
    for (auto& s : sends_) job.ctx.wait(*s.request, "send to", s.peer, job.channel);
    sends_.clear();
  }

 private:
  struct Entry {
    std::shared_ptr<Request> request;
    int peer;
  };
  std::vector<Entry> sends_;
};

// The send that last read each (segment, chunk) of a working buffer, so a
// receive into that region is posted only once the send no longer reads it.
class RegionSends {
 public:
  explicit RegionSends(int segments) : bySegment_(segments) {}
  void put(int segment, size_t chunk, std::shared_ptr<Request> request) {
    auto& v = bySegment_.at(segment);
    if (v.size() <= chunk) v.resize(chunk + 1);
    v[chunk] = std::move(request);
  }
  // Waits for the send that read (segment, chunk), if any.
  void waitFor(const ChannelJob& job, int segment, size_t chunk, int peer) {
    auto& v = bySegment_.at(segment);
    if (chunk < v.size() && v[chunk]) {
      job.ctx.wait(*v[chunk], "send to", peer, job.channel);
      v[chunk].reset();
    }
  }

 private:
  std::vector<std::vector<std::shared_ptr<Request>>> bySegment_;
};

// The byte range of one chunk of a range of elements.
inline Range chunkOf(const ChannelJob& job, const Range& range, size_t chunk) {
  size_t first = chunk * job.chunkElems;
  return Range{range.offset + first, std::min(job.chunkElems, range.count - first)};
}

// Throws ProtocolError unless a receive from `peer` brought the `expected`
// bytes (both ends cut the data the same way, so any other size is a bug or a
// peer out of step).
inline void checkArrived(const ChannelJob& job, uint64_t got, size_t expected, int peer) {
  if (got != expected) {
    throw ProtocolError("reccl: " + job.ctx.label() + ": rank " + std::to_string(peer) + " sent " +
                        std::to_string(got) + " bytes on channel " + std::to_string(job.channel) +
                        ", expected " + std::to_string(expected));
  }
}

}  // namespace reccl
