// The version-independent NCCL net plugin: NCCL's listen/connect/accept/isend/
// irecv/test mapped onto the transport's bonded connections. Everything that
// makes failover work lives below this layer; this one only translates. The
// transport (TCP or IB verbs) is chosen at init by RECCL_TRANSPORT.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/nvl.h"
#include "nccl/nccl_abi.h"
#include "transport/ib/verbs_api.h"
#include "transport/transport.h"

namespace reccl {

struct NetDeviceProps {
  const char* name;
  const char* pciPath;  // nullptr for virtual interfaces
  uint64_t guid;
  int speedMbps;
  int ptrSupport;  // RECCL_NCCL_PTR_* bits
  int maxComms;
  int maxRecvs;
  size_t maxTransferBytes;
};

class NetPlugin {
 public:
  // One per process: NCCL's ABI gives v8/v10 entry points no context object.
  static NetPlugin& instance();

  ncclResult_t init(ncclDebugLogger_t logger);
  // Provider installation: the verbs API the IB transport runs over instead of
  // dlopening the system libibverbs (any VerbsApi implementation; the tests
  // install the emulation of torch_reccl._testing). Must come before init();
  // throws Error after it.
  void useVerbs(std::shared_ptr<VerbsApi> verbs);
  // Provider installation: the CUDA API NVL stages GPU buffers with instead of
  // the CUDA driver in reccl's own contexts (the tests install the emulation of
  // torch_reccl._testing). Must come before init(); throws Error after it.
  void useCuda(std::shared_ptr<CudaApi> cuda);
  // "tcp" or "ib" once init() succeeded, else "".
  std::string transportKind();
  ncclResult_t devices(int* count);
  ncclResult_t properties(int dev, NetDeviceProps* props);
  ncclResult_t listen(int dev, void* handle, void** listenComm);
  ncclResult_t connect(int dev, void* handle, void** sendComm);
  ncclResult_t accept(void* listenComm, void** recvComm);
  ncclResult_t regMr(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t regMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                           void** mhandle);
  ncclResult_t deregMr(void* comm, void* mhandle);
  ncclResult_t isend(void* sendComm, void* data, size_t size, void* mhandle, void** request);
  ncclResult_t irecv(void* recvComm, int n, void** data, const size_t* sizes, void** mhandles,
                     void** request);
  ncclResult_t iflush(void* recvComm, int n, void** data, const int* sizes, void** mhandles,
                      void** request);
  ncclResult_t test(void* request, int* done, int* sizes);
  ncclResult_t closeSend(void* sendComm);
  ncclResult_t closeRecv(void* recvComm);
  ncclResult_t closeListen(void* listenComm);

  // Both transports: one receive per irecv (no grouped receives). TCP stages
  // host memory (regMr registers nothing); IB registers what regMr and
  // regMrDmaBuf are given on every device, for direct placement (zero copy;
  // RECCL_IB_ZERO_COPY). GPU buffers are claimed with dma-buf GPUDirect on IB
  // where the verbs library supports it (it wins over NVL), else only with NVL
  // (gpu/nvl.h), which stages them to host memory itself.
  static constexpr int kMaxRecvs = 1;
  static constexpr size_t kMaxTransferBytes = 1ull << 30;  // NCCL's MAX_NET_SIZE

 private:
  NetPlugin() = default;
  // Runs an entry point; an exception becomes a logged ncclSystemError, since
  // nothing may propagate into NCCL.
  template <typename Fn>
  ncclResult_t guard(const char* what, Fn&& fn) {
    try {
      return fn();
    } catch (const std::exception& error) {
      warn(std::string(what) + ": " + error.what());
      return ncclSystemError;
    }
  }
  void warn(const std::string& message);
  void info(const std::string& message);
  Transport* transport();

  std::mutex mutex_;
  ncclDebugLogger_t logger_ = nullptr;
  std::shared_ptr<VerbsApi> verbs_;  // null: the system library, if any
  std::shared_ptr<CudaApi> cuda_;    // null: the CUDA driver (own contexts), if any
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Nvl> nvl_;  // null: host buffers only
  // GPUDirect: by dma-buf (IB with zero copy, and GPUs that export dma-bufs)
  // or by pointer (a peer-memory module); why not, when not.
  bool dmaBuf_ = false;
  std::string dmaBufWhy_;
  bool peerMemory_ = false;
  std::string peerMemoryWhy_;
  std::vector<std::string> names_;
};

}  // namespace reccl
