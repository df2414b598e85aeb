#include "core/spread.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace reccl {

namespace {
// Goodput samples span at least this long, so one ACK's burst is no rate.
constexpr Millis kSampleSpan{100};
constexpr double kEwmaGain = 0.3;
// Goodputs within this fraction of the lanes' mean count as equal.
constexpr double kNoise = 0.3;
}  // namespace

void SpreadLanes::reset(const std::vector<int>& slots, const std::vector<double>& factors) {
  lanes_.clear();
  slots_.clear();
  for (size_t i = 0; i < slots.size(); ++i) add(slots[i], factors.at(i));
  for (auto& [slot, meter] : meters_) meter.busy = false;
}

void SpreadLanes::add(int slot, double factor) {
  if (has(slot)) return;
  Lane lane;
  lane.slot = slot;
  lane.factor = factor > 0 ? factor : 1.0;
  lanes_.push_back(lane);
  slots_.push_back(slot);
}

bool SpreadLanes::has(int slot) const {
  return std::find(slots_.begin(), slots_.end(), slot) != slots_.end();
}

SpreadLanes::Lane* SpreadLanes::find(int slot) {
  for (auto& lane : lanes_) {
    if (lane.slot == slot) return &lane;
  }
  return nullptr;
}

double SpreadLanes::weightOf(const Lane& lane) const {
  // Unmeasured lanes count as the mean of the measured ones (all equal at start).
  double sum = 0;
  int measured = 0;
  for (const auto& other : lanes_) {
    auto it = meters_.find(other.slot);
    if (it != meters_.end() && it->second.goodput > 0) {
      sum += it->second.goodput;
      ++measured;
    }
  }
  const double mean = measured > 0 ? sum / measured : 1.0;
  double goodput = mean;
  auto it = meters_.find(lane.slot);
  if (it != meters_.end() && it->second.goodput > 0) goodput = it->second.goodput;
  // A sample holds a few messages' ACKs, so lanes equally fast read up to
  // ~30% apart; weighting by that noise would load one NIC more than another
  // (and the collective waits for it). Only a lane clearly off the mean (a
  // slower path, a NIC another connection also loads) is weighted by it.
  if (std::abs(goodput - mean) < kNoise * mean) goodput = mean;
  return goodput * lane.factor;
}

int SpreadLanes::pick(uint64_t bytes, Clock::time_point now) {
  if (lanes_.empty()) throw std::logic_error("SpreadLanes::pick without lanes");
  Lane* best = nullptr;
  double bestTime = 0;
  for (auto& lane : lanes_) {
    const double time = static_cast<double>(lane.outstanding + bytes) / weightOf(lane);
    if (best == nullptr || time < bestTime) {
      best = &lane;
      bestTime = time;
    }
  }
  best->outstanding += bytes;
  Meter& meter = meters_[best->slot];
  if (!meter.busy) {
    meter.busy = true;
    meter.since = now;
    meter.bytes = 0;
  }
  return best->slot;
}

void SpreadLanes::acked(int slot, uint64_t bytes, Clock::time_point now) {
  Lane* lane = find(slot);
  if (lane == nullptr) return;  // a lane of an older epoch
  lane->outstanding -= std::min(lane->outstanding, bytes);
  Meter& meter = meters_[slot];
  if (!meter.busy) return;
  meter.bytes += bytes;
  const auto span = now - meter.since;
  if (span >= kSampleSpan) {
    const double rate =
        static_cast<double>(meter.bytes) / std::chrono::duration<double>(span).count();
    meter.goodput = meter.goodput > 0 ? (1 - kEwmaGain) * meter.goodput + kEwmaGain * rate : rate;
    meter.since = now;
    meter.bytes = 0;
  }
  // Idle time is no measure of speed: the next sample starts with the next chunk.
  if (lane->outstanding == 0) meter.busy = false;
}

void SpreadLanes::forget(int slot) { meters_.erase(slot); }

uint64_t ChunkPieces::chunkLength(uint64_t offset, uint64_t messageBytes) const {
  const uint64_t start = offset - offset % chunkBytes_;
  return start >= messageBytes ? 0 : std::min(chunkBytes_, messageBytes - start);
}

uint64_t ChunkPieces::fullMask(uint64_t offset, uint64_t messageBytes) const {
  const uint64_t units =
      std::max<uint64_t>(1, (chunkLength(offset, messageBytes) + unit_ - 1) / unit_);
  return units >= 64 ? ~uint64_t{0} : (uint64_t{1} << units) - 1;
}

uint64_t ChunkPieces::maskOf(uint64_t offset, uint64_t bytes) const {
  const uint64_t first = offset % chunkBytes_ / unit_;
  const uint64_t units = std::max<uint64_t>(1, (bytes + unit_ - 1) / unit_);
  const uint64_t run = units >= 64 ? ~uint64_t{0} : (uint64_t{1} << units) - 1;
  return run << first;
}

bool ChunkPieces::valid(uint64_t offset, uint64_t bytes, uint64_t messageBytes) const {
  if (messageBytes == 0) return offset == 0 && bytes == 0;
  if (offset >= messageBytes || bytes == 0 || offset % chunkBytes_ % unit_ != 0) return false;
  const uint64_t end = offset - offset % chunkBytes_ + chunkLength(offset, messageBytes);
  return bytes <= end - offset && (bytes % unit_ == 0 || offset + bytes == end);
}

uint64_t ChunkPieces::pieceLength(uint64_t offset, uint64_t messageBytes, size_t lanes) const {
  const uint64_t end = offset - offset % chunkBytes_ + chunkLength(offset, messageBytes);
  if (lanes <= 1) return end - offset;
  const uint64_t units = (chunkLength(offset, messageBytes) + unit_ - 1) / unit_;
  const uint64_t piece = (units + lanes - 1) / lanes * unit_;
  return std::min(piece, end - offset);
}

double spreadDistanceFactor(int cost) { return cost > 0 ? 1.0 / (1.0 + cost / 100.0) : 1.0; }

SpreadTable& SpreadTable::instance() {
  static SpreadTable* table = new SpreadTable();  // never destroyed: paths may outlive statics
  return *table;
}

void SpreadTable::set(uint64_t connection, const std::string& peer, std::vector<std::string> nics) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (nics.empty()) {
    spreading_.erase(connection);
    return;
  }
  SpreadInfo& info = spreading_[connection];
  info.connection = connection;
  info.peer = peer;
  info.nics = std::move(nics);
}

std::vector<SpreadInfo> SpreadTable::list() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SpreadInfo> out;
  for (const auto& [id, info] : spreading_) out.push_back(info);
  return out;
}

}  // namespace reccl
