// Unpredictable bytes from the kernel, for handshake secrets and ids.
#pragma once

#include <cstddef>
#include <cstdint>

namespace reccl {

// Fills `out` from getrandom(2); throws Error if the kernel refuses.
void randomBytes(uint8_t* out, size_t length);

}  // namespace reccl
