"""Builds torch_reccl and its one native extension, torch_reccl._C."""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def sources():
    # core/ and transport/ use no torch headers, so they compile quickly.
    files = [os.path.join("csrc", "python", name) for name in ("bindings.cc", "pg_bindings.cc", "ib_bindings.cc", "gpu_bindings.cc", "executor_bindings.cc")]
    for folder in ("core", "transport", "gpu", "nccl", "engine", "pg"):
        files += glob.glob(os.path.join("csrc", folder, "**", "*.cc"), recursive=True)
    return sorted(files)


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
        "integrations": ["wandb", "tensorboard", "prometheus_client"],
        "test": ["pytest", "pytest-timeout", "pyroute2>=0.7", "matplotlib", "hypothesis",
                 "wandb", "tensorboard", "prometheus_client"],
    },
    ext_modules=[
        CppExtension(
            name="torch_reccl._C",
            sources=sources(),
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args=["-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            # NCCL dlclose()s its net plugin at communicator teardown, while the
            # transport's threads still run: the library must never be unmapped.
            extra_link_args=["-Wl,-z,nodelete"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    entry_points={"console_scripts": ["reccl = torch_reccl.cli:main"]},
)
