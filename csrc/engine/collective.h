// What the collectives (all_reduce.h, broadcast.h, ...) share: the choice of
// algorithm, the root check, the channel algorithms' pipelining unit and byte
// helpers. Each collective is a free function over a Communicator, as in Gloo:
// the communicator runs the op (agreement, errors, DCR plans), the collective
// decides how its data moves.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/communicator.h"
#include "engine/data_type.h"

namespace reccl {

// How a collective's data moves. Carried in its descriptor: every rank must
// have chosen the same (RECCL_SMALL_BYTES and RECCL_ALGO the same everywhere).
// kHalvingDoubling: all_reduce, reduce_scatter and all_gather
// (halving_doubling.h).
enum class Algorithm : uint8_t {
  kNone = 0,
  kRecursiveDoubling = 1,
  kChannels = 2,
  kHalvingDoubling = 3
};

// Recursive doubling when the op's largest recursive-doubling message is at
// most RECCL_SMALL_BYTES: its data then rides with the agreement, latency
// O(log N). The channels otherwise (bandwidth), and for a group of one, which
// runs no agreement.
Algorithm chooseAlgorithm(const Communicator& comm, size_t largestMessageBytes);
// The choice of all_reduce, reduce_scatter and all_gather: as
// chooseAlgorithm(), but a large one runs by recursive halving and/or doubling
// instead of the ring with RECCL_ALGO=halving, and with `auto` while the
// buffer is at most RECCL_HALVING_BYTES_PER_RANK x ranks (the measured
// crossover: halving's log2 N steps win while each rank's share is small).
Algorithm chooseAlgorithmOrHalving(const Communicator& comm, size_t largestMessageBytes);

// Throws ConfigError unless `root` is a rank of a group of `size`.
void checkRoot(int root, int size);

// The opening of a rooted collective that moves one block of `count` elements
// per rank between the root and every rank (gather, scatter): the root checked,
// the block's bytes, recursive doubling for a small total (`rd`), the descriptor.
struct RootedOp {
  size_t bytes;
  bool rd;
  OpDescriptor desc;
};
RootedOp rootedOp(const Communicator& comm, OpKind kind, size_t count, DataType dtype, int root);

// Joins the collective `desc`, which carries a Rejection, as far as its
// agreement, so that every rank fails it with the same MismatchError at once
// instead of waiting for this rank; the group stays usable. Always throws.
void rejectCollective(Communicator& comm, const OpDescriptor& desc, Millis timeout);

// The pipelining unit, in elements, of a channel algorithm whose largest
// segment is `largestSegment` elements and which sends `segmentsPerConnection`
// segments over one connection: chunk_bytes (divided by `chunksPerChunk`, for
// an algorithm that wants finer parts), or more so that one connection
// carries at most a few hundred messages per op (well below the transport's
// bound on outstanding requests, so the rings never block on it).
size_t chunkElems(const Communicator& comm, DataType dtype, size_t largestSegment,
                  int segmentsPerConnection, size_t chunksPerChunk = 1);

inline uint8_t* bytesOf(void* p) { return static_cast<uint8_t*>(p); }
inline const uint8_t* bytesOf(const void* p) { return static_cast<const uint8_t*>(p); }

// Where a small gather of `blockBytes` per rank into rank-ordered `out` runs
// (recursive doubling gathers in position order, layout.h): `out` itself when
// positions are ranks, else the op's work buffer; then blocksToRankOrder().
uint8_t* gatherBlocks(Communicator& comm, const Layout& layout, void* out, size_t blockBytes);
void blocksToRankOrder(const Layout& layout, const uint8_t* blocks, void* out, size_t blockBytes);

// Copies unless the collective runs in place (`dst` is `src`).
void copyIfDistinct(void* dst, const void* src, size_t bytes);

}  // namespace reccl
