"""benchmarks/ab_base.sh: the base side of a comparison prepared from git here, swapped in and
out without git (as on a device machine, whose copy of the tree has no history)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "ab_base.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _ab(repo: pathlib.Path, *args: str) -> str:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _tree(repo: pathlib.Path) -> dict[str, str]:
    """The tree's files (outside .git and the bases, .ab-*) and their contents."""
    return {str(path.relative_to(repo)): path.read_text() for path in sorted(repo.rglob("*"))
            if path.is_file() and path.relative_to(repo).parts[0] != ".git"
            and not path.relative_to(repo).parts[0].startswith(".ab-")}


def test_prepare_then_swap_base_and_head(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    base = {"pkg/changed.py": "v1\n", "pkg/dirty.py": "v1\n", "pkg/same.py": "same\n",
            "gone.py": "only in the base\n"}
    for name, text in base.items():
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    rev = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "changed.py").write_text("v2\n")
    (repo / "gone.py").unlink()
    (repo / "pkg" / "new.py").write_text("only in the change\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "change")
    (repo / "pkg" / "dirty.py").write_text("uncommitted\n")  # the working tree counts
    (repo / "benchmarks").mkdir()  # the harness stays the change's on both sides
    (repo / "benchmarks" / "gpu_run.sh").write_text("the change's harness\n")
    _git(repo, "add", "benchmarks")
    head = _tree(repo)

    assert _ab(repo, "prepare", "HEAD~1") == "base " + rev[:7] + ": 3 files, 1 absent there"
    assert (repo / ".ab-base" / "REV").read_text().strip() == rev
    assert (repo / ".ab-base" / "ABSENT").read_text() == "pkg/new.py\n"

    base["benchmarks/gpu_run.sh"] = "the change's harness\n"
    for _ in range(2):  # idempotent
        assert _ab(repo, "swap", "base") == "side: base " + rev[:7]
        assert _tree(repo) == base
    for _ in range(2):
        assert _ab(repo, "swap", "head") == "side: head"
        assert _tree(repo) == head
    _ab(repo, "swap", "base")
    assert _tree(repo) == base


def test_two_bases_in_their_own_directories(tmp_path):
    """Each base in its own directory: the tree goes to either and back."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    trees = []
    for version in ("v1", "v2", "v3"):
        (repo / "module.py").write_text(version + "\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", version)
        trees.append(_tree(repo))
    _ab(repo, "prepare", "HEAD~2", ".ab-first")
    _ab(repo, "prepare", "HEAD~1")
    for side, directory, tree in (("base", ".ab-first", trees[0]), ("head", ".ab-first", trees[2]),
                                  ("base", None, trees[1]), ("head", None, trees[2])):
        _ab(repo, "swap", side, *([directory] if directory else []))
        assert _tree(repo) == tree, (side, directory)


def test_usage_errors(tmp_path):
    for args in ([], ["swap"], ["swap", "left"], ["prepare"]):
        run = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, capture_output=True,
                             text=True)
        assert run.returncode == 2 and "usage" in run.stderr, args
    run = subprocess.run(["bash", str(SCRIPT), "swap", "base"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "prepare REV" in run.stderr
