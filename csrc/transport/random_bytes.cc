#include "transport/random_bytes.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/error.h"

namespace reccl {

void randomBytes(uint8_t* out, size_t length) {
  size_t filled = 0;
  while (filled < length) {
    ssize_t got = ::getrandom(out + filled, length - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    filled += static_cast<size_t>(got);
  }
}

RandomIds::RandomIds() {
  uint64_t seed;
  randomBytes(reinterpret_cast<uint8_t*>(&seed), sizeof(seed));
  generator_.seed(seed);
}

uint64_t RandomIds::next() {
  std::lock_guard<std::mutex> lock(mutex_);
  return generator_();
}

}  // namespace reccl
