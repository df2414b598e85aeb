#include "engine/direct.h"

#include <algorithm>

namespace reccl {

void directExchange(ChannelJob& job, const std::vector<Transfer>& sendTo,
                    const std::vector<Transfer>& recvFrom, SendList& sends, RegionSends* regions) {
  const size_t elem = job.elem;
  struct Posted {
    std::shared_ptr<Request> request;
    int peer;
    size_t bytes;
  };
  std::vector<Posted> posted;
  // Connect first (non-blocking), then accept: no rank waits on one that is
  // itself waiting to accept.
  std::vector<std::shared_ptr<SendConnection>> to;
  for (const Transfer& t : sendTo) {
    to.push_back(t.elements.count ? job.links.sender(t.peer, job.channel, Lane::kCollective)
                                  : nullptr);
  }
  for (const Transfer& t : recvFrom) {
    if (t.elements.count == 0) continue;
    auto from = job.links.receiver(t.peer, job.channel, Lane::kCollective, job.ctx);
    const size_t unit = t.chunkElems ? t.chunkElems : job.chunkElems;
    for (size_t k = 0; k * unit < t.elements.count; ++k) {
      Range c{t.elements.offset + k * unit, std::min(unit, t.elements.count - k * unit)};
      if (regions && t.segment >= 0) regions->waitFor(job, t.segment, k, -1);
      posted.push_back(
          {from->irecv(t.data + c.offset * elem, c.count * elem), t.peer, c.count * elem});
    }
  }
  for (size_t i = 0; i < sendTo.size(); ++i) {
    const Transfer& t = sendTo[i];
    const size_t unit = t.chunkElems ? t.chunkElems : job.chunkElems;
    for (size_t k = 0; k * unit < t.elements.count; ++k) {
      Range c{t.elements.offset + k * unit, std::min(unit, t.elements.count - k * unit)};
      sends.add(to[i]->isend(t.data + c.offset * elem, c.count * elem), t.peer);
    }
  }
  for (auto& p : posted) {
    checkArrived(job, job.ctx.wait(*p.request, "data from", p.peer, job.channel), p.bytes, p.peer);
  }
}

}  // namespace reccl
