// The wire format. Every frame starts with a fixed header; control frames carry
// a small typed body, data frames a DataHeader and a payload. Decoding validates
// every length before anything is allocated or copied: nothing from the wire is
// trusted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace reccl {

constexpr uint32_t kFrameMagic = 0x4C434552;  // "RECL" little-endian
// 3: HELLO and HELLO_ACK name their transports; 4: an IB grant is followed by
// an empty SEND (its notice), which a version-3 sender takes for a bad frame;
// 5: IB ends send receive-consuming requests only on credit (the peer's
// credit word), which a version-4 end never writes; 6: HELLO offers same-host
// reads and HELLO_ACK answers, DATA_REF frames.
constexpr uint16_t kProtocolVersion = 6;
constexpr size_t kSecretBytes = 16;
constexpr size_t kMaxOutstanding = 1024;  // posted receives per connection
constexpr size_t kNicNameBytes = 32;
constexpr uint32_t kMaxChunkBytes = 64u << 20;  // RECCL_CHUNK_BYTES upper bound
constexpr size_t kMaxPlacementBytes = 96;  // a transport's placement description

enum class FrameType : uint8_t {
  kHello = 1,      // first frame on every socket: who I am, which path, the secret
  kHelloAck = 2,
  kCts = 3,        // receiver -> sender: buffer `seq` of `bytes` is posted
  kAck = 4,        // receiver -> sender: message `seq` is complete
  kActivate = 5,   // sender -> receiver: use this path from epoch on; report state
  kResync = 6,     // receiver -> sender: outstanding buffers and resume offsets
  kNotify = 7,     // either way: path `index` failed, seen from my side
  kHeartbeat = 8,
  kData = 9,       // sender -> receiver on data sockets
  kClose = 10,     // orderly close: the coming EOFs are not faults
  kCancel = 11,    // sender -> receiver: message `seq` will never come (it was too large)
  kPlace = 12,     // receiver -> sender: buffer `seq` is registered; how to write it directly
  kDataRef = 13,   // sender -> receiver on a same-host path's data sockets: a DataHeader and
                  // where the payload is in the sender's memory; the receiver reads it there
};
const char* frameTypeName(FrameType type);

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint8_t type;
  uint8_t reserved[3];
  uint32_t bodyBytes;
};

enum class SocketKind : uint8_t { kControl = 0, kData = 1 };

struct HelloBody {
  uint16_t version;
  uint8_t socketKind;
  uint8_t socketIndex;  // data sockets: 0..socketCount-1
  uint8_t socketCount;  // data sockets in this path
  uint8_t pathIndex;  // 0 primary, 1 backup, 2.. last-resort rails
  uint8_t senderNic;  // the sender's NIC index (rail) for this path
  uint8_t receiverNic;  // the receiver's NIC index the sender dialed
  uint64_t listenId;
  uint64_t connectionId;
  uint64_t pathNonce;  // one dial attempt: groups a path's sockets
  uint64_t dialerTag;  // what the dialer says this connection is for (0: untagged);
                       // lets one listener serve many connections (listener.h)
  uint8_t secret[kSecretBytes];
  char senderNicName[kNicNameBytes];
  uint64_t dialerTransport;  // the dialing transport's id (liveness per peer NIC pair)
  // Same-host reads offered (control socket only; zeros: none offered): the
  // receiver may read this path's payloads straight from the dialer's memory
  // (transport/same_host.h) once it has read `refToken` at `refWord` in
  // process `pid`, which proves the pid is the dialer and readable.
  uint64_t hostKey;
  uint32_t pid;
  uint64_t refWord;
  uint64_t refToken;
};

struct HelloAckBody {
  uint8_t accepted;
  uint64_t acceptorTransport;  // the accepting transport's id (liveness per peer NIC pair)
  uint8_t sameHostReads;  // 1: the offer was taken, payloads go as DATA_REF
};

struct CtsBody {
  uint64_t seq;
  uint64_t bytes;
};

struct AckBody {
  uint64_t seq;
  uint64_t bytes;
};

struct ActivateBody {
  uint64_t epoch;
  uint8_t pathIndex;
  uint8_t reason;  // Reason of the switch, for the receiver's events
};

struct ResyncEntry {
  uint64_t seq;
  uint64_t capacity;  // posted buffer size
  uint64_t resumeOffset;  // first byte not known to have landed
};

struct ResyncHeader {
  uint64_t epoch;
  uint64_t nextSeq;  // receives posted so far; below it and absent = complete
  uint32_t count;  // ResyncEntry records that follow
};

struct CancelBody {
  uint64_t seq;
  uint64_t bytes;  // the size the sender had
};

struct PlaceBody {
  uint64_t seq;
  uint8_t hostAccessible;  // 0: device memory (direct placement only)
  uint8_t length;  // bytes of `placement` used, at most kMaxPlacementBytes
  uint8_t reserved[6];
  uint8_t placement[kMaxPlacementBytes];  // the transport's encoding, opaque here
};

struct NotifyBody {
  uint8_t pathIndex;
  uint8_t reason;
};

struct DataHeader {
  uint64_t seq;
  uint64_t epoch;
  uint64_t messageBytes;
  uint64_t offset;
  uint32_t bytes;
};

// DATA_REF's body: the chunk's header and the payload's address in the sender.
struct DataRefBody {
  DataHeader header;
  uint64_t address;
};
#pragma pack(pop)

// The wire sizes, pinned: a field added, removed or resized is a new protocol
// version (kProtocolVersion), never a silent change of every frame after it.
static_assert(sizeof(FrameHeader) == 12, "frame header wire size");
static_assert(offsetof(FrameHeader, bodyBytes) == 8, "frame header layout");
static_assert(sizeof(HelloBody) == 124, "HELLO wire size");
static_assert(offsetof(HelloBody, listenId) == 8 && offsetof(HelloBody, secret) == 40 &&
                  offsetof(HelloBody, dialerTransport) == 88 &&
                  offsetof(HelloBody, refToken) == 116,
              "HELLO layout");
static_assert(sizeof(HelloAckBody) == 10, "HELLO_ACK wire size");
static_assert(sizeof(CtsBody) == 16, "CTS wire size");
static_assert(sizeof(AckBody) == 16, "ACK wire size");
static_assert(sizeof(ActivateBody) == 10, "ACTIVATE wire size");
static_assert(sizeof(ResyncEntry) == 24, "RESYNC entry wire size");
static_assert(sizeof(ResyncHeader) == 20, "RESYNC header wire size");
static_assert(sizeof(CancelBody) == 16, "CANCEL wire size");
static_assert(sizeof(PlaceBody) == 16 + kMaxPlacementBytes, "PLACE wire size");
static_assert(offsetof(PlaceBody, placement) == 16, "PLACE layout");
static_assert(sizeof(NotifyBody) == 2, "NOTIFY wire size");
static_assert(sizeof(DataHeader) == 36, "DATA header wire size");
static_assert(offsetof(DataHeader, bytes) == 32, "DATA header layout");
static_assert(sizeof(DataRefBody) == 44, "DATA_REF wire size");

constexpr size_t kMaxControlBody = sizeof(ResyncHeader) + kMaxOutstanding * sizeof(ResyncEntry);

// A decoded control frame (not kData). The bodies are the packed wire structs
// (alignment 1), so each starts on an 8-byte boundary here: their uint64_t
// fields are then aligned, and a reference bound to one (std::map::find,
// std::min) reads an aligned object, not undefined behaviour.
struct ControlFrame {
  FrameType type = FrameType::kHeartbeat;
  alignas(8) HelloBody hello{};
  bool helloAccepted = false;
  uint64_t helloAcceptorTransport = 0;
  bool helloSameHostReads = false;
  alignas(8) CtsBody cts{};
  alignas(8) AckBody ack{};
  alignas(8) ActivateBody activate{};
  alignas(8) ResyncHeader resync{};
  std::vector<ResyncEntry> entries;  // 24-byte records from an aligned allocation
  alignas(8) NotifyBody notify{};
  alignas(8) CancelBody cancel{};
  alignas(8) PlaceBody place{};
};

// Checks magic, type and body length against what `type` allows. Throws
// ProtocolError with what was wrong. `bytes` must hold sizeof(FrameHeader).
FrameHeader parseFrameHeader(const uint8_t* bytes, size_t length);

// Decodes the body of a control frame whose header parseFrameHeader accepted.
ControlFrame decodeControl(const FrameHeader& header, const uint8_t* body, size_t length);

// Encoders return the whole frame, header included.
std::vector<uint8_t> encodeHello(const HelloBody& body);
std::vector<uint8_t> encodeHelloAck(bool accepted, uint64_t acceptorTransport,
                                    bool sameHostReads = false);
std::vector<uint8_t> encodeCts(uint64_t seq, uint64_t bytes);
std::vector<uint8_t> encodeAck(uint64_t seq, uint64_t bytes);
std::vector<uint8_t> encodeActivate(uint64_t epoch, uint8_t pathIndex, uint8_t reason);
std::vector<uint8_t> encodeResync(uint64_t epoch, uint64_t nextSeq,
                                  const std::vector<ResyncEntry>& entries);
std::vector<uint8_t> encodeNotify(uint8_t pathIndex, uint8_t reason);
std::vector<uint8_t> encodeHeartbeat();
std::vector<uint8_t> encodeClose();
std::vector<uint8_t> encodeCancel(uint64_t seq, uint64_t bytes);
// `placement` must be at most kMaxPlacementBytes (Error otherwise).
std::vector<uint8_t> encodePlace(uint64_t seq, bool hostAccessible,
                                 const std::vector<uint8_t>& placement);
FrameHeader dataFrameHeader();
FrameHeader dataRefFrameHeader();

}  // namespace reccl
