// Source GID choice for a RoCE or IB QP. It is made from the port's table as
// it is when the QP is created, never remembered: after a link flap the
// kernel may rebuild the table and put the same address at another index.
#pragma once

#include <vector>

#include "transport/ib/verbs_api.h"

namespace reccl {

// The index to use, or -1 when the table has no usable (non-zero) entry.
// RoCE: a RoCE v2 IPv4-mapped GID (::ffff:a.b.c.d), else another routable
// RoCE v2 GID, else a link-local RoCE v2 GID, else any RoCE v1 one. IB: the
// first non-zero entry.
int selectGidIndex(const std::vector<GidEntry>& table, bool ethernet);

// The port's table, read entry by entry.
std::vector<GidEntry> readGidTable(VerbsDevice& device, int port);

}  // namespace reccl
