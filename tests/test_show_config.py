"""Tests of adaattn.show_config / adaattn.build_info / ``python -m adaattn`` (issue 35, item 3).

The CUDA lines are checked on the CPU with a stand-in build description and device, so the
architecture matching (which compiled code a GPU runs, SM90 or SM80 tensor-core kernels) is
covered without a GPU.
"""
import io
import os
import re
import subprocess
import sys

import pytest
import torch

import adaattn
from adaattn import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_INFO = {"cuda": "13.0", "archs": "sm_80, sm_90a", "decode_head_dims": "64, 128",
             "decode_fp8_cache_head_dims": "64, 128",
             "tensor_core_head_dims": "flash (64, 64), (128, 128); lazy (64, 64), (128, 128)"}


def test_build_info_describes_the_library():
    info = adaattn.build_info()
    if "archs" not in info:
        assert info == {"cuda": "none (CPU-only build)"}
        return
    assert re.fullmatch(r"\d+\.\d+", info["cuda"])
    assert re.fullmatch(r"sm_\d+a?(, sm_\d+a?)*", info["archs"])
    assert info["tensor_core_head_dims"].startswith("flash (64, 64)")
    assert re.fullmatch(r"\d+(, \d+)*", info["decode_head_dims"])
    assert re.fullmatch(r"\d+(, \d+)*", info["decode_fp8_cache_head_dims"])


def test_show_config_prints_versions_and_devices():
    out = io.StringIO()
    adaattn.show_config(file=out)
    text = out.getvalue()
    assert text.startswith(f"adaattn {adaattn.__version__} ")
    assert f"torch {torch.__version__}" in text
    assert "cpu: every op" in text


def test_python_m_adaattn_runs_and_import_leaves_cuda_alone():
    result = subprocess.run([sys.executable, "-m", "adaattn"], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    assert result.stdout.startswith(f"adaattn {adaattn.__version__} ")
    importing = "import torch, adaattn; assert not torch.cuda.is_initialized()"
    subprocess.run([sys.executable, "-c", importing], cwd=ROOT, check=True)


@pytest.mark.parametrize("archs, capability, expected", [
    (["sm_80", "sm_90a"], (9, 0), "sm_90a"),
    (["sm_80", "sm_90a"], (8, 0), "sm_80"),
    (["sm_80", "sm_90a"], (8, 9), "sm_80"),
    (["sm_80", "sm_86"], (8, 9), "sm_86"),
    (["sm_80", "sm_90a"], (7, 5), None),
    (["sm_80", "sm_90a"], (10, 0), None),
    (["sm_90a"], (9, 1), None),
    (["sm_90"], (9, 0), "sm_90"),
])
def test_runnable_arch(archs, capability, expected):
    assert config._runnable_arch(archs, *capability) == expected


@pytest.fixture
def fake_gpu(monkeypatch):
    """A stand-in CUDA device of a settable compute capability."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Test GPU")
    return capability


def test_cuda_lines_name_the_kernel_family(fake_gpu, monkeypatch):
    monkeypatch.delenv("ADAATTN_DISABLE_SM90", raising=False)
    (line,) = config._cuda_lines(CUDA_INFO)
    assert line.startswith("cuda:0 Test GPU (sm_90): sm_90a code")
    assert "SM90 wgmma" in line
    assert "decode kernel (D = 64, 128; 8-bit paged cache: D = 64, 128)" in line
    monkeypatch.setenv("ADAATTN_DISABLE_SM90", "1")
    assert "SM80 mma" in config._cuda_lines(CUDA_INFO)[0]
    fake_gpu[0] = (8, 6)
    assert "sm_80 code" in config._cuda_lines(CUDA_INFO)[0]
    fake_gpu[0] = (7, 5)
    assert "no kernels" in config._cuda_lines(CUDA_INFO)[0]


def test_cuda_lines_without_cuda(fake_gpu, monkeypatch):
    assert "without CUDA kernels" in config._cuda_lines({"cuda": "none (CPU-only build)"})[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no device" in config._cuda_lines(CUDA_INFO)[0]
