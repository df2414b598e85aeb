/* A plain C NCCL program (no torch, no Python): one rank of a two-rank all_reduce
 * whose bytes cross whatever net plugin NCCL_NET_PLUGIN names. Rank 0 writes the
 * NCCL unique id to a file, rank 1 waits for it (bounded). Checks every element of
 * an in-place sum repeated `iters` times, times `iters` more back to back, and
 * reports which of libtorch/libc10/libpython ended up mapped (none may).
 *
 *   nccl_allreduce RANK ID_FILE COUNT ITERS
 *
 * Prints "RESULT-OK rank=R busbw_GBps=X foreign=<libs or none>" or exits non-zero
 * with the reason. Built and run by tests/gpu/test_plugin_c_nccl.py. */
#define _GNU_SOURCE
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NRANKS 2

static void die(const char* what, const char* detail) {
  fprintf(stderr, "nccl_allreduce: %s: %s\n", what, detail);
  exit(1);
}

#define CUDA(call)                                               \
  do {                                                           \
    cudaError_t e_ = (call);                                     \
    if (e_ != cudaSuccess) die(#call, cudaGetErrorString(e_));   \
  } while (0)
#define NCCL(call)                                               \
  do {                                                           \
    ncclResult_t r_ = (call);                                    \
    if (r_ != ncclSuccess) die(#call, ncclGetErrorString(r_));   \
  } while (0)

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void exchange_id(int rank, const char* path, ncclUniqueId* id) {
  if (rank == 0) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0) die("writing the id", tmp);
    if (rename(tmp, path) != 0) die("publishing the id", path);
    return;
  }
  for (double deadline = now_s() + 60.0; now_s() < deadline; usleep(20000)) {
    FILE* f = fopen(path, "rb");
    if (!f) continue;
    size_t got = fread(id, sizeof *id, 1, f);
    fclose(f);
    if (got == 1) return;
  }
  die("no NCCL id from rank 0 within 60 s", path);
}

/* Which of torch's and Python's libraries are mapped into this process. */
static void foreign_libraries(char* out, size_t size) {
  static const char* names[] = {"libtorch", "libc10", "libpython"};
  out[0] = '\0';
  FILE* maps = fopen("/proc/self/maps", "r");
  if (!maps) die("reading", "/proc/self/maps");
  char line[4096];
  while (fgets(line, sizeof line, maps)) {
    for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i) {
      if (strstr(line, names[i]) && !strstr(out, names[i])) {
        strncat(out, out[0] ? "," : "", size - strlen(out) - 1);
        strncat(out, names[i], size - strlen(out) - 1);
      }
    }
  }
  fclose(maps);
  if (!out[0]) snprintf(out, size, "none");
}

int main(int argc, char** argv) {
  if (argc != 5) die("usage", "nccl_allreduce RANK ID_FILE COUNT ITERS");
  const int rank = atoi(argv[1]);
  const size_t count = strtoull(argv[3], NULL, 10);
  const int iters = atoi(argv[4]);
  if (rank < 0 || rank >= NRANKS) die("RANK must be 0 or 1, got", argv[1]);
  if (count == 0 || count > ((size_t)1 << 30)) die("COUNT must be in 1..2^30 floats, got", argv[3]);
  if (iters < 1 || iters > 20) die("ITERS must be in 1..20 (the sum doubles each time), got", argv[4]);

  int devices = 0;
  CUDA(cudaGetDeviceCount(&devices));
  if (devices < 1) die("CUDA", "no GPU");
  CUDA(cudaSetDevice(rank % devices));
  ncclUniqueId id;
  if (rank == 0) NCCL(ncclGetUniqueId(&id));
  exchange_id(rank, argv[2], &id);
  ncclComm_t comm;
  NCCL(ncclCommInitRank(&comm, NRANKS, id, rank));
  cudaStream_t stream;
  CUDA(cudaStreamCreate(&stream));

  float* host = malloc(count * sizeof(float));
  float* device = NULL;
  if (!host) die("malloc", "host buffer");
  CUDA(cudaMalloc((void**)&device, count * sizeof(float)));
  for (size_t i = 0; i < count; ++i) host[i] = (float)(rank + 1) + (float)(i % 1024);
  CUDA(cudaMemcpy(device, host, count * sizeof(float), cudaMemcpyHostToDevice));

  /* Exactness: x_0 = rank + 1 + (i % 1024); one sum gives 3 + 2 (i % 1024), each
   * later one doubles it. Small integers: exact in float in any order. */
  for (int k = 0; k < iters; ++k) NCCL(ncclAllReduce(device, device, count, ncclFloat, ncclSum, comm, stream));
  CUDA(cudaStreamSynchronize(stream));
  CUDA(cudaMemcpy(host, device, count * sizeof(float), cudaMemcpyDeviceToHost));
  const float scale = (float)(1u << (iters - 1));
  for (size_t i = 0; i < count; ++i) {
    const float want = (3.0f + 2.0f * (float)(i % 1024)) * scale;
    if (host[i] != want) {
      fprintf(stderr, "nccl_allreduce: rank %d element %zu is %g, expected %g\n", rank, i, host[i], want);
      return 1;
    }
  }

  /* Timed: `iters` back to back (the values keep doubling; nothing is checked). */
  NCCL(ncclAllReduce(device, device, count, ncclFloat, ncclSum, comm, stream));
  CUDA(cudaStreamSynchronize(stream));
  const double t0 = now_s();
  for (int k = 0; k < iters; ++k) NCCL(ncclAllReduce(device, device, count, ncclFloat, ncclSum, comm, stream));
  CUDA(cudaStreamSynchronize(stream));
  const double seconds = (now_s() - t0) / iters;
  const double busbw = count * sizeof(float) / seconds / 1e9 * 2.0 * (NRANKS - 1) / NRANKS;

  char foreign[256];
  foreign_libraries(foreign, sizeof foreign);
  NCCL(ncclCommDestroy(comm));
  CUDA(cudaFree(device));
  free(host);
  printf("RESULT-OK rank=%d busbw_GBps=%.3f foreign=%s\n", rank, busbw, foreign);
  return 0;
}
