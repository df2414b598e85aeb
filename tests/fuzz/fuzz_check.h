// What every harness in tests/fuzz shares: FUZZ_CHECK, a property check that
// aborts with the failed condition. libFuzzer and the replay driver
// (replay_main.cc) both report an abort as a crash of the input at hand, as they
// do an exception other than the one a harness lets through.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(condition)                                                                     \
  do {                                                                                            \
    if (!(condition)) {                                                                           \
      std::fprintf(stderr, "fuzz property failed: %s (%s:%d)\n", #condition, __FILE__, __LINE__); \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)
