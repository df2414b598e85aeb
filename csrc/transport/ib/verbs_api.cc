#include "transport/ib/verbs_api.h"

namespace reccl {

const char* wcStatusName(WcStatus status) {
  switch (status) {
    case WcStatus::kSuccess: return "success";
    case WcStatus::kLocalLengthError: return "local length error";
    case WcStatus::kLocalProtection: return "local protection error";
    case WcStatus::kFlushed: return "work request flushed";
    case WcStatus::kRemoteAccess: return "remote access error";
    case WcStatus::kRemoteOperation: return "remote operation error";
    case WcStatus::kRetryExceeded: return "transport retry counter exceeded";
    case WcStatus::kRnrRetryExceeded: return "RNR retry counter exceeded";
    case WcStatus::kOther: return "other error";
  }
  return "unknown";
}

const char* asyncEventName(AsyncEventType type) {
  switch (type) {
    case AsyncEventType::kPortActive: return "port active";
    case AsyncEventType::kPortError: return "port error";
    case AsyncEventType::kGidChange: return "GID change";
    case AsyncEventType::kQpFatal: return "QP fatal";
    case AsyncEventType::kDeviceFatal: return "device fatal";
    case AsyncEventType::kOther: return "other";
  }
  return "unknown";
}

int64_t retryBudgetNs(int timeout, int retryCount) {
  // 4096 ns * 2^timeout; timeout 0 means "infinite" in verbs, we never use it.
  return 4096LL * (1LL << timeout) * (retryCount + 1);
}

}  // namespace reccl
