"""The fuzz harnesses of tests/fuzz and how to build them, shared by run.py
(clang, libFuzzer) and test_corpus_replay.py (g++, the replay driver).

Each harness fuzz_<name>.cc defines LLVMFuzzerTestOneInput and is linked with
only the csrc/ sources it needs (no torch, no Python); its corpus is
corpus/<name>/.
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")

# harness name -> the csrc/ sources it links (what its parser needs, nothing more)
TARGETS: Dict[str, List[str]] = {
    "frame": ["core/frame.cc"],
    "handle": ["transport/handle.cc"],
    "qp_exchange": ["transport/ib/qp_exchange.cc"],
    "ib_placement": ["transport/ib/ib_registration.cc", "transport/socket.cc", "core/log.cc"],
    "descriptor": ["engine/descriptor.cc", "engine/data_type.cc", "engine/reduce_op.cc"],
    "agreement": ["engine/agreement.cc", "engine/descriptor.cc", "engine/data_type.cc",
                  "engine/reduce_op.cc"],
    "fault_board": ["pg/fault_record.cc"],
    "p2p_header": ["engine/p2p_header.cc", "engine/data_type.cc"],
}

COMMON = ["-std=c++17", "-g", "-O1", "-fno-omit-frame-pointer",
          "-I" + os.path.join(REPO, "csrc"), "-I" + HERE]
# libFuzzer with AddressSanitizer (over-reads, use after free) and UBSan (overflows,
# bad shifts, misaligned or invalid enum loads); any report is a crash. The C++
# runtime is linked in too, so the binaries run on any x86_64 Linux without clang.
LIBFUZZER = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all"]
LIBFUZZER_LINK = LIBFUZZER + ["-static-libstdc++", "-static-libgcc"]
SANITIZED_GCC = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def corpus_dir(name: str) -> str:
    return os.path.join(CORPUS, name)


def _run(command: Sequence[str]) -> None:
    cp = subprocess.run(list(command), capture_output=True, text=True, timeout=600)
    if cp.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}\nfailed ({cp.returncode}):\n{cp.stdout}{cp.stderr}")


def build(names: Sequence[str], out: str, compiler: str, compile_flags: Sequence[str],
          link_flags: Sequence[str], extra_sources: Sequence[str] = (), jobs: int = 2) -> Dict[str, str]:
    """Builds each harness of `names` into `out` (objects under out/obj, each source
    compiled once for all harnesses); returns name -> binary. Raises RuntimeError with
    the compiler's output on failure."""
    objects_dir = os.path.join(out, "obj")
    os.makedirs(objects_dir, exist_ok=True)
    sources = {os.path.join(REPO, "csrc", s) for name in names for s in TARGETS[name]}
    sources |= {os.path.join(HERE, f"fuzz_{name}.cc") for name in names}
    sources |= {os.path.abspath(s) for s in extra_sources}

    def object_of(source: str) -> str:
        return os.path.join(objects_dir, os.path.relpath(source, REPO).replace(os.sep, "__") + ".o")

    headers = _newest_header()

    def compile_one(source: str) -> None:
        target = object_of(source)
        if os.path.exists(target) and os.path.getmtime(target) >= max(headers, os.path.getmtime(source)):
            return
        _run([compiler, *COMMON, *compile_flags, "-c", source, "-o", target])

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(compile_one, sorted(sources)))
    binaries = {}
    for name in names:
        binary = os.path.join(out, f"fuzz_{name}")
        objects = [object_of(os.path.join(HERE, f"fuzz_{name}.cc"))]
        objects += [object_of(os.path.join(REPO, "csrc", s)) for s in TARGETS[name]]
        objects += [object_of(os.path.abspath(s)) for s in extra_sources]
        _run([compiler, *link_flags, *objects, "-o", binary])
        binaries[name] = binary
    return binaries


def _newest_header() -> float:
    """The newest mtime of the headers a source may include (all of them: cheap, and
    an object is never stale)."""
    newest = 0.0
    for root in (os.path.join(REPO, "csrc"), HERE):
        for folder, _, files in os.walk(root):
            for f in files:
                if f.endswith(".h"):
                    newest = max(newest, os.path.getmtime(os.path.join(folder, f)))
    return newest
