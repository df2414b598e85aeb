#include "core/address_range.h"

#include <arpa/inet.h>

#include <cstring>

#include "core/error.h"

namespace reccl {

bool AddressRange::tryParse(const std::string& text, AddressRange* out, std::string* why) {
  const size_t slash = text.find('/');
  if (slash == std::string::npos) {
    *why = "no /prefix length";
    return false;
  }
  const std::string address = text.substr(0, slash);
  const std::string prefix = text.substr(slash + 1);
  AddressRange range;
  range.ipv6 = address.find(':') != std::string::npos;
  if (inet_pton(range.ipv6 ? AF_INET6 : AF_INET, address.c_str(), range.network.data()) != 1) {
    *why = "'" + address + "' is not an IPv" + (range.ipv6 ? "6" : "4") + " address";
    return false;
  }
  const int maxBits = range.ipv6 ? 128 : 32;
  if (prefix.empty() || prefix.size() > 3 ||
      prefix.find_first_not_of("0123456789") != std::string::npos || std::stoi(prefix) > maxBits) {
    *why = "the prefix length must be 0.." + std::to_string(maxBits);
    return false;
  }
  range.prefixBits = std::stoi(prefix);
  *out = range;
  return true;
}

AddressRange AddressRange::parse(const std::string& text) {
  AddressRange range;
  std::string why;
  if (!tryParse(text, &range, &why)) {
    throw ConfigError("address range '" + text + "' is not valid: " + why + "; " + kValidForm);
  }
  return range;
}

bool AddressRange::contains(const uint8_t* address, bool addressIsIpv6) const {
  if (addressIsIpv6 != ipv6) return false;
  const int whole = prefixBits / 8;
  if (std::memcmp(address, network.data(), static_cast<size_t>(whole)) != 0) return false;
  const int rest = prefixBits % 8;
  if (rest == 0) return true;
  const uint8_t mask = static_cast<uint8_t>(0xFF << (8 - rest));
  return (address[whole] & mask) == (network[whole] & mask);
}

std::string AddressRange::describe() const {
  char text[INET6_ADDRSTRLEN] = {};
  inet_ntop(ipv6 ? AF_INET6 : AF_INET, network.data(), text, sizeof(text));
  return std::string(text) + "/" + std::to_string(prefixBits);
}

}  // namespace reccl
