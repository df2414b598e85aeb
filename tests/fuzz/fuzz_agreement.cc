// Fuzzes the agreement decoder (engine/agreement.h): the 592-byte head of every
// recursive-doubling message, which carries two descriptors and the group's
// fault state from a peer. The first two input bytes give the group size
// (1..65536); the rest holds one agreement or two back to back. Properties: only
// ProtocolError escapes decoding; an accepted agreement names only ranks of the
// group, in order; encodeAgreement(decoded) decodes to the same agreement and
// re-encodes to the same bytes; check() throws nothing but MismatchError; two
// accepted agreements merge either way round (as a rank merges its partner's),
// and the merged one encodes to bytes that decode or are refused cleanly (a peer
// whose ranks overlap ours makes a sum past the group, which is refused).
#include <cstring>
#include <vector>

#include "core/error.h"
#include "engine/agreement.h"
#include "fuzz_check.h"

namespace {

using reccl::Agreement;

std::vector<uint8_t> encode(const Agreement& agreement, int groupSize) {
  std::vector<uint8_t> out(reccl::kAgreementBytes);
  reccl::encodeAgreement(agreement, groupSize, out.data());
  return out;
}

Agreement decodeOwn(const std::vector<uint8_t>& bytes, int groupSize) {
  try {
    return reccl::decodeAgreement(bytes.data(), bytes.size(), groupSize);
  } catch (const reccl::ProtocolError& error) {
    std::fprintf(stderr, "encodeAgreement's bytes were refused: %s\n", error.what());
    std::abort();
  }
}

void checkAccepted(const Agreement& a, int groupSize) {
  auto inGroup = [&](int rank) { return rank >= 0 && rank < groupSize; };
  FUZZ_CHECK(inGroup(a.firstRank));
  FUZZ_CHECK(a.oddRank == -1 || inGroup(a.oddRank));
  FUZZ_CHECK(a.missing.size() <= static_cast<size_t>(reccl::kListedDegradedRanks));
  FUZZ_CHECK(a.listed.size() <= static_cast<size_t>(reccl::kListedDegradedRanks));
  FUZZ_CHECK(a.degradedRanks >= a.listed.size() &&
             a.degradedRanks <= static_cast<uint32_t>(groupSize));
  for (size_t i = 0; i < a.missing.size(); ++i) {
    FUZZ_CHECK(inGroup(a.missing[i]) && (i == 0 || a.missing[i] > a.missing[i - 1]));
  }
  for (size_t i = 0; i < a.listed.size(); ++i) {
    FUZZ_CHECK(inGroup(a.listed[i].rank) && (i == 0 || a.listed[i].rank > a.listed[i - 1].rank));
  }
}

void checkGroupVerdict(const Agreement& a) {
  try {
    a.check("g");
  } catch (const reccl::MismatchError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int groupSize = 1 + (data[0] | (data[1] << 8));
  const uint8_t* rest = data + 2;
  const size_t restBytes = size - 2;
  std::vector<Agreement> accepted;
  for (size_t at = 0; at < restBytes && accepted.size() < 2; at += reccl::kAgreementBytes) {
    try {
      accepted.push_back(reccl::decodeAgreement(rest + at, restBytes - at, groupSize));
    } catch (const reccl::ProtocolError&) {
      return 0;
    }
  }
  for (const Agreement& a : accepted) {
    checkAccepted(a, groupSize);
    const std::vector<uint8_t> encoded = encode(a, groupSize);
    const Agreement again = decodeOwn(encoded, groupSize);
    checkAccepted(again, groupSize);
    FUZZ_CHECK(encode(again, groupSize) == encoded);
    checkGroupVerdict(again);
  }
  if (accepted.size() == 2) {
    Agreement left = accepted[0];
    left.merge(accepted[1]);
    Agreement right = accepted[1];
    right.merge(accepted[0]);
    checkGroupVerdict(left);
    checkGroupVerdict(right);
    for (const Agreement* merged : {&left, &right}) {
      const std::vector<uint8_t> forwarded = encode(*merged, groupSize);
      try {
        checkAccepted(reccl::decodeAgreement(forwarded.data(), forwarded.size(), groupSize),
                      groupSize);
      } catch (const reccl::ProtocolError&) {
      }
    }
  }
  return 0;
}
