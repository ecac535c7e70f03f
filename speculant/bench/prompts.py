"""Benchmark prompt suites: JSONL files with one ``{"prompt": ..., "category": ...}`` object a line.

The default suite ships in the package (8 Spec-Bench-like categories). A malformed line in a user's
file is a SpeculantError naming the file and the line number.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .. import files
from ..errors import SpeculantError

PROMPT_FILE_BYTES = 64 << 20  # a suite's most bytes (the shipped one: ~10 KB)


@dataclass(frozen=True)
class BenchPrompt:
    id: int  # position in the file, stable across methods and sweeps
    category: str
    prompt: str


def default_prompts_path() -> Path:
    return Path(str(resources.files("speculant.bench") / "prompts" / "default.jsonl"))


def read_prompts(path: str | Path | None = None) -> list[BenchPrompt]:
    """Read a prompt suite (the shipped one when ``path`` is None). Blank lines are skipped."""
    path = Path(path) if path is not None else default_prompts_path()
    # a FIFO or a device is said to be one, a file too large refused before it is read whole
    text = files.read_text(path, "prompt file", limit=PROMPT_FILE_BYTES,
                           hint='give a .jsonl file with one {"prompt", "category"} object a line')
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpeculantError(f"{where}: not valid JSON ({e.msg}): write one JSON object a line") from None
        except RecursionError:
            raise SpeculantError(f"{where}: JSON nested too deeply to read: write one flat object a line") from None
        if not isinstance(obj, dict):
            raise SpeculantError(f"{where}: expected a JSON object like {{\"prompt\": \"...\", \"category\": \"...\"}}")
        prompt, category = obj.get("prompt"), obj.get("category")
        if not isinstance(prompt, str) or not prompt.strip():
            raise SpeculantError(f"{where}: \"prompt\" is missing or not a non-empty string")
        if not isinstance(category, str) or not category.strip():
            raise SpeculantError(f"{where}: \"category\" is missing or not a non-empty string")
        prompts.append(BenchPrompt(len(prompts), category.strip(), prompt))
    if not prompts:
        raise SpeculantError(f"prompt file '{path}' has no prompts")
    return prompts


def categories_of(prompts: list[BenchPrompt]) -> list[str]:
    """Categories in first-seen order."""
    return list(dict.fromkeys(p.category for p in prompts))


def select_prompts(prompts: list[BenchPrompt], categories: list[str] | None = None,
                   per_category: int | None = None) -> list[BenchPrompt]:
    """Keep the asked categories (all by default) and the first ``per_category`` prompts of each."""
    known = categories_of(prompts)
    if categories:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SpeculantError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}: "
                                 f"the prompts have {', '.join(known)}")
    keep = set(categories or known)
    if per_category is not None and per_category < 1:
        raise SpeculantError(f"--per-category must be >= 1, got {per_category}")
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if p.category in keep and (per_category is None or taken.get(p.category, 0) < per_category):
            taken[p.category] = taken.get(p.category, 0) + 1
            out.append(p)
    return out
