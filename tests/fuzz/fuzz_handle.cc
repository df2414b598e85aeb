// Fuzzes the connection handle decoder (transport/handle.h): the 128 bytes a
// listener publishes (NCCL carries them between ranks; reccl's own groups put
// them in the store, one per NIC, which engine/links.cc checks for length
// before decoding each). Properties: only ProtocolError escapes; an accepted
// handle has 1..12 NICs, its listening and backup NIC among them and a chunk
// size in 4096..64 MiB; encodeHandle(decoded) decodes to the same handle and
// re-encodes to the same bytes.
#include <cstring>
#include <vector>

#include "core/error.h"
#include "fuzz_check.h"
#include "transport/handle.h"

namespace {

bool sameHandle(const reccl::ListenHandle& a, const reccl::ListenHandle& b) {
  if (a.listenId != b.listenId || std::memcmp(a.secret, b.secret, sizeof(a.secret)) != 0 ||
      a.chunkBytes != b.chunkBytes || a.listenerNic != b.listenerNic ||
      a.listenerBackup != b.listenerBackup || a.nics.size() != b.nics.size()) {
    return false;
  }
  for (size_t i = 0; i < a.nics.size(); ++i) {
    if (a.nics[i].address != b.nics[i].address || a.nics[i].port != b.nics[i].port) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  reccl::ListenHandle handle;
  try {
    handle = reccl::decodeHandle(data, size);
  } catch (const reccl::ProtocolError&) {
    return 0;
  }
  const int nics = static_cast<int>(handle.nics.size());
  FUZZ_CHECK(nics >= 1 && nics <= static_cast<int>(reccl::kMaxHandleNics));
  FUZZ_CHECK(handle.listenerNic >= 0 && handle.listenerNic < nics);
  FUZZ_CHECK(handle.listenerBackup >= -1 && handle.listenerBackup < nics);
  FUZZ_CHECK(handle.chunkBytes >= 4096 && handle.chunkBytes <= reccl::kMaxChunkBytes);
  const std::vector<uint8_t> encoded = reccl::encodeHandle(handle);
  FUZZ_CHECK(encoded.size() == reccl::kHandleBytes);
  reccl::ListenHandle again;
  try {
    again = reccl::decodeHandle(encoded.data(), encoded.size());
  } catch (const reccl::ProtocolError& error) {
    std::fprintf(stderr, "encodeHandle's bytes were refused: %s\n", error.what());
    std::abort();
  }
  FUZZ_CHECK(sameHandle(handle, again));
  FUZZ_CHECK(reccl::encodeHandle(again) == encoded);
  return 0;
}
