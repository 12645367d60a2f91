"""Checks a built adaattn wheel and installs it into a fresh virtual environment holding only torch.

Usage: python tools/check_wheel.py build/dist/adaattn-*.whl   (run by `make wheel-check`)

Run with the interpreter of the development environment (the one that built the wheel): its
torch is the one the fresh environment sees, and its ``adaattn.build_info()`` (the in-tree build)
is what the installed wheel must report.

Checks, each failing with a message that says what was found:
  1. the file name and WHEEL tags: ``cpXY-abi3-<platform>``, with ``cpXY`` the Py_LIMITED_API
     version torch compiles the op library with (cp310 for torch 2.11), not pure-Python;
  2. METADATA: the version is ``adaattn/__init__.py``'s ``__version__``, torch pinned to the
     version this environment runs;
  3. contents: ``adaattn/_C.abi3.so`` and exactly the ``.py`` files of the source package;
  4. the op library is limited-API clean: it needs no libpython / libtorch_python and imports no
     CPython symbol at all (it registers ops through TORCH_LIBRARY and includes no Python header);
  5. a fresh venv (no pip, no site packages) whose one ``.pth`` adds a directory of symlinks to
     torch and its dependencies, found from this environment's package metadata (nothing is
     downloaded); ``pip install --no-index`` of the wheel with dependency resolution (so the
     ``torch==`` pin must be satisfied by that torch alone); ``pip check``;
  6. in that venv, from an empty directory: ``import adaattn`` comes from the venv,
     ``__version__`` matches, ``show_config()`` runs, ``build_info()`` equals the in-tree
     build's (a CUDA build's wheel carries the CUDA kernels), and a float64 flash attention
     forward and backward on the CPU matches ``torch``'s SDPA; with a GPU and a CUDA build, a
     bf16 flash attention on it is within twice SDPA's bf16 error.
"""
import argparse
import ast
import email.parser
import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # an environment without packaging (the GPU machine): pip's copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMOKE_TEST = r"""
import json, os, sys
import torch
import torch.nn.functional as F
import adaattn

venv, version, build_info = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
where = os.path.realpath(adaattn.__file__)
assert where.startswith(os.path.realpath(venv) + os.sep), f"adaattn imported from {where}"
assert adaattn.__version__ == version, (adaattn.__version__, version)
adaattn.show_config()
assert adaattn.build_info() == build_info, (adaattn.build_info(), build_info)
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 33, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
out = adaattn.flash_attn(q, k, v, causal=True)
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
grads = torch.autograd.grad(out.sum(), (q, k, v))
ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
for a, b in zip((out, *grads), (ref, *ref_grads)):
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a - b).abs().max()
print("[check_wheel] import, show_config, build_info and CPU flash_attn fwd+bwd: ok")
if "archs" in build_info and torch.cuda.is_available():
    # The wheel's CUDA kernels: bf16 tensor-core flash attention against SDPA in bf16, both
    # measured against float32 SDPA (the 2x rule of the test suite).
    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = adaattn.flash_attn(q, k, v, causal=True)
    out.sum().backward()
    exact = F.scaled_dot_product_attention(*(t.float() for t in (q, k, v)), is_causal=True)
    peer = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    err, peer_err = ((t.float() - exact).norm() / exact.norm() for t in (out, peer))
    assert err <= 2 * peer_err and torch.isfinite(q.grad).all(), (err, peer_err)
    print(f"[check_wheel] CUDA bf16 flash_attn fwd+bwd on {torch.cuda.get_device_name()}: "
          f"ok (error {err:.2e}, SDPA {peer_err:.2e})")
"""


def fail(message: str) -> None:
    sys.exit(f"[check_wheel] FAILED: {message}")


def source_version() -> str:
    """``__version__`` of adaattn/__init__.py, read without importing the package."""
    with open(os.path.join(ROOT, "adaattn", "__init__.py")) as f:
        for node in ast.parse(f.read()).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "__version__"):
                return ast.literal_eval(node.value)
    fail("adaattn/__init__.py has no __version__")


def abi3_tag() -> str:
    version = int(cpp_extension.min_supported_cpython, 16)
    return f"cp{version >> 24}{(version >> 16) & 0xFF}"


def check_metadata(wheel: str, archive: zipfile.ZipFile, version: str) -> None:
    name = os.path.basename(wheel)
    match = re.fullmatch(r"adaattn-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl", name)
    if not match:
        fail(f"unexpected wheel file name {name}")
    file_version, python_tag, abi_tag, platform_tag = match.groups()
    if (python_tag, abi_tag) != (abi3_tag(), "abi3"):
        fail(f"{name}: tags {python_tag}-{abi_tag}, expected {abi3_tag()}-abi3")
    if file_version != version:
        fail(f"{name}: version {file_version}, adaattn.__version__ is {version}")
    info = f"adaattn-{version}.dist-info"
    wheel_meta = email.parser.Parser().parsestr(archive.read(f"{info}/WHEEL").decode())
    if wheel_meta.get_all("Tag") != [f"{python_tag}-abi3-{platform_tag}"]:
        fail(f"WHEEL tags {wheel_meta.get_all('Tag')}")
    if wheel_meta["Root-Is-Purelib"] != "false":
        fail("WHEEL says Root-Is-Purelib: true for a wheel with a compiled library")
    meta = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    if meta["Version"] != version or torch_pin not in meta.get_all("Requires-Dist", []):
        fail(f"METADATA: Version {meta['Version']}, Requires-Dist {meta.get_all('Requires-Dist')}"
             f"; expected {version} and {torch_pin}")
    print(f"[check_wheel] {name}: tags {python_tag}-abi3-{platform_tag}, version {version}, "
          f"requires {torch_pin}, Python {meta['Requires-Python']}")


def check_contents(archive: zipfile.ZipFile) -> None:
    names = set(archive.namelist())
    libraries = sorted(n for n in names if n.startswith("adaattn/") and n.endswith(".so"))
    if libraries != ["adaattn/_C.abi3.so"]:
        fail(f"compiled libraries in the wheel: {libraries}, expected adaattn/_C.abi3.so")
    source = {os.path.relpath(os.path.join(d, f), ROOT)
              for d, _, files in os.walk(os.path.join(ROOT, "adaattn"))
              for f in files if f.endswith(".py")}
    packaged = {n for n in names if n.endswith(".py")}
    if source != packaged:
        fail(f"python files only in the source: {sorted(source - packaged)}; only in the "
             f"wheel: {sorted(packaged - source)}")


def check_limited_api(library: str) -> None:
    for tool in ("readelf", "nm"):
        if shutil.which(tool) is None:
            fail(f"{tool} (binutils) is needed to inspect the op library")
    dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True,
                             check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)
    bad = [lib for lib in needed if lib.startswith(("libpython", "libtorch_python"))]
    if bad:
        fail(f"the op library needs {bad}: it would tie the wheel to one CPython")
    undefined = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True,
                               text=True, check=True).stdout.split()
    python_symbols = sorted(s for s in undefined if re.match(r"_?Py[A-Z_]", s))
    if python_symbols:
        fail(f"the op library imports CPython symbols {python_symbols[:10]}")
    print(f"[check_wheel] _C.abi3.so: needs {', '.join(needed)}; no CPython symbol")


def torch_closure():
    """The distributions torch needs here (its requirements, recursively, extras included)."""
    env = default_environment()
    todo, seen = [("torch", frozenset())], {}
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen and extras <= seen[key][1]:
            continue
        dist = metadata.distribution(name)
        extras = extras | (seen[key][1] if key in seen else frozenset())
        seen[key] = (dist, extras)
        for text in dist.requires or []:
            req = Requirement(text)
            wanted = req.marker is None or any(
                req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras))
            if wanted:
                todo.append((req.name, frozenset(req.extras)))
    return [dist for dist, _ in seen.values()]


def torch_only_dir(path: str) -> int:
    """Fills ``path`` with symlinks to the top-level files of torch and its dependencies."""
    os.makedirs(path)
    dists = torch_closure()
    for dist in dists:
        # Unlike files from RECORD, locate_file("") is the site directory the files live in.
        site = str(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            target = os.path.join(path, top)
            if not os.path.lexists(target) and os.path.exists(os.path.join(site, top)):
                os.symlink(os.path.join(site, top), target)
    return len(dists)


def run(*cmd, **kwargs):
    result = subprocess.run(cmd, **kwargs)
    if result.returncode:
        fail(f"{' '.join(map(str, cmd[:6]))} ... exited with {result.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", help="the adaattn wheel")
    parser.add_argument("--keep", metavar="DIR", help="build the venv in DIR and keep it")
    args = parser.parse_args()
    version = source_version()
    start = time.time()
    with zipfile.ZipFile(args.wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        check_metadata(args.wheel, archive, version)
        check_contents(archive)
        check_limited_api(archive.extract("adaattn/_C.abi3.so", tmp))

    sys.path.insert(0, ROOT)
    import adaattn  # the in-tree build, for its build_info

    with tempfile.TemporaryDirectory() as tmp:
        venv = os.path.abspath(args.keep) if args.keep else os.path.join(tmp, "venv")
        shutil.rmtree(venv, ignore_errors=True)
        run(sys.executable, "-m", "venv", "--without-pip", venv)
        python = os.path.join(venv, "bin", "python")
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True,
                              check=True).stdout.strip()
        count = torch_only_dir(os.path.join(venv, "torch-only"))
        with open(os.path.join(site, "torch_only.pth"), "w") as f:
            f.write(os.path.join(venv, "torch-only") + "\n")
        print(f"[check_wheel] venv {venv}: torch and its {count - 1} dependencies linked from "
              f"{os.path.dirname(os.path.dirname(torch.__file__))}")
        pip = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check"]
        run(*pip, "install", "-q", "--no-index", os.path.abspath(args.wheel))
        run(*pip, "check")
        empty = os.path.join(tmp, "cwd")
        os.makedirs(empty)
        run(python, "-c", SMOKE_TEST, venv, version, json.dumps(adaattn.build_info()), cwd=empty)
    print(f"[check_wheel] ok ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
