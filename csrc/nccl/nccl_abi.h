// Our own declarations of NCCL's network plugin ABI (ext-net), versions 8, 10,
// 11 and 12, written from NCCL's public plugin documentation and headers. Field
// order is the ABI: change nothing without checking NCCL's definition. Plain C
// too: tests/helpers/c/plugin_dlopen.c drives the library through these tables.
#pragma once

#ifdef __cplusplus
#include <cstddef>
#include <cstdint>
extern "C" {
#else
#include <stddef.h>
#include <stdint.h>
#endif

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5,
} ncclDebugLogLevel;

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                  int line, const char* fmt, ...);
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* pHandle,
                                               int64_t pluginId, void* extData);

#define RECCL_NCCL_PTR_HOST 0x1
#define RECCL_NCCL_PTR_CUDA 0x2
#define RECCL_NCCL_PTR_DMABUF 0x4
#define RECCL_NCCL_NET_HANDLE_MAXSIZE 128
#define RECCL_NCCL_NET_LOG_FLAG 0x10  // NCCL_NET debug subsystem

typedef enum { NCCL_NET_DEVICE_HOST = 0, NCCL_NET_DEVICE_UNPACK = 1 } ncclNetDeviceType;

typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_t;  // identical in v7..v12

// ---- v8 (NCCL 2.19 - 2.22) ----
typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int speed;  // Mbps
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
} ncclNetProperties_v8_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v8_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, void* handle, void** sendComm,
                          ncclNetDeviceHandle_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, int size, int tag, void* mhandle,
                        void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles,
                        void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
} ncclNet_v8_t;

// ---- v10 (NCCL 2.23 - 2.27) ----
typedef struct {
  int ndevs;
  int devs[4];
} ncclNetVDeviceProps_v10_t;

typedef struct {
  int trafficClass;
} ncclNetCommConfig_t;  // identical in v10..v12

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v10_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
} ncclNetProperties_v10_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v10_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, ncclNetCommConfig_t* config, void* handle, void** sendComm,
                          ncclNetDeviceHandle_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v10_t* props);
} ncclNet_v10_t;

// ---- v11 (NCCL 2.28 - 2.29) and v12 (NCCL 2.30) ----
typedef struct {
  int32_t maxConcurrentPeers;
  int32_t minConcurrentPeers;
  int32_t maxFlowsPerPeer;
  int32_t minFlowsPerPeer;
} ncclNetCommAttr_t;

typedef struct {
  ncclNetCommAttr_t sendCommAttr;
  ncclNetCommAttr_t recvCommAttr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
} ncclNetAttr_t;

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v10_t vProps;  // 4 devices in v11
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
} ncclNetProperties_v11_t;

typedef struct {
  int ndevs;
  int devs[8];
} ncclNetVDeviceProps_v12_t;

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v12_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
  int16_t railId;
  int16_t planeId;
} ncclNetProperties_v12_t;

#define RECCL_NCCL_NET_V11_FIELDS(PROPS, VPROPS)                                                  \
  const char* name;                                                                               \
  ncclResult_t (*init)(void** ctx, uint64_t commId, ncclNetCommConfig_t* config,                  \
                       ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);       \
  ncclResult_t (*devices)(int* ndev);                                                             \
  ncclResult_t (*getProperties)(int dev, PROPS* props);                                           \
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);                    \
  ncclResult_t (*connect)(void* ctx, int dev, void* handle, void** sendComm,                      \
                          ncclNetDeviceHandle_t** sendDevComm);                                   \
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** recvDevComm); \
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);           \
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,     \
                              int fd, void** mhandle);                                            \
  ncclResult_t (*deregMr)(void* comm, void* mhandle);                                             \
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,          \
                        void* phandle, void** request);                                           \
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,             \
                        void** mhandles, void** phandles, void** request);                        \
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,         \
                         void** request);                                                         \
  ncclResult_t (*test)(void* request, int* done, int* sizes);                                     \
  ncclResult_t (*closeSend)(void* sendComm);                                                      \
  ncclResult_t (*closeRecv)(void* recvComm);                                                      \
  ncclResult_t (*closeListen)(void* listenComm);                                                  \
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);                    \
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);                            \
  ncclResult_t (*makeVDevice)(int* d, VPROPS* props);                                             \
  ncclResult_t (*finalize)(void* ctx);                                                            \
  ncclResult_t (*setNetAttr)(void* ctx, ncclNetAttr_t* netAttr);

typedef struct {
  RECCL_NCCL_NET_V11_FIELDS(ncclNetProperties_v11_t, ncclNetVDeviceProps_v10_t)
} ncclNet_v11_t;

typedef struct {
  RECCL_NCCL_NET_V11_FIELDS(ncclNetProperties_v12_t, ncclNetVDeviceProps_v12_t)
} ncclNet_v12_t;

#ifdef __cplusplus
}  // extern "C"
#endif
