// The exported plugin tables, one per NCCL ABI version. Each entry adapts one
// version's signature to NetPlugin; nothing here decides anything.
#include "nccl/nccl_abi.h"
#include "nccl/net_plugin.h"

namespace reccl {
namespace {

NetPlugin& plugin() { return NetPlugin::instance(); }

template <typename Props>
ncclResult_t fillCommon(int dev, Props* props) {
  NetDeviceProps common{};
  ncclResult_t result = plugin().properties(dev, &common);
  if (result != ncclSuccess) return result;
  props->name = const_cast<char*>(common.name);
  props->pciPath = const_cast<char*>(common.pciPath);
  props->guid = common.guid;
  props->ptrSupport = common.ptrSupport;
  props->regIsGlobal = 0;
  props->speed = common.speedMbps;
  props->port = 0;
  props->latency = 0;
  props->maxComms = common.maxComms;
  props->maxRecvs = common.maxRecvs;
  props->netDeviceType = NCCL_NET_DEVICE_HOST;
  props->netDeviceVersion = 0;
  return ncclSuccess;
}

template <typename Props>
ncclResult_t fillV10Plus(int dev, Props* props) {
  ncclResult_t result = fillCommon(dev, props);
  if (result != ncclSuccess) return result;
  props->forceFlush = 0;
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = dev;
  props->maxP2pBytes = NetPlugin::kMaxTransferBytes;
  props->maxCollBytes = NetPlugin::kMaxTransferBytes;
  return ncclSuccess;
}

ncclResult_t getPropertiesV8(int dev, ncclNetProperties_v8_t* props) {
  return fillCommon(dev, props);
}
ncclResult_t getPropertiesV10(int dev, ncclNetProperties_v10_t* props) {
  return fillV10Plus(dev, props);
}
ncclResult_t getPropertiesV11(int dev, ncclNetProperties_v11_t* props) {
  ncclResult_t result = fillV10Plus(dev, props);
  if (result != ncclSuccess) return result;
  props->maxMultiRequestSize = 1;
  return ncclSuccess;
}
ncclResult_t getPropertiesV12(int dev, ncclNetProperties_v12_t* props) {
  ncclResult_t result = fillV10Plus(dev, props);
  if (result != ncclSuccess) return result;
  props->maxMultiRequestSize = 1;
  props->railId = static_cast<int16_t>(dev);  // the NIC order is the rail order
  props->planeId = -1;
  return ncclSuccess;
}

ncclResult_t initV8(ncclDebugLogger_t logger) { return plugin().init(logger); }
ncclResult_t initV10(ncclDebugLogger_t logger, ncclProfilerCallback_t) {
  return plugin().init(logger);
}
ncclResult_t initV11(void** ctx, uint64_t, ncclNetCommConfig_t*, ncclDebugLogger_t logger,
                     ncclProfilerCallback_t) {
  *ctx = &plugin();  // one transport serves every communicator
  return plugin().init(logger);
}
ncclResult_t finalizeV11(void*) { return ncclSuccess; }
ncclResult_t setNetAttrV11(void*, ncclNetAttr_t*) { return ncclSuccess; }

ncclResult_t devices(int* count) { return plugin().devices(count); }
ncclResult_t listen(int dev, void* handle, void** listenComm) {
  return plugin().listen(dev, handle, listenComm);
}
ncclResult_t listenV11(void*, int dev, void* handle, void** listenComm) {
  return plugin().listen(dev, handle, listenComm);
}
ncclResult_t connectV8(int dev, void* handle, void** sendComm, ncclNetDeviceHandle_t** devComm) {
  if (devComm != nullptr) *devComm = nullptr;
  return plugin().connect(dev, handle, sendComm);
}
ncclResult_t connectV10(int dev, ncclNetCommConfig_t*, void* handle, void** sendComm,
                        ncclNetDeviceHandle_t** devComm) {
  return connectV8(dev, handle, sendComm, devComm);
}
ncclResult_t connectV11(void*, int dev, void* handle, void** sendComm,
                        ncclNetDeviceHandle_t** devComm) {
  return connectV8(dev, handle, sendComm, devComm);
}
ncclResult_t accept(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** devComm) {
  if (devComm != nullptr) *devComm = nullptr;
  return plugin().accept(listenComm, recvComm);
}
ncclResult_t regMr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return plugin().regMr(comm, data, size, type, mhandle);
}
ncclResult_t regMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                         void** mhandle) {
  return plugin().regMrDmaBuf(comm, data, size, type, offset, fd, mhandle);
}
ncclResult_t deregMr(void* comm, void* mhandle) { return plugin().deregMr(comm, mhandle); }
ncclResult_t isendV8(void* sendComm, void* data, int size, int, void* mhandle, void** request) {
  if (size < 0) return ncclInvalidArgument;
  return plugin().isend(sendComm, data, static_cast<size_t>(size), mhandle, request);
}
ncclResult_t isendV10(void* sendComm, void* data, size_t size, int, void* mhandle, void*,
                      void** request) {
  return plugin().isend(sendComm, data, size, mhandle, request);
}
ncclResult_t irecvV8(void* recvComm, int n, void** data, int* sizes, int*, void** mhandles,
                     void** request) {
  if (n < 1 || n > 8) return ncclInvalidArgument;
  size_t wide[8];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) return ncclInvalidArgument;
    wide[i] = static_cast<size_t>(sizes[i]);
  }
  return plugin().irecv(recvComm, n, data, wide, mhandles, request);
}
ncclResult_t irecvV10(void* recvComm, int n, void** data, size_t* sizes, int*, void** mhandles,
                      void**, void** request) {
  return plugin().irecv(recvComm, n, data, sizes, mhandles, request);
}
ncclResult_t iflush(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                    void** request) {
  return plugin().iflush(recvComm, n, data, sizes, mhandles, request);
}
ncclResult_t test(void* request, int* done, int* sizes) {
  return plugin().test(request, done, sizes);
}
ncclResult_t closeSend(void* comm) { return plugin().closeSend(comm); }
ncclResult_t closeRecv(void* comm) { return plugin().closeRecv(comm); }
ncclResult_t closeListen(void* comm) { return plugin().closeListen(comm); }
ncclResult_t getDeviceMr(void*, void*, void**) { return ncclInternalError; }  // no device offload
ncclResult_t irecvConsumed(void*, int, void*) { return ncclSuccess; }

}  // namespace
}  // namespace reccl

using namespace reccl;

extern "C" {

__attribute__((visibility("default"))) ncclNet_v8_t ncclNetPlugin_v8 = {
    "ReCCL",   initV8,      devices,     getPropertiesV8, listen,       connectV8, accept,
    regMr,     regMrDmaBuf, deregMr,     isendV8,         irecvV8,      iflush,    test,
    closeSend, closeRecv,   closeListen, getDeviceMr,     irecvConsumed};

__attribute__((visibility("default"))) ncclNet_v10_t
    ncclNetPlugin_v10 =
        {
            "ReCCL",       initV10, devices,     getPropertiesV10, listen,      connectV10,
            accept,        regMr,   regMrDmaBuf, deregMr,          isendV10,    irecvV10,
            iflush,        test,    closeSend,   closeRecv,        closeListen, getDeviceMr,
            irecvConsumed, nullptr /* makeVDevice: no NIC merging; s-Bond is our bonding */};

__attribute__((visibility("default"))) ncclNet_v11_t ncclNetPlugin_v11 = {
    "ReCCL",       initV11, devices,     getPropertiesV11, listenV11,   connectV11,
    accept,        regMr,   regMrDmaBuf, deregMr,          isendV10,    irecvV10,
    iflush,        test,    closeSend,   closeRecv,        closeListen, getDeviceMr,
    irecvConsumed, nullptr, finalizeV11, setNetAttrV11};

__attribute__((visibility("default"))) ncclNet_v12_t ncclNetPlugin_v12 = {
    "ReCCL",       initV11, devices,     getPropertiesV12, listenV11,   connectV11,
    accept,        regMr,   regMrDmaBuf, deregMr,          isendV10,    irecvV10,
    iflush,        test,    closeSend,   closeRecv,        closeListen, getDeviceMr,
    irecvConsumed, nullptr, finalizeV11, setNetAttrV11};

}  // extern "C"
