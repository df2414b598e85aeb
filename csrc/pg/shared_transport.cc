#include "pg/shared_transport.h"

#include <mutex>

#include "transport/make_transport.h"

namespace reccl {

std::shared_ptr<Transport> sharedTransport() {
  static std::mutex mutex;
  static std::weak_ptr<Transport> current;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto transport = current.lock()) return transport;
  Config config = Config::fromProcessEnv();
  config.applyLogLevel();
  std::shared_ptr<Transport> transport = makeTcpTransport(config);
  current = transport;
  return transport;
}

}  // namespace reccl
