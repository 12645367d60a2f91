"""benchmarks/results_io.py: the commit a benchmark run records."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import results_io  # noqa: E402


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAATTN_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "kernel.cu").write_text("one\n")
    _git(tmp_path, "add", "kernel.cu")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, check=True,
                          capture_output=True, text=True).stdout.strip()
    return tmp_path, head


def test_clean_tree_records_head(repo):
    root, head = repo
    (root / "untracked.txt").write_text("not part of the build\n")
    assert results_io.git_commit(str(root)) == head


def test_changed_tracked_file_is_marked_dirty(repo):
    root, head = repo
    (root / "kernel.cu").write_text("two\n")
    assert results_io.git_commit(str(root)) == head + "-dirty"


def test_environment_overrides(repo, monkeypatch):
    root, _ = repo
    monkeypatch.setenv("ADAATTN_COMMIT", "abc1234")
    assert results_io.git_commit(str(root)) == "abc1234"


def test_no_repository(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAATTN_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert results_io.git_commit(str(tmp_path)) == "unknown"
