"""Builds torch_reccl's native parts, both into the torch_reccl package directory:

- libnccl-net-reccl.so: the NCCL net plugin (csrc/core, transport, gpu, nccl), a
  plain shared library with no torch and no Python, that NCCL, nccl-tests or any
  NCCL user loads (NCCL_NET_PLUGIN=reccl finds it on the library path);
- torch_reccl._C: the torch extension (csrc/engine, pg, python), linked against
  that library (rpath $ORIGIN), so a process has one copy of NIC health, events
  and stats whichever loaded the library first;
- torch_reccl._testing: the verbs and CUDA emulations and their bindings
  (csrc/testing), for tests only; NCCL never loads it.

TORCH_RECCL_SANITIZE=address,undefined (or address, undefined, thread) builds all
three instrumented by gcc's sanitizers, for scripts/sanitize.sh (docs/sanitizers.md).
It is no RECCL_* name: those are the runtime settings, where an unknown one is an error.
"""
import glob
import os

from setuptools import Extension, find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE_ARGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
LINK_ARGS = []
PLUGIN_LIBRARY = "nccl-net-reccl"  # NCCL's naming: NCCL_NET_PLUGIN=reccl -> libnccl-net-reccl.so
SANITIZE_VARIABLE = "TORCH_RECCL_SANITIZE"
SANITIZERS = ("address", "undefined", "thread")


def sanitizer_flags(value):
    """(compile args, link args) for a TORCH_RECCL_SANITIZE value: a comma-separated
    subset of SANITIZERS, thread alone (gcc runs ThreadSanitizer without the others)."""
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    if not chosen:
        return [], []
    unknown = [name for name in chosen if name not in SANITIZERS]
    if unknown or ("thread" in chosen and len(chosen) > 1):
        raise SystemExit(f"{SANITIZE_VARIABLE}={value} is not valid; valid values: address, undefined, "
                         f"address,undefined, thread (thread combines with no other), or empty for none")
    sanitize = "-fsanitize=" + ",".join(chosen)
    # -O1: inlining would hide frames of the reports' stacks; the frame pointer
    # lets the sanitizers' fast unwinder see every frame. Undefined behaviour is
    # fatal, as ASan's findings are: beside ASan, gcc's UBSan writes to stderr
    # only (no log_path), which a test may capture, but not a process that dies.
    compile_args = [sanitize, "-O1", "-g", "-fno-omit-frame-pointer"]
    if "undefined" in chosen:
        compile_args.append("-fno-sanitize-recover=undefined")
    return compile_args, [sanitize]


_sanitize_compile, _sanitize_link = sanitizer_flags(os.environ.get(SANITIZE_VARIABLE, ""))
COMPILE_ARGS += _sanitize_compile
LINK_ARGS += _sanitize_link


def sources(*folders):
    files = []
    for folder in folders:
        files += glob.glob(os.path.join("csrc", folder, "**", "*.cc"), recursive=True)
    return sorted(files)


class SharedLibrary(Extension):
    """A plain shared library (not a Python module) built by build_ext, so the
    same compiler, flags and C++ ABI serve it and the extensions linking it."""

    def __init__(self, name, file_name, **kwargs):
        super().__init__(name, language="c++", **kwargs)
        self.file_name = file_name


class BuildNative(BuildExtension):
    """torch's build_ext (ninja, its C++ ABI flag), plus SharedLibrary targets
    named as given, and extensions linked against the libraries built before them."""

    def get_ext_filename(self, fullname):
        ext = getattr(self, "ext_map", {}).get(fullname)
        if isinstance(ext, SharedLibrary):
            return os.path.join(*fullname.split(".")[:-1], ext.file_name)
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if not isinstance(ext, SharedLibrary):
            # build_ext writes every target to one package directory in build_lib
            # (copied next to the sources for in-place and editable builds).
            for other in self.extensions:
                if isinstance(other, SharedLibrary):
                    directory = os.path.dirname(self.get_ext_fullpath(other.name))
                    if directory not in ext.library_dirs:
                        ext.library_dirs.append(directory)
        super().build_extension(ext)


plugin = SharedLibrary(
    name="torch_reccl.nccl_net_reccl",
    file_name=f"lib{PLUGIN_LIBRARY}.so",
    sources=sources("core", "transport", "gpu", "nccl"),
    include_dirs=[os.path.join(HERE, "csrc")],
    extra_compile_args=COMPILE_ARGS,
    # NCCL dlclose()s its net plugin at communicator teardown, while the
    # transport's threads still run: the library must never be unmapped.
    # libcuda and libibverbs are dlopen()ed at run time, never linked.
    extra_link_args=["-Wl,-z,nodelete", f"-Wl,-soname,lib{PLUGIN_LIBRARY}.so", "-Wl,--no-undefined",
                     "-pthread", "-ldl"] + LINK_ARGS,
)


def linked_extension(name, folders, extra=()):
    return CppExtension(
        name=name,
        sources=sources(*folders) + list(extra),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args=COMPILE_ARGS,
        libraries=[PLUGIN_LIBRARY],
        extra_link_args=["-Wl,-rpath,$ORIGIN"] + LINK_ARGS,
    )


setup(
    name="torch_reccl",
    version="0.1.0",
    description="NIC failover for torch.distributed: keeps training alive through network faults",
    packages=find_packages(include=["torch_reccl", "torch_reccl.*"]),
    python_requires=">=3.10",
    install_requires=["numpy"],
    extras_require={
        "fabric": ["pyroute2>=0.7"],
        "plot": ["matplotlib"],
        "nvml": ["nvidia-ml-py"],  # reccl topo's and NVL's NVLink answers (torch_reccl/gpu_topo.py)
        "integrations": ["wandb", "tensorboard", "prometheus_client"],
        "hooks": ["lightning", "transformers", "accelerate"],  # FaultPolicy callbacks
        # torch_reccl.integrations.torchft; torchft needs torch>=2.7, so pip keeps the installed torch
        "torchft": ["torchft>=0.2"],
        # ruff and clang-format pinned: tests/tools/test_style.py checks the tree against them;
        # expecttest: torch's own distributed suite (bench/torch_dist_suite.py) imports it.
        "test": ["pytest", "pytest-timeout", "pyroute2>=0.7", "matplotlib", "hypothesis",
                 "ruff==0.17.6", "clang-format==23.1.5", "expecttest",
                 "wandb", "tensorboard", "prometheus_client",
                 # the FaultPolicy callbacks' tests (tests/tools/test_training_hooks.py);
                 # Transformers' Trainer needs accelerate
                 "lightning", "transformers", "accelerate",
                 # reccl under torchft (tests/pg/test_torchft.py)
                 "torchft>=0.2"],
    },
    # Built in this order: the extensions link the library.
    ext_modules=[
        plugin,
        linked_extension("torch_reccl._C", ("engine", "pg", "python")),
        linked_extension("torch_reccl._testing", ("testing",)),
    ],
    cmdclass={"build_ext": BuildNative},
    entry_points={"console_scripts": ["reccl = torch_reccl.cli:main"]},
)
