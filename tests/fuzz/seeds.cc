// Writes the seed inputs of every harness (valid encodings made by the
// product's own encoders) into corpus/<harness>/seed-*, in each harness's input
// form (the leading selector or group-size bytes included). Run by
// `python tests/fuzz/run.py seed`; the files are kept in the repository.
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/frame.h"
#include "engine/agreement.h"
#include "engine/descriptor.h"
#include "engine/p2p_header.h"
#include "pg/fault_record.h"
#include "transport/handle.h"
#include "transport/ib/ib_registration.h"
#include "transport/ib/qp_exchange.h"

namespace {

using Bytes = std::vector<uint8_t>;
std::string root;

void write(const std::string& harness, const std::string& name, const Bytes& bytes) {
  const std::string folder = root + "/" + harness;
  ::mkdir(folder.c_str(), 0755);
  std::ofstream(folder + "/seed-" + name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

Bytes cat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const Bytes& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

Bytes groupSizeBytes(int groupSize) {
  const int stored = groupSize - 1;
  return {static_cast<uint8_t>(stored & 0xff), static_cast<uint8_t>(stored >> 8)};
}

void frames() {
  using namespace reccl;
  HelloBody hello{};
  hello.version = kProtocolVersion;
  hello.socketKind = static_cast<uint8_t>(SocketKind::kData);
  hello.socketIndex = 1;
  hello.socketCount = 4;
  hello.listenId = 7;
  hello.connectionId = 9;
  std::snprintf(hello.senderNicName, kNicNameBytes, "eth0");
  const Bytes helloFrame = encodeHello(hello);
  write("frame", "hello", helloFrame);
  write("frame", "hello-ack", encodeHelloAck(true, 42, true));
  write("frame", "control-stream",
        cat({encodeCts(1, 4096), encodeAck(1, 4096), encodeActivate(3, 1, 2), encodeNotify(0, 1),
             encodeHeartbeat(), encodeCancel(2, 1 << 20), encodeClose()}));
  write("frame", "resync", encodeResync(4, 10, {{8, 4096, 0}, {9, 8192, 4096}}));
  write("frame", "place", encodePlace(5, true, Bytes(40, 0xab)));
  FrameHeader data = dataFrameHeader();
  Bytes dataFrame(sizeof(data) + sizeof(DataHeader), 0);
  std::memcpy(dataFrame.data(), &data, sizeof(data));
  write("frame", "data-then-cts", cat({dataFrame, encodeCts(3, 64)}));
}

void handles() {
  reccl::ListenHandle handle;
  handle.listenId = 0x1234;
  handle.chunkBytes = 1 << 20;
  handle.listenerNic = 1;
  handle.listenerBackup = 0;
  handle.nics = {{"10.0.0.1", 5000}, {"10.0.1.1", 5001}};
  write("handle", "two-nics", reccl::encodeHandle(handle));
  handle.listenerBackup = -1;
  handle.listenerNic = 0;
  handle.nics.resize(1);
  write("handle", "one-nic", reccl::encodeHandle(handle));
}

void qpExchanges() {
  using reccl::QpExchange;
  QpExchange sender;
  sender.role = QpExchange::Role::kSender;
  sender.qp.qpNumber = 0x11;
  sender.qp.packetSequence = 0x123;
  sender.regionAddress = 0x7f0000001000;
  sender.slotCount = 16;
  sender.slotBytes = 8;
  write("qp_exchange", "sender", cat({{0}, reccl::encodeQpExchange(sender)}));
  QpExchange receiver = sender;
  receiver.role = QpExchange::Role::kReceiver;
  receiver.ethernet = false;
  receiver.slotBytes = (1 << 20) + 4096;
  write("qp_exchange", "receiver", cat({{1}, reccl::encodeQpExchange(receiver)}));
}

void placements() {
  reccl::IbPlacement placement;
  placement.address = 0x7f0000002000;
  placement.capacity = 1 << 20;
  placement.rkeys = {0x100, 0x200, 0};
  placement.present = 0x3;
  write("ib_placement", "two-of-three", placement.encode());
}

reccl::OpDescriptor allreduce() {
  reccl::OpDescriptor desc =
      reccl::OpDescriptor::of(reccl::OpKind::kAllreduce, reccl::DataType::kFloat32, 1024);
  desc.seq = 17;
  desc.chunkBytes = 1 << 20;
  desc.channels = 2;
  return desc;
}

void descriptors() {
  Bytes wire(reccl::kDescriptorBytes);
  reccl::encodeDescriptor(allreduce(), 3, 8, wire.data());
  write("descriptor", "allreduce", cat({groupSizeBytes(8), wire}));
  reccl::OpDescriptor rejected =
      reccl::OpDescriptor::of(reccl::OpKind::kScatter, reccl::DataType::kInt64, 10, 0);
  rejected.rejection.reason = reccl::Rejection::Reason::kListLength;
  rejected.rejection.argument = "scatter_list";
  rejected.rejection.got = 3;
  rejected.rejection.want = 4;
  reccl::encodeDescriptor(rejected, 0, 4, wire.data());
  write("descriptor", "rejection", cat({groupSizeBytes(4), wire}));
}

void agreements() {
  const int groupSize = 16;
  reccl::RankFaults faults;
  faults.opsDone = 5;
  faults.backupChannels = 1;
  reccl::Agreement low = reccl::Agreement::of(2, allreduce(), faults, 99);
  reccl::OpDescriptor other = allreduce();
  other.count = 2048;
  reccl::Agreement high = reccl::Agreement::of(9, other, {}, 7);
  Bytes a(reccl::kAgreementBytes), b(reccl::kAgreementBytes);
  reccl::encodeAgreement(low, groupSize, a.data());
  reccl::encodeAgreement(high, groupSize, b.data());
  write("agreement", "one", cat({groupSizeBytes(groupSize), a}));
  write("agreement", "two-disagreeing", cat({groupSizeBytes(groupSize), a, b}));
  low.merge(high);
  reccl::encodeAgreement(low, groupSize, a.data());
  write("agreement", "merged", cat({groupSizeBytes(groupSize), a}));
}

void faultBoard() {
  reccl::BoardRecord record{12, 0x2, 1000, 1700000000000000000, 0x1};
  write("fault_board", "record", cat({{0}, reccl::encodeBoardRecord(record)}));
  write("fault_board", "log",
        cat({{1}, reccl::boardLogEntry(3), reccl::boardLogEntry(12), reccl::boardLogEntry(3)}));
}

void p2pHeaders() {
  reccl::P2pMessage message;
  message.tag = 5;
  message.sender = 1;
  message.dtype = reccl::DataType::kBFloat16;
  message.count = 300;
  message.bytes = 600;
  Bytes wire(reccl::kP2pHeaderBytes);
  reccl::encodeP2pHeader(message, wire.data());
  write("p2p_header", "bf16", wire);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT\n", argv[0]);
    return 2;
  }
  root = argv[1];
  ::mkdir(root.c_str(), 0755);
  frames();
  handles();
  qpExchanges();
  placements();
  descriptors();
  agreements();
  faultBoard();
  p2pHeaders();
  return 0;
}
