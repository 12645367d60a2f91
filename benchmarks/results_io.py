"""Machine-readable benchmark results: every benchmark writes ``benchmarks/results/<family>.json``.

Format (one file per family, rewritten by each run of its script)::

    {"gpu": "NVIDIA H100 80GB HBM3", "commit": "1a2b3c4", "date": "2026-11-25T15:25:00+00:00",
     "title": "...", "setup": "...", "command": "...", "torch": "2.11.0+cu130",
     "rows": [{"case": "D=128 L=4096 causal", "direction": "fwd" | "fwd+bwd",
               "ms": {"adaattn": 0.858, "sdpa-cudnn": 0.826, ...},
               ...extra keys: "tflops", "peak_mib", "note", "config"...}]}

``ms["adaattn"]`` is adaattn's time for the row's case and every other key of ``ms`` is a peer
measured in the same run (``None`` where a peer refused or was skipped; the reason then goes to
the row's ``note``). ``gpu``, ``commit`` and ``date`` are required; ``title``, ``setup``,
``command``, ``torch`` and ``notes`` (a list of short sentences) are optional and shown by
``benchmarks/make_results.py``, which turns these files into ``benchmarks/RESULTS.md``.
"""
import datetime
import json
import os
import shlex
import subprocess
import sys
from typing import Dict, Iterable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
DIRECTIONS = ("fwd", "fwd+bwd")


def git_commit(root: str = ROOT) -> str:
    """$ADAATTN_COMMIT when set (a copy of the tree on another machine may carry a stale .git,
    or none), else the checkout's ``git rev-parse --short HEAD``, with ``-dirty`` when tracked
    files differ from it (the numbers are then not that commit's), else "unknown"."""
    if os.environ.get("ADAATTN_COMMIT"):
        return os.environ["ADAATTN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                             capture_output=True, text=True, timeout=30)
        head = out.stdout.strip()
        if not head:
            return "unknown"
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root,
                              capture_output=True, timeout=60)
        return head + ("-dirty" if diff.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def now_iso() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name()


def command_line(argv: Optional[List[str]] = None) -> str:
    argv = sys.argv if argv is None else argv
    return " ".join(shlex.quote(a) for a in ["python"] + list(argv))


def row(case: str, direction: str, ms: Dict[str, Optional[float]], **extra) -> dict:
    """One result row. ``ms`` must contain "adaattn"; ``extra`` keys with value None are
    dropped."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if "adaattn" not in ms:
        raise ValueError(f"row {case!r}: ms needs an 'adaattn' entry, got {sorted(ms)}")
    out = {"case": case, "direction": direction,
           "ms": {name: (None if t is None else round(float(t), 4)) for name, t in ms.items()}}
    out.update({k: v for k, v in extra.items() if v is not None and v != {} and v != ""})
    return out


def write(family: str, rows: Iterable[dict], *, title: str = "", setup: str = "",
          notes: Iterable[str] = (), argv: Optional[List[str]] = None,
          results_dir: Optional[str] = None) -> str:
    """Writes ``<results_dir>/<family>.json`` (default benchmarks/results) with this run's
    GPU, commit and date; returns its path. Called after every case by the scripts that take
    long, so that a run cut short still leaves what it measured."""
    import torch
    data = {
        "gpu": gpu_name(),
        "commit": git_commit(),
        "date": now_iso(),
        "title": title,
        "setup": setup,
        "command": command_line(argv),
        "torch": torch.__version__,
        "rows": list(rows),
    }
    if notes:
        data["notes"] = list(notes)
    directory = results_dir or RESULTS_DIR
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{family}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(dumps({k: v for k, v in data.items() if v != ""}))
    os.replace(tmp, path)
    return path


def dumps(data: dict) -> str:
    """JSON text with one row per line (diffs of a rerun show which rows moved)."""
    head = {k: v for k, v in data.items() if k != "rows"}
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    rows = [f"  {json.dumps(r, ensure_ascii=False)}" for r in data.get("rows", [])]
    return "{\n" + "\n".join(lines) + '\n "rows": [\n' + ",\n".join(rows) + "\n ]\n}\n"


def add_arguments(parser, family: str) -> None:
    """The options every benchmark shares for its results file (``family`` names the default
    file in the help text; scripts whose default depends on other options resolve
    ``args.family`` themselves when it is None)."""
    parser.add_argument("--results-dir", default=RESULTS_DIR,
                        help="where to write <family>.json (default benchmarks/results)")
    parser.add_argument("--family", default=None,
                        help=f"name of the results file (default {family})")
    parser.add_argument("--no-write", action="store_true",
                        help="print the table only; write no results file")


def import_error_message(script: str, error: Exception) -> str:
    return (f"{script}: adaattn could not be imported ({error}); build the extension first "
            "(make build)")
