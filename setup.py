"""Builds torch_reccl's native parts, both into the torch_reccl package directory:

- libnccl-net-reccl.so: the NCCL net plugin (csrc/core, transport, gpu, nccl), a
  plain shared library with no torch and no Python, that NCCL, nccl-tests or any
  NCCL user loads (NCCL_NET_PLUGIN=reccl finds it on the library path);
- torch_reccl._C: the torch extension (csrc/engine, pg, python), linked against
  that library (rpath $ORIGIN), so a process has one copy of NIC health, events
  and stats whichever loaded the library first;
- torch_reccl._testing: the verbs and CUDA emulations and their bindings
  (csrc/testing), for tests only; NCCL never loads it.
"""
import glob
import os

from setuptools import Extension, find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE_ARGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
PLUGIN_LIBRARY = "nccl-net-reccl"  # NCCL's naming: NCCL_NET_PLUGIN=reccl -> libnccl-net-reccl.so


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
                     "-pthread", "-ldl"],
)


def linked_extension(name, folders, extra=()):
    return CppExtension(
        name=name,
        sources=sources(*folders) + list(extra),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args=COMPILE_ARGS,
        libraries=[PLUGIN_LIBRARY],
        extra_link_args=["-Wl,-rpath,$ORIGIN"],
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
        # ruff and clang-format pinned: tests/tools/test_style.py checks the tree against them;
        # expecttest: torch's own distributed suite (bench/torch_dist_suite.py) imports it.
        "test": ["pytest", "pytest-timeout", "pyroute2>=0.7", "matplotlib", "hypothesis",
                 "ruff==0.17.6", "clang-format==23.1.5", "expecttest",
                 "wandb", "tensorboard", "prometheus_client",
                 # the FaultPolicy callbacks' tests (tests/tools/test_training_hooks.py);
                 # Transformers' Trainer needs accelerate
                 "lightning", "transformers", "accelerate"],
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
