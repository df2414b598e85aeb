// The dialing half of the HELLO handshake, shared by the TCP transport (every
// path socket) and the IB transport (its bootstrap socket).
#pragma once

#include <string>
#include <vector>

#include "core/clock.h"
#include "core/frame.h"
#include "transport/handle.h"
#include "transport/socket.h"

namespace reccl {

// One socket per entry of `hellos`, from `localAddress` to `remote`: all are
// connected, greeted and answered at once (a path's control and data sockets
// cost one round trip, not one each), all within `timeout`. Every socket must
// get an accepting HELLO_ACK; `acceptorTransport`, when given, receives the id
// the acceptor sent, and `sameHostReads` whether it took the first HELLO's
// same-host offer. The sockets in the order of `hellos`, or none and why in
// `failure`.
std::vector<Fd> dialWithHellos(const std::string& localAddress, const HandleEndpoint& remote,
                               const std::vector<HelloBody>& hellos, Millis timeout,
                               PathFailure* failure, uint64_t* acceptorTransport = nullptr,
                               bool* sameHostReads = nullptr);

// The same for one socket: an invalid Fd on failure.
Fd dialWithHello(const std::string& localAddress, const HandleEndpoint& remote,
                 const HelloBody& hello, Millis timeout, PathFailure* failure,
                 uint64_t* acceptorTransport = nullptr);

}  // namespace reccl
