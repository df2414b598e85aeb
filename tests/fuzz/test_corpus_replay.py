"""Every input kept in tests/fuzz/corpus replays through its harness in the normal
suite, without libFuzzer or clang: each harness (fuzz_<name>.cc) is built with g++
and the replay driver (replay_main.cc), with AddressSanitizer and UBSan where g++
has their runtimes (Debian's does), so an input that once crashed, hung, over-read
or broke a harness's property fails here. How the corpora are grown: docs/fuzzing.md.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import fuzz_targets
from fuzz_targets import CORPUS, HERE, TARGETS, corpus_dir

pytestmark = pytest.mark.timeout(600)

GXX = shutil.which("g++")


def _sanitizers_link(tmp: str) -> bool:
    source = os.path.join(tmp, "probe.cc")
    with open(source, "w") as f:
        f.write("int main() { return 0; }\n")
    cp = subprocess.run([GXX, *fuzz_targets.SANITIZED_GCC, source, "-o", os.path.join(tmp, "probe")],
                        capture_output=True, timeout=120)
    return cp.returncode == 0


@pytest.fixture(scope="module")
def replay_build(tmp_path_factory):
    if GXX is None:
        pytest.skip("needs g++ (the compiler the extension is built with)")
    out = str(tmp_path_factory.mktemp("fuzz_replay"))
    sanitized = _sanitizers_link(out)
    flags = fuzz_targets.SANITIZED_GCC if sanitized else []
    binaries = fuzz_targets.build(list(TARGETS), out, GXX, flags, flags,
                                  extra_sources=[os.path.join(HERE, "replay_main.cc")], jobs=2)
    return {"binaries": binaries, "sanitized": sanitized, "out": out, "flags": flags}


def replay(binary: str, *paths: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    return subprocess.run([binary, *paths], capture_output=True, text=True, timeout=120, env=env)


def test_every_harness_has_a_corpus_and_every_corpus_a_harness():
    folders = sorted(f for f in os.listdir(CORPUS) if os.path.isdir(os.path.join(CORPUS, f)))
    assert folders == sorted(TARGETS)
    harnesses = sorted(f[len("fuzz_"):-len(".cc")] for f in os.listdir(HERE)
                       if f.startswith("fuzz_") and f.endswith(".cc"))
    assert harnesses == sorted(TARGETS)
    for name in TARGETS:
        seeds = [f for f in os.listdir(corpus_dir(name)) if f.startswith("seed-")]
        assert seeds, f"corpus/{name} has no seed-* input (python tests/fuzz/run.py seed writes them)"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_corpus_replays_cleanly(replay_build, name):
    files = os.listdir(corpus_dir(name))
    cp = replay(replay_build["binaries"][name], corpus_dir(name))
    tail = (cp.stdout + cp.stderr)[-4000:]
    assert cp.returncode == 0, f"an input of corpus/{name} fails its harness (the last one named):\n{tail}"
    assert f"replayed {len(files)} inputs" in cp.stdout, tail


@pytest.fixture(scope="module")
def failing_harness(replay_build, tmp_path_factory):
    """A harness that breaks its property on 3-byte inputs and reads one byte past
    the end of 4-byte ones: the replay must report both."""
    out = str(tmp_path_factory.mktemp("failing"))
    source = os.path.join(out, "fuzz_failing.cc")
    with open(source, "w") as f:
        f.write('#include <cstddef>\n#include <cstdint>\n#include "fuzz_check.h"\n'
                'extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {\n'
                '  FUZZ_CHECK(n != 3);\n'
                '  volatile uint8_t sink = n == 4 ? d[4] : 0;\n  (void)sink;\n  return 0;\n}\n')
    binary = os.path.join(out, "fuzz_failing")
    subprocess.run([GXX, *fuzz_targets.COMMON, *replay_build["flags"], source,
                    os.path.join(HERE, "replay_main.cc"), "-o", binary], check=True, timeout=300)
    return binary, out


def test_replay_fails_on_a_broken_property(failing_harness):
    binary, out = failing_harness
    for size in (1, 3):
        with open(os.path.join(out, f"input{size}"), "wb") as f:
            f.write(b"x" * size)
    assert replay(binary, os.path.join(out, "input1")).returncode == 0
    cp = replay(binary, os.path.join(out, "input1"), os.path.join(out, "input3"))
    assert cp.returncode != 0
    assert "fuzz property failed: n != 3" in cp.stderr and "input3" in cp.stderr


def test_replay_fails_on_an_over_read(replay_build, failing_harness):
    if not replay_build["sanitized"]:
        pytest.skip("g++ here has no AddressSanitizer runtime (Debian: apt-get install libasan8)")
    binary, out = failing_harness
    path = os.path.join(out, "input4")
    with open(path, "wb") as f:
        f.write(b"abcd")
    cp = replay(binary, path)
    assert cp.returncode != 0
    assert "heap-buffer-overflow" in cp.stderr, cp.stderr[-2000:]
