// The dialing half of the HELLO handshake, shared by the TCP transport (every
// path socket) and the IB transport (its bootstrap socket).
#pragma once

#include <string>

#include "core/clock.h"
#include "core/frame.h"
#include "transport/tcp/handle.h"
#include "transport/tcp/socket.h"

namespace reccl {

// Connects from `localAddress` to `remote`, sends `hello` and waits for an
// accepting HELLO_ACK, each step within `timeout`; `acceptorTransport`, when
// given, receives the id the acceptor sent. An invalid Fd and the reason in
// `error` otherwise.
Fd dialWithHello(const std::string& localAddress, const HandleEndpoint& remote,
                 const HelloBody& hello, Millis timeout, std::string* error,
                 uint64_t* acceptorTransport = nullptr);

}  // namespace reccl
