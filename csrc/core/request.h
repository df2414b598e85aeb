// A send or receive the caller polls or waits on. Completed exactly once, by
// whichever library thread finishes or fails it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "core/clock.h"

namespace reccl {

class Request {
 public:
  // A zero-byte buffer may have no address (an empty tensor's data pointer is
  // null), but a path takes a null destination for "discard this chunk" and the
  // message would never complete: such a request gets an address that is never
  // written instead.
  Request(uint64_t seq, uint8_t* data, uint64_t bytes)
      : seq_(seq), data_(data == nullptr && bytes == 0 ? noBytes() : data), bytes_(bytes) {}

  uint64_t seq() const { return seq_; }
  uint8_t* data() const { return data_; }
  uint64_t capacity() const { return bytes_; }

  void complete(uint64_t transferred) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    transferred_ = transferred;
    cv_.notify_all();
  }
  void fail(const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    error_ = error;
    cv_.notify_all();
  }
  // True when finished; `error` is empty on success.
  bool test(uint64_t* transferred, std::string* error) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) return false;
    *transferred = transferred_;
    *error = error_;
    return true;
  }
  bool wait(Millis timeout) const {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return done_; });
  }

 private:
  static uint8_t* noBytes() {
    static uint8_t nothing;
    return &nothing;
  }

  const uint64_t seq_;
  uint8_t* const data_;
  const uint64_t bytes_;
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  uint64_t transferred_ = 0;
  std::string error_;
};

}  // namespace reccl
