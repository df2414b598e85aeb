// A Python buffer registered with a transport for zero-copy transfers
// (torch_reccl._C.Registration): holds the buffer (so its memory stays put)
// and the transport's registration (deregistered when this goes). Requests
// that name it keep it alive until they are dropped.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "core/memory_registration.h"
#include "transport/transport.h"

namespace reccl {

// Hidden like pybind11's own types, whose objects it holds.
struct __attribute__((visibility("hidden"))) RegisteredBuffer {
  pybind11::buffer owner;
  pybind11::buffer_info info;
  std::unique_ptr<MemoryRegistration> registration;
};

// Registers `buffer` (writable, contiguous) with `transport`; None when the
// transport does not register memory (TCP, or IB with RECCL_IB_ZERO_COPY=off).
pybind11::object registerBuffer(Transport& transport, pybind11::buffer buffer);

}  // namespace reccl
