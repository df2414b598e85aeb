/* A stand-in libibverbs.so.1 for one question: does reccl's loader call
 * ibv_fork_init when, and only when, it should? It exports every symbol the
 * loader binds (csrc/transport/ib/verbs_library.cc), lists no devices, and
 * answers ibv_is_fork_initialized with $FAKE_IBV_FORK_STATUS (0 disabled,
 * 1 enabled, 2 unneeded; unset: the symbol answers 0). ibv_fork_init and
 * ibv_get_device_list append their names to the file $FAKE_IBV_LOG. Built by
 * tests/transport/test_ib_transport.py into a temporary directory put on
 * LD_LIBRARY_PATH of a child process; never installed.
 */
#include <stdio.h>
#include <stdlib.h>

static void record(const char* call) {
  const char* log = getenv("FAKE_IBV_LOG");
  FILE* f = log ? fopen(log, "a") : NULL;
  if (f) {
    fprintf(f, "%s\n", call);
    fclose(f);
  }
}

int ibv_fork_init(void) {
  record("fork_init");
  return 0;
}

int ibv_is_fork_initialized(void) {
  const char* status = getenv("FAKE_IBV_FORK_STATUS");
  return status ? atoi(status) : 0;
}

void** ibv_get_device_list(int* count) {
  record("get_device_list");
  if (count) *count = 0;
  return calloc(1, sizeof(void*));
}

void ibv_free_device_list(void** list) { free(list); }

/* Bound by the loader, never reached without devices. */
#define UNREACHED(name) \
  void* name(void) { abort(); }
UNREACHED(ibv_get_device_name)
UNREACHED(ibv_open_device)
UNREACHED(ibv_close_device)
UNREACHED(ibv_alloc_pd)
UNREACHED(ibv_dealloc_pd)
UNREACHED(ibv_reg_mr)
UNREACHED(ibv_dereg_mr)
UNREACHED(ibv_create_cq)
UNREACHED(ibv_destroy_cq)
UNREACHED(ibv_create_comp_channel)
UNREACHED(ibv_destroy_comp_channel)
UNREACHED(ibv_get_cq_event)
UNREACHED(ibv_ack_cq_events)
UNREACHED(ibv_create_qp)
UNREACHED(ibv_modify_qp)
UNREACHED(ibv_destroy_qp)
UNREACHED(ibv_query_port)
UNREACHED(ibv_query_gid)
UNREACHED(ibv_get_async_event)
UNREACHED(ibv_ack_async_event)
