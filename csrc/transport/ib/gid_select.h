// Source GID choice for a RoCE or IB QP. It is made from the port's table as
// it is when the QP is created, never remembered: after a link flap the
// kernel may rebuild the table and put the same address at another index.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/address_range.h"
#include "transport/ib/verbs_api.h"

namespace reccl {

// RECCL_IB_GID_INDEX and RECCL_IB_ADDR_RANGE.
struct GidPolicy {
  int forcedIndex = -1;               // >= 0: always this index (validated against the table)
  std::optional<AddressRange> range;  // RoCE: the GID's address must be in it
};

// The index to use, or -1 when the table has no usable entry. RoCE: the
// lowest-indexed RoCE v2 GID that is not link-local and holds an IPv4 address
// (::ffff:a.b.c.d), or, with `range`, one whose address (IPv4 or IPv6) is in
// it. RoCE v1 GIDs, link-local ones and GIDs of unknown type are never chosen
// (v1 does not cross an IP router; a GID of unknown type may be v1). IB: the
// first non-zero entry (every GID of an IB port is an IB GID).
int selectGidIndex(const std::vector<GidEntry>& table, bool ethernet,
                   const AddressRange* range = nullptr);

// The port's table in one query where the library can (ibv_query_gid_table),
// else entry by entry (queryGid); every entry has its index, zero ones left out.
std::vector<GidEntry> readGidTable(VerbsDevice& device, int port, int tableLength);

// The entry to use under `policy`; throws Error naming the device, the policy
// and the table ("0 fe80::1 RoCEv2, 3 ::ffff:10.0.0.1 RoCEv2") when none is.
GidEntry chooseGid(const std::vector<GidEntry>& table, bool ethernet, const GidPolicy& policy,
                   const std::string& device);

}  // namespace reccl
