"""Builds adaattn._C, the op library (no pybind: it registers ops through TORCH_LIBRARY).

Knobs (environment variables):
  ADAATTN_CUDA=0|1        force the CPU-only build, or require the CUDA build (default: CUDA when
                          nvcc is found and torch was built with CUDA)
  ADAATTN_CUDA_ARCHS      semicolon list of SM versions to compile for (default "80;90a"; "90a"
                          adds the Hopper wgmma kernels, plain "90" builds only the SM80 ones)
  MAX_JOBS                parallel compile jobs (torch's ninja build)

Objects go to build/temp (fixed, also for `pip install -e .`, whose default is a fresh temporary
directory): a later `pip wheel --no-build-isolation .` with the same compiler and knobs finds them
up to date in torch's ninja build and only links (Makefile, wheel-check).

The op library includes no Python header and torch compiles it with -DPy_LIMITED_API at torch's
oldest supported CPython, so the wheel is tagged abi3 from that version on (cp310-abi3 for torch
2.11): one wheel serves every CPython >= 3.10 with the same torch.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

import torch
from torch.utils import cpp_extension
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda():
    knob = os.environ.get("ADAATTN_CUDA")
    found = torch.version.cuda is not None and (
        CUDA_HOME is not None or shutil.which("nvcc") is not None)
    if knob == "1" and not found:
        raise RuntimeError("ADAATTN_CUDA=1 but no nvcc / CUDA-enabled torch was found")
    return found if knob is None else knob == "1"


def gencode_flags():
    archs = os.environ.get("ADAATTN_CUDA_ARCHS", "80;90a").replace(",", ";").split(";")
    archs = [a.strip() for a in archs if a.strip()]
    flags = [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]
    if "90a" in archs:
        flags.append("-DADAATTN_SM90A")
    return flags


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def extension():
    # csrc/ops/<family>/: schemas, checks, autograd and CPU registration; *_cuda.cpp beside them
    # are the CUDA registrations, built only with CUDA.
    ops = sources("csrc/ops/**/*.cpp")
    ops_cuda = [p for p in ops if p.endswith("_cuda.cpp")]
    cpp = [p for p in ops if p not in ops_cuda] + sources("csrc/cpu/*.cpp")
    # -g0 overrides the -g of Python's CFLAGS: debug info about halved the host compile time
    # of the torch-header-heavy op files (block_sparse.cpp 31 s -> 17 s) and is not shipped.
    cxx_flags = ["-O3", "-std=c++17", "-g0"]
    if not want_cuda():
        return CppExtension("adaattn._C", cpp, extra_compile_args={"cxx": cxx_flags},
                            py_limited_api=True)
    cuda = ops_cuda + sources("csrc/cuda/**/*.cu")
    nvcc_flags = ["-O3", "-std=c++17", "--use_fast_math", "--expt-relaxed-constexpr",
                  "-DADAATTN_WITH_CUDA", "-lineinfo"] + gencode_flags()
    return CUDAExtension("adaattn._C", cpp + cuda,
                         extra_compile_args={"cxx": cxx_flags + ["-DADAATTN_WITH_CUDA"],
                                             "nvcc": nvcc_flags},
                         py_limited_api=True)


class BuildExt(BuildExtension):
    """torch's BuildExtension with its objects in build/temp, also for `pip install -e .` (whose
    editable build otherwise compiles in a fresh temporary directory every time)."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", "temp")


def abi3_tag():
    """"cpXY" of the Py_LIMITED_API value torch compiles py_limited_api extensions with."""
    version = int(cpp_extension.min_supported_cpython, 16)
    return f"cp{version >> 24}{(version >> 16) & 0xFF}"


setup(
    packages=find_packages(include=["adaattn", "adaattn.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": abi3_tag()}},
)
