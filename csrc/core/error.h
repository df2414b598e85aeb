// Errors raised by the library. Every message says what was wrong and, where it
// applies, what is valid.
#pragma once

#include <stdexcept>
#include <string>

namespace reccl {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad RECCL_* setting or a bad argument from the caller.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A malformed frame or handshake from the wire.
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// A wait ran past its bound.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

}  // namespace reccl
