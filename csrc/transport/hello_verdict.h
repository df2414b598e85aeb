// What the accepting side decides about a complete HELLO: shared by the
// listeners (their checks of listen id, secret and path index), the transports
// (their NIC checks) and the acceptor that answers the dialer.
#pragma once

#include <string>

namespace reccl {

// kDecline is for a genuine peer that cannot be served now (the NIC is down):
// logged quietly, not counted as an attack.
struct HelloVerdict {
  enum Kind { kAdmit, kDecline, kReject } kind = kAdmit;
  std::string why;
  bool sameHostReads = false;  // kAdmit: the HELLO's same-host offer is taken
};

}  // namespace reccl
