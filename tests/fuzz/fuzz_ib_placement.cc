// Fuzzes the IB placement decoder (IbPlacement::decode,
// transport/ib/ib_registration.h): the bytes of a PLACE frame's placement, which
// tell an IB sender where in the receiver's memory, and with which rkey per
// NIC, it may RDMA-write. Properties: only ProtocolError escapes; an accepted
// placement names 1..18 NICs, marks only those as registered, does not wrap the
// address space, and rkeyOf answers only for the marked NICs; encode(decoded)
// is the input itself (the form has no spare bytes).
#include <vector>

#include "core/error.h"
#include "fuzz_check.h"
#include "transport/ib/ib_registration.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  reccl::IbPlacement placement;
  try {
    placement = reccl::IbPlacement::decode(bytes);
  } catch (const reccl::ProtocolError&) {
    return 0;
  }
  const size_t nics = placement.rkeys.size();
  FUZZ_CHECK(nics >= 1 && nics <= 18);
  FUZZ_CHECK(placement.present != 0 && (placement.present >> nics) == 0);
  FUZZ_CHECK(placement.address + placement.capacity >= placement.address);
  for (int nic = -1; nic <= 32; ++nic) {
    const bool marked = nic >= 0 && nic < 32 && (placement.present >> nic) & 1;
    FUZZ_CHECK(placement.rkeyOf(nic).has_value() == marked);
  }
  FUZZ_CHECK(placement.encode() == bytes);
  return 0;
}
