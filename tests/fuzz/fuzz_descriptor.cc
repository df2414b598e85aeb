// Fuzzes the collective descriptor decoder (engine/descriptor.h): the 96 bytes
// each rank sends at every collective, inside the agreement. The first two
// input bytes give the group size (1..65536), the rest is the descriptor.
// Properties: only ProtocolError escapes; an accepted descriptor's sender is in
// the group; describe() and the mismatch and rejection texts are made without
// failing; encodeDescriptor(decoded) decodes to the same op (sameOp) and
// re-encodes to the same bytes.
#include <cstring>
#include <vector>

#include "core/error.h"
#include "engine/descriptor.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int groupSize = 1 + (data[0] | (data[1] << 8));
  reccl::DecodedDescriptor decoded;
  try {
    decoded = reccl::decodeDescriptor(data + 2, size - 2, groupSize);
  } catch (const reccl::ProtocolError&) {
    return 0;
  }
  FUZZ_CHECK(decoded.sender >= 0 && decoded.sender < groupSize);
  const reccl::OpDescriptor& desc = decoded.desc;
  FUZZ_CHECK(!desc.describe().empty());
  FUZZ_CHECK(!reccl::mismatchMessage("g", 0, desc, decoded.sender, desc).empty());
  if (desc.rejection) FUZZ_CHECK(!reccl::rejectionMessage("g", decoded.sender, desc).empty());
  std::vector<uint8_t> encoded(reccl::kDescriptorBytes);
  reccl::encodeDescriptor(desc, decoded.sender, groupSize, encoded.data());
  reccl::DecodedDescriptor again;
  try {
    again = reccl::decodeDescriptor(encoded.data(), encoded.size(), groupSize);
  } catch (const reccl::ProtocolError& error) {
    std::fprintf(stderr, "encodeDescriptor's bytes were refused: %s\n", error.what());
    std::abort();
  }
  FUZZ_CHECK(again.sender == decoded.sender);
  FUZZ_CHECK(reccl::sameOp(desc, again.desc));
  std::vector<uint8_t> twice(reccl::kDescriptorBytes);
  reccl::encodeDescriptor(again.desc, again.sender, groupSize, twice.data());
  FUZZ_CHECK(twice == encoded);
  return 0;
}
