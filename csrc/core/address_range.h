// An IPv4 or IPv6 network in CIDR form ("10.0.0.0/16", "fd00::/8"), as
// RECCL_IB_ADDR_RANGE takes it (like NCCL_IB_ADDR_RANGE): which of a port's
// addresses (RoCE GIDs) may carry traffic.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace reccl {

struct AddressRange {
  static constexpr const char* kValidForm =
      "expected an IPv4 or IPv6 network in CIDR form (10.0.0.0/16, fd00::/8)";

  bool ipv6 = false;
  std::array<uint8_t, 16> network{};  // IPv4: the first 4 bytes
  int prefixBits = 0;

  // An address that inet_pton reads, '/', a prefix length in 0..32 (IPv4) or
  // 0..128 (IPv6). false with the reason in `why` otherwise.
  static bool tryParse(const std::string& text, AddressRange* out, std::string* why);
  // tryParse, throwing ConfigError with the reason and kValidForm.
  static AddressRange parse(const std::string& text);
  // Whether `address` (4 bytes for IPv4, 16 for IPv6) is in the range; an
  // address of the other family never is.
  bool contains(const uint8_t* address, bool addressIsIpv6) const;
  std::string describe() const;
};

}  // namespace reccl
