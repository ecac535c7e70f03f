"""What the side-by-side scripts share: the bench prompts grouped by category, their results
written where ``OUT_JSON`` says (with the machine that measured them), and a git revision's CPU
kernels beside this tree's (``--base``)."""
import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from speculant.bench.costs import bench_prompts
from speculant.bench.machine import machine_info
from speculant.models import cpu_attention, native, quantized


def prompts_by_category(per_category: int) -> list[str]:
    """The first ``per_category`` bench prompts of each category, a category's prompts together."""
    taken = bench_prompts(per_category)
    order = list(dict.fromkeys(cat for cat, _ in taken))
    return [p for _, p in sorted(taken, key=lambda item: order.index(item[0]))]


def save_results(results: dict, **extra) -> None:
    """``results`` (keys may be tuples) to $OUT_JSON, if set."""
    out = os.environ.get("OUT_JSON")
    if out:
        named = {" | ".join(map(str, k)) if isinstance(k, tuple) else k: v for k, v in results.items()}
        with open(out, "w") as f:
            json.dump({"argv": sys.argv, "machine": machine_info(), **extra, "results": named}, f, indent=1)


def dump_side_by_side(path: str, args, summary: dict, res: dict, **extra) -> None:
    """A side-by-side script's results to ``path``: its arguments, the machine, the summary per
    method, the raw sums per (method, category), and ``extra`` (e.g. per prompt)."""
    with open(path, "w") as f:
        json.dump({"args": vars(args), "machine": machine_info(), "summary": summary,
                   "by_method_and_category": {f"{m}|{c}": v for (m, c), v in res.items()}, **extra}, f, indent=1)


REPO = Path(__file__).resolve().parent.parent


def controller_at(rev: str):
    """``rev``'s speculant/controller.py as a module of its own (its relative imports: this tree's)."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:speculant/controller.py"], capture_output=True,
                         text=True, check=True).stdout
    name = "speculant.controller_base"
    module = type(sys)(name)
    module.__package__ = "speculant"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:speculant/controller.py", "exec"), module.__dict__)
    return module


def revision_files(rev: str, *paths: str) -> tuple[Path, bytes]:
    """``paths`` as they are at ``rev``, taken with ``git archive`` into a new temporary folder:
    (the folder, the archive's bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="speculant-base-"))
    files = subprocess.run(["git", "-C", str(REPO), "archive", rev, *paths], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=files, check=True)
    return folder, files


def base_kernels(rev: str):
    """The CPU kernels module built from ``rev``'s csrc/ under a name of its own (beside this tree's)."""
    folder, files = revision_files(rev, "speculant/models/csrc", "speculant/models/native.py")
    src = folder / "speculant/models/csrc"
    names = ast.literal_eval(re.search(r"^FUNCTIONS = (\(.*?\))$", (folder / "speculant/models/native.py").read_text(),
                                       re.S | re.M).group(1))
    from torch.utils import cpp_extension

    # this tree's flags and defines as ``native.build`` adds them (the vendor's: until 2026-11-30 an
    # Intel CPU's base was built without SPK_CPU_INTEL, so its q8 prefetched as on AMD, 2.4x slower)
    flags = native.FLAGS + native.build_flags()
    # keyed as this tree's build is (flags, CPU, compiler, Python, torch): no configuration replaces another's
    name = native.module_name(flags, source=hashlib.sha256(files).hexdigest(), prefix="speculant_kernels_base")
    print(f"building the kernels of {rev} (about a minute)", flush=True)
    return cpp_extension.load_inline(name, [(src / "kernels.cpp").read_text()],
                                     functions=list(names), extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
                                     extra_include_paths=[str(src)])


class Kernels:
    """Which kernels module the next calls use (this tree's, or ``--base``'s). speculant asks
    ``native.build`` for it through ``quantized.kernels`` and ``cpu_attention.kernel``, which keep
    the module they got: both are asked again after each switch. (Until 2026-11-28 they were not:
    every ``--base`` comparison recorded before ran this tree's kernels on both sides.)"""

    def __init__(self, base_rev: str | None):
        self.own, self.build = native.build(), native.build
        self.base = base_kernels(base_rev) if base_rev else None

    def use(self, base: bool) -> None:
        module = self.base if base else self.own
        native.build = (lambda isa=(): module) if base else self.build
        quantized.kernels.cache_clear()
        cpu_attention.kernel.cache_clear()
