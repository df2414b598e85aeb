#include "pg/shared_transport.h"

#include <mutex>

#include "transport/tcp/tcp_transport.h"

namespace reccl {

std::shared_ptr<Transport> sharedTransport() {
  static std::mutex mutex;
  static std::weak_ptr<Transport> current;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto transport = current.lock()) return transport;
  Config config = Config::fromProcessEnv();
  config.applyLogLevel();
  auto transport = std::make_shared<TcpTransport>(config);
  current = transport;
  return transport;
}

}  // namespace reccl
