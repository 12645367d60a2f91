"""``adaattn.show_config()`` (and ``python -m adaattn``): versions, how the op library was built
and which kernels each device runs. CUDA is queried only when these functions are called."""
import os
import re
import sys
from typing import Dict, List, Optional, TextIO

import torch

from ._ops import ops


def build_info() -> Dict[str, str]:
    """How the op library was built (``adaattn::build_info``), as strings.

    Keys: ``"cuda"`` (the CUDA runtime it was compiled against, or ``"none (CPU-only build)"``),
    and for a CUDA build ``"archs"`` (e.g. ``"sm_80, sm_90a"``), ``"tensor_core_head_dims"``
    (the compiled ``(D, Dv)`` pairs per variant; other dims up to 256 run on the pair that
    covers them), ``"decode_head_dims"`` (head dims of the split-KV decode kernel) and
    ``"decode_fp8_cache_head_dims"`` (those of its 8-bit paged-cache path).
    """
    return dict(line.split(": ", 1) for line in ops.build_info().splitlines())


def _runnable_arch(archs: List[str], major: int, minor: int) -> Optional[str]:
    """The compiled architecture whose code a GPU of compute capability ``major.minor`` runs:
    ``sm_XY`` runs on ``X.Y'`` with ``Y' >= Y``, ``sm_XYa`` only on ``X.Y`` (the build embeds
    no PTX, so nothing else runs)."""
    best = None
    for arch in archs:
        match = re.fullmatch(r"sm_(\d+)(\d)(a?)", arch)
        arch_major, arch_minor, specific = int(match[1]), int(match[2]), match[3] == "a"
        fits = arch_major == major and (arch_minor == minor if specific else arch_minor <= minor)
        if fits and (best is None or (arch_minor, specific) > best[0]):
            best = ((arch_minor, specific), arch)
    return None if best is None else best[1]


def _cuda_lines(info: Dict[str, str]) -> List[str]:
    if "archs" not in info:
        return ["cuda: none (this op library was built without CUDA kernels)"]
    if not torch.cuda.is_available():
        return ["cuda: no device (torch.cuda.is_available() is False)"]
    archs = [arch.strip() for arch in info["archs"].split(",")]
    lines = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        device = f"cuda:{index} {torch.cuda.get_device_name(index)} (sm_{major}{minor})"
        arch = _runnable_arch(archs, major, minor)
        if arch is None:
            lines.append(f"{device}: no kernels (compiled for {info['archs']}; rebuild with "
                         f"ADAATTN_CUDA_ARCHS including {major}{minor})")
            continue
        kernels = [f"{arch} code", "fp32/fp64 exact kernels"]
        if major >= 8:
            # As csrc/cuda/tc/launch.h's use_sm90(), with ADAATTN_DISABLE_SM90 read as env.h does.
            hopper = arch == "sm_90a" and os.environ.get("ADAATTN_DISABLE_SM90", "")[:1] != "1"
            family = "SM90 wgmma" if hopper else "SM80 mma"
            kernels += [f"fp16/bf16 tensor-core kernels ({family})",
                        f"fp16/bf16 decode kernel (D = {info['decode_head_dims']}; 8-bit "
                        f"paged cache: D = {info['decode_fp8_cache_head_dims']})"]
        lines.append(f"{device}: " + ", ".join(kernels))
    return lines


def show_config(file: Optional[TextIO] = None) -> None:
    """Prints adaattn's version, torch's and CUDA's versions, the op library's compiled
    architectures and tensor-core head dims, and the kernels available on each device."""
    from . import __version__

    info = build_info()
    lines = [f"adaattn {__version__} ({os.path.dirname(os.path.abspath(__file__))})",
             f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
             f"op library CUDA: {info['cuda']}"]
    if "archs" in info:
        lines += [f"compiled archs: {info['archs']}",
                  f"tensor-core head dims (D, Dv): {info['tensor_core_head_dims']}; other dims "
                  "up to 256 run on the smallest pair that covers them",
                  f"decode kernel head dims: {info['decode_head_dims']} (8-bit paged cache: "
                  f"{info['decode_fp8_cache_head_dims']})"]
    lines.append("cpu: every op (fp32/fp64; fp16/bf16 computed in fp32)")
    lines += _cuda_lines(info)
    print("\n".join(lines), file=file or sys.stdout)
