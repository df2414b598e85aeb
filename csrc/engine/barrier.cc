#include "engine/barrier.h"

namespace reccl {

void barrier(Communicator& comm, Millis timeout) {
  OpDescriptor desc;
  desc.kind = OpKind::kBarrier;
  comm.run(desc, timeout, RdPayload{}, [](const OpContext&) {});
}

}  // namespace reccl
