"""The repository stays small: no large file, a bounded benchmarks/results/, no code kept as a result.

Which files: what git tracks plus the new files it does not ignore (``git ls-files --cached
--others --exclude-standard``: what a commit would hold), that exist on disk. Skipped where git or
the ``.git`` folder is missing (an sdist, a wheel's install).

Rules:
- no file is larger than ``MAX_FILE`` (2 MiB), but those in ``LARGE_FILES``, each under its own cap;
- the files under ``benchmarks/results/`` total at most ``MAX_RESULTS``;
- no file under ``benchmarks/results/`` is a script or a patch (``*.py``, ``*.sh``, ``*.patch``,
  ``*.diff``): scripts live in ``scripts/`` (indexed in scripts/README.md), and an idea tried and not
  kept is described in its result's README, with the commit that tried it. ``CODE_IN_RESULTS`` lists
  the ones that predate the rule.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results/"
MiB = 1 << 20

MAX_FILE = 2 * MiB

# path -> its own cap (a little above its size today)
LARGE_FILES = {
    # the EAGLE head shipped for the default target (18.8 MiB, bf16): the default drafter, package
    # data that `pip install` must carry; a retrained head of the same shape stays the same size
    "speculant/data/drafters/eagle-smollm2-135m/model.safetensors": 20 * MiB,
}

# 41.5 MiB in 698 files when this bound was set (40.7 MiB tracked plus two new result folders of
# 2026-12-07), and the bound about 20% above. A new result keeps its summaries, tables and plots (results.md, summary.csv, the
# .png files, the JSON the tables read); raw per-request records stay out, or go in compressed.
# Raising this bound is a decision to make in review, not a reflex.
MAX_RESULTS = 50 * MiB

# scripts and patches kept beside their results before this rule; new ones go to scripts/ (a
# script) or into the result's README (what a tried-and-dropped patch did, and the commit that tried it)
CODE_IN_RESULTS = {
    "benchmarks/results/cpu-AVX512BF16-2026-11-26-kernels-all-isas/first-run/firstrun.sh",
    "benchmarks/results/cpu-AVX512BF16-2026-11-29-zen4-chain-in-kernel/tried-not-kept/lookup-first-margin-1.0.patch",
    "benchmarks/results/cpu-AVX512BF16-2026-11-29-zen4-chain-in-kernel/tried-not-kept/row-trial.patch",
    "benchmarks/results/cpu-AVX512BF16-2026-12-06-zen4-fresh-machine/tried-not-kept/scores-from-registers.patch",
    "benchmarks/results/cpu-AVX512BF16-2026-12-06-zen4-fresh-machine/tried-not-kept/softmax-in-weigh.patch",
    "benchmarks/results/cpu-AVX512BF16-2026-12-06-zen4-head-bits/verify_in_situ.py",
}
CODE_SUFFIXES = (".py", ".sh", ".patch", ".diff")


@functools.cache
def _files() -> dict[str, int]:
    """Each file a commit would hold (relative path, POSIX) and its size in bytes."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist or an installed package): nothing to list")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    sizes = {}
    for name in sorted(set(out.decode("utf-8", "surrogateescape").split("\0")) - {""}):
        path = ROOT / name
        if path.is_file() and not path.is_symlink():  # a file deleted in the working tree is gone
            sizes[name] = path.stat().st_size
    return sizes


def test_files_are_listed():
    """The listing sees the repository (a broken listing would pass every check below)."""
    files = _files()
    assert "README.md" in files and "pyproject.toml" in files
    assert any(name.startswith(RESULTS) for name in files)


def test_no_large_file():
    """No file over MAX_FILE (2 MiB) but those in LARGE_FILES, each under its own cap."""
    files = _files()
    large = {name: size for name, size in files.items() if size > LARGE_FILES.get(name, MAX_FILE)}
    assert not large, (
        f"files over {MAX_FILE // MiB} MiB (or over their own cap in LARGE_FILES); keep large outputs, "
        "weights and raw records out of the repository, or compress them:\n"
        + "\n".join(f"  {name}: {size / MiB:.1f} MiB" for name, size in sorted(large.items())))


def test_large_files_listed_still_exist():
    """LARGE_FILES names only files that exist and are above MAX_FILE (a stale entry goes)."""
    files = _files()
    stale = [name for name in LARGE_FILES if files.get(name, 0) <= MAX_FILE]
    assert not stale, f"LARGE_FILES entries that are gone or small now (remove them): {stale}"


def test_results_total_is_bounded():
    """The files under benchmarks/results/ total at most MAX_RESULTS."""
    results = {name: size for name, size in _files().items() if name.startswith(RESULTS)}
    total = sum(results.values())
    biggest = sorted(results.items(), key=lambda item: -item[1])[:5]
    assert total <= MAX_RESULTS, (
        f"benchmarks/results/ holds {total / MiB:.1f} MiB, over its bound of {MAX_RESULTS / MiB:.0f} MiB: "
        "keep summaries and plots and leave raw per-request records out (or compress them); largest:\n"
        + "\n".join(f"  {name}: {size / MiB:.2f} MiB" for name, size in biggest))


def test_no_code_in_results():
    """No script or patch under benchmarks/results/ but those in CODE_IN_RESULTS (older than the rule)."""
    files = _files()
    code = {name for name in files if name.startswith(RESULTS) and name.endswith(CODE_SUFFIXES)}
    new = sorted(code - CODE_IN_RESULTS)
    assert not new, ("scripts or patches under benchmarks/results/ (a script belongs in scripts/, a "
                     "tried idea in its result's README with its commit):\n  " + "\n  ".join(new))
    stale = sorted(CODE_IN_RESULTS - set(files))
    assert not stale, f"CODE_IN_RESULTS entries that are gone (remove them): {stale}"
