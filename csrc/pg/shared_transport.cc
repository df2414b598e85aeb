#include "pg/shared_transport.h"

#include <mutex>

namespace reccl {

std::shared_ptr<TcpTransport> sharedTransport() {
  static std::mutex mutex;
  static std::weak_ptr<TcpTransport> current;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto transport = current.lock()) return transport;
  Config config = Config::fromProcessEnv();
  config.applyLogLevel();
  auto transport = std::make_shared<TcpTransport>(config);
  current = transport;
  return transport;
}

}  // namespace reccl
