"""Every relative link and every repository path the docs name exists.

Which files: the living docs, ``README.md`` and every other top-level ``*.md``, ``docs/*.md``,
``scripts/README.md`` and ``benchmarks/results/README.md`` (``LIVING_DOCS``); for links also each
result folder's ``README.md`` (``benchmarks/results/**/README.md``).

Rule (a), links: the target of every Markdown link ``[text](target)`` in those files (fenced code
blocks and inline code skipped) that is relative (not ``http(s)://``, ``mailto:`` or another
``scheme:``) exists, resolved against the folder of the file holding it, its ``#anchor`` cut off.
A link into a Markdown file with an anchor (``file.md#part``, or a bare ``#part``) names one of
that file's headings, as GitHub spells its ids (lowercase; punctuation but ``-`` and ``_`` dropped;
spaces become ``-``).

Rule (b), paths (living docs only): every path-looking word in inline code, in fenced code blocks
and in plain text exists. A path-looking word is one that

- starts with one of the repository's top-level folders (``speculant/``, ``tests/``, ``scripts/``,
  ``benchmarks/``, ``docs/``) or with a folder inside the package, as the docs name them by their
  package-relative path (``csrc/``, ``core/``, ``models/``, ``drafters/``, ``bench/``, ...), and
- ends in one of ``SOURCE_SUFFIXES`` (``.py``, ``.cpp``, ``.h``, ``.md``, ``.json``, ...) or in
  ``/`` (a folder),

and holds no placeholder (``<...>``, ``{a,b}``, ``*``, ``$VAR``, ``...``, or an all-caps part
such as ``KIND.py``). It is resolved against the repository root, ``speculant/``,
``speculant/models/``, ``speculant/models/csrc/`` and ``speculant/models/csrc/core/``
(``core/eagle.h`` is ``speculant/models/csrc/core/eagle.h``) and must exist under at least one of
them. A word preceded by another path character (``/``, ``.``, ``~``) is part of a longer path and
is not checked alone.

Rule (c), bare names (living docs only): inline code that is one bare source file name
(``engine.py``, ``attention.h``, ``kernels.cpp``; no placeholder) names a file of that name
somewhere under ``speculant/``, ``scripts/`` or ``tests/``.

A result folder's README is a record of what ran then (commands and folders of that day), so only
its links are checked, not the paths its text names.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "speculant"

LIVING_DOCS = sorted(
    [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), ROOT / "scripts" / "README.md",
     ROOT / "benchmarks" / "results" / "README.md"])
RESULT_READMES = sorted(p for p in (ROOT / "benchmarks" / "results").glob("*/**/README.md"))

# where a path the docs name may be rooted: the repository, the package, and the folders the docs name
# their files relative to (models/..., csrc/..., core/..., and arch/... in the kernel core's layout)
BASES = [ROOT, PACKAGE, PACKAGE / "models", PACKAGE / "models" / "csrc", PACKAGE / "models" / "csrc" / "core"]
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".md", ".json", ".jsonl", ".sh", ".html", ".toml",
                   ".safetensors", ".patch")


def _first_parts() -> set[str]:
    """The first folder a path may start with: the top-level folders and those under BASES."""
    names = set()
    for base in BASES:
        names |= {p.name for p in base.iterdir()
                  if p.is_dir() and not p.name.startswith((".", "__")) and not p.name.endswith(".egg-info")}
    return names


FIRST_PARTS = _first_parts()
PATH_WORD = re.compile(
    r"(?<![\w/.~$-])((?:" + "|".join(sorted(map(re.escape, FIRST_PARTS), key=len, reverse=True))
    + r")/[\w./-]*)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _split(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines with inline code blanked, inline-code spans, fenced-block lines), each with its
    line number."""
    prose, code, fenced = [], [], []
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            fenced.append((number, line))
            continue
        code += [(number, m.group(2)) for m in INLINE_CODE.finditer(line)]
        prose.append((number, INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)))
    return prose, code, fenced


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"`|\*\*|__|\[|\]\([^)]*\)", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings (a repeated heading's get -1, -2, ...)."""
    anchors, seen = set(), {}
    prose, _, _ = _split(text)
    lines = text.splitlines()
    for number, _ in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", lines[number - 1])
        if m:
            slug = _slug(m.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _broken_links(doc: Path, text: str) -> list[str]:
    prose, _, _ = _split(text)
    broken = []
    for number, line in prose:
        for m in LINK.finditer(line):
            target = m.group(1)
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            where = f"{_rel(doc)}:{number}: [{target}]"
            if not file_part:
                if anchor.lower() not in _anchors(text):
                    broken.append(f"{where}: no heading #{anchor} here")
                continue
            path = (doc.parent / file_part).resolve()
            if not path.exists():
                broken.append(f"{where}: {file_part} does not exist")
            elif anchor and path.suffix == ".md" and anchor.lower() not in _anchors(path.read_text(encoding="utf-8")):
                broken.append(f"{where}: no heading #{anchor} in {_rel(path)}")
    return broken


def _placeholder(word: str) -> bool:
    if any(c in word for c in "<>{}*$~") or "..." in word:
        return True
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", Path(part).stem) for part in word.split("/") if part)


def _exists(word: str) -> bool:
    return any((base / word).exists() for base in BASES)


def _missing_paths(doc: Path, text: str) -> list[str]:
    prose, code, fenced = _split(text)
    missing = []
    for number, line in sorted(code + prose + fenced):
        for m in PATH_WORD.finditer(line):
            word = m.group(1).rstrip(".,;:")
            if not word.endswith(SOURCE_SUFFIXES + ("/",)) or _exists(word) or _placeholder(word):
                continue
            missing.append(f"{_rel(doc)}:{number}: {word}")
    return missing


BARE_NAME = re.compile(r"[\w-]+\.(?:py|cpp|h)")


@functools.cache
def _source_names() -> frozenset[str]:
    return frozenset(p.name for folder in ("speculant", "scripts", "tests") for p in (ROOT / folder).rglob("*")
                     if p.suffix in (".py", ".cpp", ".h"))


def _missing_names(doc: Path, text: str) -> list[str]:
    _, code, _ = _split(text)
    return [f"{_rel(doc)}:{number}: {span}" for number, span in code
            if BARE_NAME.fullmatch(span) and not _placeholder(span) and span not in _source_names()]


def test_the_docs_are_found():
    """The lists above are not empty (a moved docs folder would otherwise pass every check)."""
    assert ROOT / "README.md" in LIVING_DOCS
    assert len([p for p in LIVING_DOCS if p.parent.name == "docs"]) >= 5
    assert {"csrc", "core", "speculant", "tests", "scripts"} <= FIRST_PARTS


@pytest.mark.parametrize("doc", LIVING_DOCS + RESULT_READMES, ids=_rel)
def test_relative_links_exist(doc):
    """Rule (a): every relative link's file (and a Markdown file's anchor) exists."""
    broken = _broken_links(doc, doc.read_text(encoding="utf-8"))
    assert not broken, "broken relative links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", LIVING_DOCS, ids=_rel)
def test_named_paths_exist(doc):
    """Rules (b) and (c): every repository path and bare source file name a living doc names exists."""
    text = doc.read_text(encoding="utf-8")
    missing = _missing_paths(doc, text) + _missing_names(doc, text)
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_what_they_should():
    """A missing file, a missing anchor and a removed source file are each caught; a placeholder,
    a path inside a longer one, a link to the web and a heading's own anchor are not flagged."""
    doc = ROOT / "docs" / "probe.md"  # read from the text below, not from disk
    text = ("# A title: `here`\n\n[ok](architecture.md) [web](https://example.com) [gone](missing.md) "
            "[bad](architecture.md#no-such-heading) [self](#a-title-here) [good](tests.md#tests)\n"
            "`csrc/attention.cpp` `core/eagle.h` `trained/KIND.py` `speculant/models/fast.py` "
            "`tests/` `bench/` `engine.py` `attention.cpp` `NAME.py`\n"
            "```\ncsrc/quantized.cpp  ~/x/scripts/none.py  out/tests/none.py\n```\n")
    broken = _broken_links(doc, text)
    assert [b.split(": [")[1].split("]")[0] for b in broken] == ["missing.md", "architecture.md#no-such-heading"]
    assert [m.rsplit(": ", 1)[1] for m in _missing_paths(doc, text)] == ["csrc/attention.cpp", "csrc/quantized.cpp"]
    assert [m.rsplit(": ", 1)[1] for m in _missing_names(doc, text)] == ["attention.cpp"]
