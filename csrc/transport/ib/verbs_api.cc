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
    case AsyncEventType::kCqError: return "CQ error";
    case AsyncEventType::kOther: return "other";
  }
  return "unknown";
}

int portSpeedMbps(uint8_t activeSpeed, uint8_t activeWidth) {
  int laneMbps = 0;  // data rate per lane (after line coding)
  switch (activeSpeed) {
    case 1: laneMbps = 2500; break;     // SDR
    case 2: laneMbps = 5000; break;     // DDR
    case 4: laneMbps = 10000; break;    // QDR
    case 8: laneMbps = 10000; break;    // FDR10
    case 16: laneMbps = 14000; break;   // FDR
    case 32: laneMbps = 25000; break;   // EDR
    case 64: laneMbps = 50000; break;   // HDR
    case 128: laneMbps = 100000; break; // NDR
    default: return 0;
  }
  int lanes = 0;
  switch (activeWidth) {
    case 1: lanes = 1; break;
    case 2: lanes = 4; break;
    case 4: lanes = 8; break;
    case 8: lanes = 12; break;
    case 16: lanes = 2; break;
    default: return 0;
  }
  return laneMbps * lanes;
}

int64_t retryBudgetNs(int timeout, int retryCount) {
  // 4096 ns * 2^timeout; timeout 0 means "infinite" in verbs, we never use it.
  return 4096LL * (1LL << timeout) * (retryCount + 1);
}

}  // namespace reccl
