// Direct transfers for one channel: every rank posts all its receives and sends
// straight to the peers that need the data (gather, scatter, all-to-all, and
// the gather step of reduce). Chunked like the rings so large blocks stream.
#pragma once

#include <vector>

#include "engine/channel_job.h"

namespace reccl {

struct Transfer {
  int peer;
  uint8_t* data;   // const for sends
  Range elements;  // of `data`, in elements
  int segment = -1;     // with `regions`: the ring segment this region belongs to
  size_t chunkElems = 0;  // pipelining unit (0: the job's); both ends must agree
};

// Posts every receive, then every send, and waits for the receives (the sends
// join `sends`). A receive into a region named by `regions` first waits for
// the send that last read it.
void directExchange(ChannelJob& job, const std::vector<Transfer>& sendTo,
                    const std::vector<Transfer>& recvFrom, SendList& sends,
                    RegionSends* regions = nullptr);

}  // namespace reccl
