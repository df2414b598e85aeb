/* Loads the ReCCL net plugin the way NCCL does and drives every ABI version
 * over loopback, in a plain C process: no torch, no Python.
 *
 *   plugin_dlopen LIBRARY
 *
 * LIBRARY is a path or a bare name (found on LD_LIBRARY_PATH, as NCCL finds
 * NCCL_NET_PLUGIN=reccl -> libnccl-net-reccl.so). It is dlopen()ed with
 * RTLD_NOW | RTLD_LOCAL; ncclNetPlugin_v12, v11, v10 and v8 are looked up in
 * turn (NCCL takes the newest it finds; here every one must be there). For each
 * version: the table's name, init with a logger, devices, getProperties, then a
 * listen / connect / accept and isend / irecv / test exchange of messages of
 * several sizes between a sender (this thread) and a receiver thread, every
 * byte checked. Every wait is bounded. The process must never map libc10,
 * libtorch or libpython (checked in /proc/self/maps at the end).
 * The NICs come from the environment (RECCL_NICS, RECCL_TRANSPORT), as under NCCL.
 * Exit status 0 and "PASS" on the last line when everything held.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl/nccl_abi.h"

#define DEADLINE_SECONDS 20.0
#define MAX_MESSAGE ((1u << 20) + 4099u)

static const size_t kSizes[] = {1, 7, 4099, 65536, 1u << 20, (1u << 20) + 4099u};
#define MESSAGES (sizeof(kSizes) / sizeof(kSizes[0]))

/* Counted from the receiver thread and the plugin's threads too. */
static atomic_int failures;
static atomic_int warnings;

#define CHECK(cond, ...)                               \
  do {                                                 \
    if (!(cond)) {                                     \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                    \
      fprintf(stderr, "\n");                           \
      failures++;                                      \
    }                                                  \
  } while (0)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                   const char* fmt, ...) {
  (void)flags;
  va_list args;
  va_start(args, fmt);
  fprintf(stderr, "[plugin %s %s:%d] ", level == NCCL_LOG_WARN ? "WARN" : "INFO", file, line);
  vfprintf(stderr, fmt, args);
  fprintf(stderr, "\n");
  va_end(args);
  if (level == NCCL_LOG_WARN) warnings++;
}

static unsigned char pattern(int version, size_t message, size_t offset) {
  return (unsigned char)((offset * 131u + message * 29u + (size_t)version * 7u + (offset >> 8)) & 0xff);
}

/* The calls the exchange needs, whatever the version's signatures. */
struct Net {
  int version;
  const char* name;
  void* ctx; /* v11+: what init returned */
  ncclResult_t (*test)(void*, int*, int*);
  ncclResult_t (*accept)(void*, void**, ncclNetDeviceHandle_t**);
  ncclResult_t (*regMr)(void*, void*, size_t, int, void**);
  ncclResult_t (*deregMr)(void*, void*);
  ncclResult_t (*closeSend)(void*);
  ncclResult_t (*closeRecv)(void*);
  ncclResult_t (*closeListen)(void*);
  void* table;
};

static ncclResult_t netIsend(struct Net* n, void* comm, void* data, size_t size, void* mh, void** req) {
  switch (n->version) {
    case 8: return ((ncclNet_v8_t*)n->table)->isend(comm, data, (int)size, 0, mh, req);
    case 10: return ((ncclNet_v10_t*)n->table)->isend(comm, data, size, 0, mh, NULL, req);
    case 11: return ((ncclNet_v11_t*)n->table)->isend(comm, data, size, 0, mh, NULL, req);
    default: return ((ncclNet_v12_t*)n->table)->isend(comm, data, size, 0, mh, NULL, req);
  }
}

static ncclResult_t netIrecv(struct Net* n, void* comm, void* data, size_t size, void* mh, void** req) {
  int tag = 0;
  void* mhandles[1] = {mh};
  void* datas[1] = {data};
  if (n->version == 8) {
    int sizes[1] = {(int)size};
    return ((ncclNet_v8_t*)n->table)->irecv(comm, 1, datas, sizes, &tag, mhandles, req);
  }
  size_t sizes[1] = {size};
  switch (n->version) {
    case 10: return ((ncclNet_v10_t*)n->table)->irecv(comm, 1, datas, sizes, &tag, mhandles, NULL, req);
    case 11: return ((ncclNet_v11_t*)n->table)->irecv(comm, 1, datas, sizes, &tag, mhandles, NULL, req);
    default: return ((ncclNet_v12_t*)n->table)->irecv(comm, 1, datas, sizes, &tag, mhandles, NULL, req);
  }
}

static ncclResult_t netListen(struct Net* n, int dev, void* handle, void** listenComm) {
  switch (n->version) {
    case 8: return ((ncclNet_v8_t*)n->table)->listen(dev, handle, listenComm);
    case 10: return ((ncclNet_v10_t*)n->table)->listen(dev, handle, listenComm);
    case 11: return ((ncclNet_v11_t*)n->table)->listen(n->ctx, dev, handle, listenComm);
    default: return ((ncclNet_v12_t*)n->table)->listen(n->ctx, dev, handle, listenComm);
  }
}

static ncclResult_t netConnect(struct Net* n, int dev, void* handle, void** sendComm) {
  ncclNetDeviceHandle_t* devComm = NULL;
  ncclNetCommConfig_t config = {-1}; /* NCCL's "traffic class undefined" */
  switch (n->version) {
    case 8: return ((ncclNet_v8_t*)n->table)->connect(dev, handle, sendComm, &devComm);
    case 10: return ((ncclNet_v10_t*)n->table)->connect(dev, &config, handle, sendComm, &devComm);
    case 11: return ((ncclNet_v11_t*)n->table)->connect(n->ctx, dev, handle, sendComm, &devComm);
    default: return ((ncclNet_v12_t*)n->table)->connect(n->ctx, dev, handle, sendComm, &devComm);
  }
}

/* Polls test() until done; 0 on success with *size set. */
static int waitRequest(struct Net* n, void* request, int* size, const char* what) {
  double deadline = now() + DEADLINE_SECONDS;
  int done = 0;
  while (now() < deadline) {
    ncclResult_t rc = n->test(request, &done, size);
    if (rc != ncclSuccess) {
      CHECK(0, "v%d %s: test() returned %d", n->version, what, rc);
      return -1;
    }
    if (done) return 0;
  }
  CHECK(0, "v%d %s: not complete within %.0f s", n->version, what, DEADLINE_SECONDS);
  return -1;
}

struct Receiver {
  struct Net* net;
  void* listenComm;
  unsigned char* buffer;
  int ok;
};

static void* receive(void* arg) {
  struct Receiver* r = (struct Receiver*)arg;
  struct Net* n = r->net;
  void* recvComm = NULL;
  ncclNetDeviceHandle_t* devComm = NULL;
  double deadline = now() + DEADLINE_SECONDS;
  while (recvComm == NULL && now() < deadline) {
    ncclResult_t rc = n->accept(r->listenComm, &recvComm, &devComm);
    if (rc != ncclSuccess) {
      CHECK(0, "v%d accept returned %d", n->version, rc);
      return NULL;
    }
  }
  CHECK(recvComm != NULL, "v%d accept: no connection within %.0f s", n->version, DEADLINE_SECONDS);
  if (recvComm == NULL) return NULL;
  void* mhandle = NULL;
  CHECK(n->regMr(recvComm, r->buffer, MAX_MESSAGE, RECCL_NCCL_PTR_HOST, &mhandle) == ncclSuccess,
        "v%d regMr (receiver)", n->version);
  int ok = 1;
  for (size_t m = 0; m < MESSAGES && ok; ++m) {
    memset(r->buffer, 0xEE, MAX_MESSAGE + 1);
    void* request = NULL;
    deadline = now() + DEADLINE_SECONDS;
    /* Posted with room for the largest message, as NCCL posts its whole slot. */
    while (request == NULL && now() < deadline) {
      if (netIrecv(n, recvComm, r->buffer, MAX_MESSAGE, mhandle, &request) != ncclSuccess) break;
    }
    CHECK(request != NULL, "v%d irecv %zu: not posted", n->version, m);
    int size = -1;
    if (request == NULL || waitRequest(n, request, &size, "irecv") != 0) {
      ok = 0;
      break;
    }
    CHECK((size_t)size == kSizes[m], "v%d message %zu: received %d bytes, sent %zu", n->version, m,
          size, kSizes[m]);
    size_t bad = 0;
    for (size_t i = 0; i < kSizes[m]; ++i) {
      if (r->buffer[i] != pattern(n->version, m, i)) bad++;
    }
    CHECK(bad == 0, "v%d message %zu: %zu of %zu bytes differ", n->version, m, bad, kSizes[m]);
    CHECK(r->buffer[kSizes[m]] == 0xEE, "v%d message %zu: a byte past the message was written",
          n->version, m);
    if (bad != 0 || (size_t)size != kSizes[m]) ok = 0;
  }
  CHECK(n->deregMr(recvComm, mhandle) == ncclSuccess, "v%d deregMr (receiver)", n->version);
  CHECK(n->closeRecv(recvComm) == ncclSuccess, "v%d closeRecv", n->version);
  r->ok = ok;
  return NULL;
}

/* One connection on device `dev`: every message sent, received and checked. */
static int exchange(struct Net* n, int dev) {
  unsigned char handle[RECCL_NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof(handle));
  void* listenComm = NULL;
  if (netListen(n, dev, handle, &listenComm) != ncclSuccess || listenComm == NULL) {
    CHECK(0, "v%d listen on device %d", n->version, dev);
    return -1;
  }
  struct Receiver receiver = {n, listenComm, malloc(MAX_MESSAGE + 1), 0};
  unsigned char* send = malloc(MAX_MESSAGE);
  pthread_t thread;
  pthread_create(&thread, NULL, receive, &receiver);

  void* sendComm = NULL;
  double deadline = now() + DEADLINE_SECONDS;
  while (sendComm == NULL && now() < deadline) {
    ncclResult_t rc = netConnect(n, dev, handle, &sendComm);
    if (rc != ncclSuccess) {
      CHECK(0, "v%d connect returned %d", n->version, rc);
      break;
    }
  }
  CHECK(sendComm != NULL, "v%d connect: not connected within %.0f s", n->version, DEADLINE_SECONDS);
  if (sendComm != NULL) {
    void* mhandle = NULL;
    CHECK(n->regMr(sendComm, send, MAX_MESSAGE, RECCL_NCCL_PTR_HOST, &mhandle) == ncclSuccess,
          "v%d regMr (sender)", n->version);
    for (size_t m = 0; m < MESSAGES; ++m) {
      for (size_t i = 0; i < kSizes[m]; ++i) send[i] = pattern(n->version, m, i);
      void* request = NULL;
      deadline = now() + DEADLINE_SECONDS;
      while (request == NULL && now() < deadline) {
        if (netIsend(n, sendComm, send, kSizes[m], mhandle, &request) != ncclSuccess) break;
      }
      CHECK(request != NULL, "v%d isend %zu: not posted", n->version, m);
      int size = -1;
      if (request == NULL || waitRequest(n, request, &size, "isend") != 0) break;
      CHECK((size_t)size == kSizes[m], "v%d isend %zu: test() says %d bytes", n->version, m, size);
    }
    pthread_join(thread, NULL);
    CHECK(n->deregMr(sendComm, mhandle) == ncclSuccess, "v%d deregMr (sender)", n->version);
    CHECK(n->closeSend(sendComm) == ncclSuccess, "v%d closeSend", n->version);
  } else {
    pthread_join(thread, NULL); /* the receiver's accept gives up at its deadline */
  }
  CHECK(n->closeListen(listenComm) == ncclSuccess, "v%d closeListen", n->version);
  free(send);
  free(receiver.buffer);
  CHECK(receiver.ok, "v%d device %d: the exchange did not complete intact", n->version, dev);
  return receiver.ok ? 0 : -1;
}

/* Common property checks; `props` is any version's struct (same leading fields). */
#define CHECK_COMMON_PROPS(n, dev, p)                                                          \
  do {                                                                                       \
    CHECK((p).name != NULL && (p).name[0] != '\0', "v%d dev %d: no name", (n)->version, dev); \
    CHECK((p).ptrSupport & RECCL_NCCL_PTR_HOST, "v%d dev %d: ptrSupport 0x%x lacks host",     \
          (n)->version, dev, (p).ptrSupport);                                                \
    CHECK((p).guid == (uint64_t)(dev), "v%d dev %d: guid %llu", (n)->version, dev,             \
          (unsigned long long)(p).guid);                                                     \
    CHECK((p).speed > 0, "v%d dev %d: speed %d Mbps", (n)->version, dev, (p).speed);          \
    CHECK((p).maxComms > 0, "v%d dev %d: maxComms %d", (n)->version, dev, (p).maxComms);      \
    CHECK((p).maxRecvs == 1, "v%d dev %d: maxRecvs %d", (n)->version, dev, (p).maxRecvs);     \
    CHECK((p).netDeviceType == NCCL_NET_DEVICE_HOST, "v%d dev %d: device type %d",           \
          (n)->version, dev, (int)(p).netDeviceType);                                        \
  } while (0)

#define CHECK_V10_PROPS(n, dev, p)                                                            \
  do {                                                                                      \
    CHECK((p).vProps.ndevs == 1 && (p).vProps.devs[0] == (dev), "v%d dev %d: vProps %d/%d", \
          (n)->version, dev, (p).vProps.ndevs, (p).vProps.devs[0]);                         \
    CHECK((p).maxP2pBytes > 0 && (p).maxCollBytes > 0, "v%d dev %d: max bytes %zu/%zu",     \
          (n)->version, dev, (p).maxP2pBytes, (p).maxCollBytes);                            \
  } while (0)

static void checkProperties(struct Net* n, int dev) {
  ncclResult_t rc;
  switch (n->version) {
    case 8: {
      ncclNetProperties_v8_t p;
      memset(&p, 0, sizeof(p));
      rc = ((ncclNet_v8_t*)n->table)->getProperties(dev, &p);
      CHECK(rc == ncclSuccess, "v8 getProperties(%d) returned %d", dev, rc);
      CHECK_COMMON_PROPS(n, dev, p);
      printf("v8 dev %d: %s, %d Mbps, ptrSupport 0x%x\n", dev, p.name, p.speed, p.ptrSupport);
      break;
    }
    case 10: {
      ncclNetProperties_v10_t p;
      memset(&p, 0, sizeof(p));
      rc = ((ncclNet_v10_t*)n->table)->getProperties(dev, &p);
      CHECK(rc == ncclSuccess, "v10 getProperties(%d) returned %d", dev, rc);
      CHECK_COMMON_PROPS(n, dev, p);
      CHECK_V10_PROPS(n, dev, p);
      break;
    }
    case 11: {
      ncclNetProperties_v11_t p;
      memset(&p, 0, sizeof(p));
      rc = ((ncclNet_v11_t*)n->table)->getProperties(dev, &p);
      CHECK(rc == ncclSuccess, "v11 getProperties(%d) returned %d", dev, rc);
      CHECK_COMMON_PROPS(n, dev, p);
      CHECK_V10_PROPS(n, dev, p);
      CHECK(p.maxMultiRequestSize == 1, "v11 dev %d: maxMultiRequestSize %d", dev, p.maxMultiRequestSize);
      break;
    }
    default: {
      ncclNetProperties_v12_t p;
      memset(&p, 0, sizeof(p));
      rc = ((ncclNet_v12_t*)n->table)->getProperties(dev, &p);
      CHECK(rc == ncclSuccess, "v12 getProperties(%d) returned %d", dev, rc);
      CHECK_COMMON_PROPS(n, dev, p);
      CHECK_V10_PROPS(n, dev, p);
      CHECK(p.maxMultiRequestSize == 1, "v12 dev %d: maxMultiRequestSize %d", dev, p.maxMultiRequestSize);
      CHECK(p.railId == dev && p.planeId == -1, "v12 dev %d: rail %d plane %d", dev, p.railId, p.planeId);
      break;
    }
  }
}

#define FILL_NET(net, t)                 \
  do {                                   \
    (net).name = (t)->name;              \
    (net).test = (t)->test;              \
    (net).accept = (t)->accept;          \
    (net).regMr = (t)->regMr;            \
    (net).deregMr = (t)->deregMr;        \
    (net).closeSend = (t)->closeSend;    \
    (net).closeRecv = (t)->closeRecv;    \
    (net).closeListen = (t)->closeListen; \
    (net).table = (t);                   \
  } while (0)

static int runVersion(void* library, int version) {
  char symbol[32];
  snprintf(symbol, sizeof(symbol), "ncclNetPlugin_v%d", version);
  void* table = dlsym(library, symbol);
  CHECK(table != NULL, "%s not exported: %s", symbol, dlerror());
  if (table == NULL) return -1;
  struct Net n;
  memset(&n, 0, sizeof(n));
  n.version = version;
  ncclResult_t rc;
  ncclResult_t (*devices)(int*) = NULL;
  switch (version) {
    case 8: {
      ncclNet_v8_t* t = (ncclNet_v8_t*)table;
      FILL_NET(n, t);
      rc = t->init(logger);
      devices = t->devices;
      break;
    }
    case 10: {
      ncclNet_v10_t* t = (ncclNet_v10_t*)table;
      FILL_NET(n, t);
      rc = t->init(logger, NULL);
      devices = t->devices;
      break;
    }
    case 11: {
      ncclNet_v11_t* t = (ncclNet_v11_t*)table;
      FILL_NET(n, t);
      ncclNetCommConfig_t config = {-1};
      rc = t->init(&n.ctx, 0x1234, &config, logger, NULL);
      devices = t->devices;
      break;
    }
    default: {
      ncclNet_v12_t* t = (ncclNet_v12_t*)table;
      FILL_NET(n, t);
      ncclNetCommConfig_t config = {-1};
      rc = t->init(&n.ctx, 0x1234, &config, logger, NULL);
      devices = t->devices;
      break;
    }
  }
  CHECK(n.name != NULL && strcmp(n.name, "ReCCL") == 0, "%s: name '%s', expected ReCCL", symbol,
        n.name ? n.name : "(null)");
  CHECK(rc == ncclSuccess, "%s: init returned %d", symbol, rc);
  if (rc != ncclSuccess) return -1;
  if (version >= 11) CHECK(n.ctx != NULL, "%s: init gave no context", symbol);
  int count = 0;
  CHECK(devices(&count) == ncclSuccess && count >= 1, "%s: devices gave %d", symbol, count);
  printf("v%d: %s, %d devices\n", version, n.name, count);
  for (int dev = 0; dev < count; ++dev) checkProperties(&n, dev);
  if (version == 8) {  /* a device out of range is refused with one warning, not read past */
    ncclNetProperties_v8_t p;
    int before = atomic_load(&warnings);
    CHECK(((ncclNet_v8_t*)table)->getProperties(count, &p) == ncclInvalidArgument,
          "v8 getProperties(%d) of %d devices was not refused", count, count);
    CHECK(atomic_load(&warnings) == before + 1, "v8 getProperties(%d): no warning logged", count);
    atomic_fetch_sub(&warnings, 1);
  }
  int result = 0;
  for (int dev = 0; dev < count; ++dev) {
    if (exchange(&n, dev) != 0) result = -1;
  }
  if (version == 11) CHECK(((ncclNet_v11_t*)table)->finalize(n.ctx) == ncclSuccess, "v11 finalize");
  if (version == 12) CHECK(((ncclNet_v12_t*)table)->finalize(n.ctx) == ncclSuccess, "v12 finalize");
  if (result == 0) printf("v%d: %zu messages on each of %d devices intact\n", version, MESSAGES, count);
  return result;
}

/* 1 when /proc/self/maps names a library that must not be in this process. */
static int torchOrPythonMapped(void) {
  FILE* maps = fopen("/proc/self/maps", "r");
  if (maps == NULL) {
    CHECK(0, "cannot read /proc/self/maps");
    return 1;
  }
  char line[4096];
  int found = 0;
  while (fgets(line, sizeof(line), maps) != NULL) {
    if (strstr(line, "libc10") || strstr(line, "libtorch") || strstr(line, "libpython")) {
      fprintf(stderr, "FAIL: mapped: %s", line);
      found = 1;
    }
  }
  fclose(maps);
  return found;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s LIBRARY (a path, or a name on LD_LIBRARY_PATH)\n", argv[0]);
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    fprintf(stderr, "FAIL: dlopen(%s): %s\n", argv[1], dlerror());
    return 1;
  }
  static const int kVersions[] = {12, 11, 10, 8};  /* NCCL's order: newest first */
  for (size_t i = 0; i < sizeof(kVersions) / sizeof(kVersions[0]); ++i) runVersion(library, kVersions[i]);
  CHECK(!torchOrPythonMapped(), "torch or Python libraries were loaded");
  CHECK(atomic_load(&warnings) == 0, "the plugin logged %d unexpected warnings", atomic_load(&warnings));
  /* No dlclose: the library is linked -z nodelete, as NCCL's dlclose would find. */
  if (failures != 0) {
    fprintf(stderr, "%d checks failed\n", atomic_load(&failures));
    return 1;
  }
  printf("PASS\n");
  return 0;
}
