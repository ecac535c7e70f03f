"""What γ auto learnt in one ``speculant generate``, kept for the next: the engine's cost model
(pass times by width, acceptance per draft grade) per machine, model, device, kernels and drafter, in
``$SPECULANT_CACHE/costs/``.

An engine learns what a verify block of each width costs by verifying some: its first passes time a
plain one, the widest and half of it. A server does this once; a command run once per process did it
every time: on a 2-core Xeon the haiku of the README's first command (23 tokens, q8, ``ngram``) spent
two of its 19 passes verifying 16 and 8 rows (17.6 and 11.3 ms against a plain pass's 6), and judged
its first drafts by the prior's acceptance (0.6) rather than what such drafts keep. The times are
relative to the machine's running speed (``VerifyTimes``), so a later run on a busier machine scales
them with its own first passes. A file that cannot be read, or from another version, is ignored.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..models.cpu_kernels import machine_key
from ..models.loading import cache_dir
from .cpu_choice import _drafter_key, _model_key

VERSION = 1


def _file(gen, target: str, drafter: str | None) -> Path:
    info = {k: v for k, v in gen.backend.info().items() if k in ("path", "dtype", "cpu_kernels")}  # what runs
    info["device"] = str(gen.engine.device)
    raw = f"{machine_key()}||{_model_key(target)}||{json.dumps(info, sort_keys=True)}||{_drafter_key(drafter)}||{VERSION}"
    return cache_dir() / "costs" / f"{hashlib.sha256(raw.encode()).hexdigest()[:20]}.json"


def restore(gen, target: str, drafter: str | None) -> bool:
    """Start ``gen``'s engine from the costs a run with the same machine, model, device, kernels and
    drafter kept; whether there were any."""
    try:
        state = json.loads(_file(gen, target, drafter).read_text())
        gen.engine.costs.restore(state)
        return True
    except Exception:  # no file yet, or one this version cannot read: time the widths afresh
        return False


def save(gen, target: str, drafter: str | None) -> None:
    """Keep what ``gen``'s engine has learnt for the next run (written whole, then renamed: a run
    reading it meanwhile sees the old file or the new one)."""
    try:
        path = _file(gen, target, drafter)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(gen)}.tmp")
        tmp.write_text(json.dumps(gen.engine.costs.state()))
        tmp.replace(path)
    except Exception:  # a read-only cache, say: the next run times its widths again
        pass
