#include "engine/collective.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"

namespace reccl {

namespace {

// Messages one connection may carry for one op (see chunkElems).
constexpr size_t kMessagesPerConnection = 512;

}  // namespace

Algorithm chooseAlgorithm(const Communicator& comm, size_t largestMessageBytes) {
  const bool small = comm.size() > 1 && largestMessageBytes <= comm.options().smallBytes;
  return small ? Algorithm::kRecursiveDoubling : Algorithm::kChannels;
}

Algorithm chooseAlgorithmOrHalving(const Communicator& comm, size_t largestMessageBytes) {
  const Algorithm algorithm = chooseAlgorithm(comm, largestMessageBytes);
  if (algorithm != Algorithm::kChannels) return algorithm;
  const CommOptions& options = comm.options();
  const bool halving =
      options.algo == Algo::kHalving ||
      (options.algo == Algo::kAuto &&
       largestMessageBytes <= options.halvingBytesPerRank * static_cast<size_t>(comm.size()));
  return halving ? Algorithm::kHalvingDoubling : algorithm;
}

RootedOp rootedOp(const Communicator& comm, OpKind kind, size_t count, DataType dtype, int root) {
  checkRoot(root, comm.size());
  const size_t bytes = count * elementSize(dtype);
  const Algorithm algorithm = chooseAlgorithm(comm, bytes * comm.size());
  OpDescriptor desc = OpDescriptor::of(kind, dtype, count, root);
  desc.algorithm = static_cast<uint8_t>(algorithm);
  return {bytes, algorithm == Algorithm::kRecursiveDoubling, desc};
}

void checkRoot(int root, int size) {
  if (root < 0 || root >= size) {
    throw ConfigError("root rank " + std::to_string(root) + " is not in this group of " +
                      std::to_string(size) + " ranks");
  }
}

void rejectCollective(Communicator& comm, const OpDescriptor& desc, Millis timeout) {
  comm.run(desc, timeout, RdPayload{}, [](const OpContext&) {});  // throws before the data phase
}

size_t chunkElems(const Communicator& comm, DataType dtype, size_t largestSegment,
                  int segmentsPerConnection, size_t chunksPerChunk) {
  const size_t base =
      std::max<size_t>(1, comm.options().chunkBytes / chunksPerChunk / elementSize(dtype));
  const size_t maxChunks =
      std::max<size_t>(1, kMessagesPerConnection / std::max(1, segmentsPerConnection));
  return std::max(base, (largestSegment + maxChunks - 1) / maxChunks);
}

uint8_t* gatherBlocks(Communicator& comm, const Layout& layout, void* out, size_t blockBytes) {
  return layout.inRankOrder() ? bytesOf(out) : comm.opScratch(blockBytes * layout.size());
}

void blocksToRankOrder(const Layout& layout, const uint8_t* blocks, void* out, size_t blockBytes) {
  if (blocks == out || blockBytes == 0) return;
  for (int p = 0; p < layout.size(); ++p) {
    std::memcpy(bytesOf(out) + layout.rankAt(p) * blockBytes, blocks + p * blockBytes, blockBytes);
  }
}

void copyIfDistinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memmove(dst, src, bytes);
}

}  // namespace reccl
