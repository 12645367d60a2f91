"""Shared fixtures for the adaattn test suite.

* Devices: tests take the ``device`` fixture (``"cpu"`` and ``"cuda"``) or use ``DEVICES`` in their
  own parametrisation. CUDA cases carry the ``cuda`` marker and are skipped at *run* time when no
  GPU is present; nothing here queries CUDA at import or collection time.
* Seeding: every test starts from ``torch.manual_seed(0)``.
* NaN poisoning ("outputs are allocated poisoned"): the op library allocates its outputs
  in C++ with ``at::empty``, which Python cannot monkeypatch. Every test therefore runs with
  ``torch.use_deterministic_algorithms(True, warn_only=True)`` and
  ``torch.utils.deterministic.fill_uninitialized_memory = True``: in that mode ATen's ``empty``
  kernels (CPU and CUDA, reached through the dispatcher by ``at::empty``/``at::empty_like`` in C++
  as well) fill every fresh floating tensor with NaN and every integer tensor with its maximum
  value. An output element that a kernel forgets to write stays NaN and fails the
  ``isfinite``/comparison checks. This is more reliable than pre-filling the caching allocator,
  which cannot guarantee that the op receives the block that was poisoned. ``warn_only`` keeps
  reference computations that use nondeterministic ATen kernels running (they only warn).
"""
import os
import sys

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    # Tests exercise the in-place build (adaattn/_C*.so next to the sources).
    sys.path.insert(0, ROOT)

# Inductor's FX-graph and AOT-autograd caches key a compiled graph on the graph, not on the fake
# kernels of the custom ops in it: an entry compiled before a fake kernel changed (say, the strides
# of its outputs) is reused and asserts the old strides. Tests compile from scratch.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

_cuda_available = None


def cuda_available() -> bool:
    """Whether a CUDA device is usable; evaluated on first use, never at import/collection."""
    global _cuda_available
    if _cuda_available is None:
        _cuda_available = torch.cuda.is_available()
    return _cuda_available


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") is not None and not cuda_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture
def requires_cuda():
    """Skips the requesting test (at run time) when no CUDA device is present."""
    if not cuda_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(params=DEVICES)
def device(request):
    """``"cpu"`` and ``"cuda"`` (the latter skipped without a GPU)."""
    return request.param


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def nan_poisoned_allocations():
    """Makes every fresh ATen allocation NaN-filled for the duration of the test (see above)."""
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
