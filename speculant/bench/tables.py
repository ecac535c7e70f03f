"""The results tables of the README and the docs, written from the result folders that
``benchmarks/results/manifest.json`` names: no number in a results table is typed by hand.

    python -m speculant.bench.tables            # rewrite every table between its markers
    python -m speculant.bench.tables --check    # change nothing; exit 1 naming each table that differs

In a .md file (README.md, docs/*.md) a table sits between two marker comments, and everything
between them is this module's to write::

    <!-- results-table: NAME -->
    <!-- /results-table -->

The manifest's ``tables`` entry NAME says which result the table shows and how (its ``kind``: a
``speculant bench`` run's methods by category, a sweep, the default per CPU class, a serve_load
run). Its ``machines`` entry says what CPU the old result folders that do not record one ran on,
inferred from their name prefix. tests/test_results_tables.py fails when a table in the docs is not
what this module writes. docs/benchmarks.md ("Adding a result") walks through adding one.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path("benchmarks") / "results"
MANIFEST = RESULTS / "manifest.json"
DOCS = ("README.md", "docs/*.md")  # the files whose markers this module fills
# markers stand on lines of their own (a marker quoted inside a line of text is no marker)
MARKER = re.compile(r"^(<!-- results-table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)^(<!-- /results-table -->)$", re.S | re.M)
OPENING, CLOSING = (re.compile(p, re.M) for p in (r"^<!-- results-table: .* -->$", r"^<!-- /results-table -->$"))
CATEGORIES = {"multi_turn_chat": "chat", "translation": "transl.", "summarization": "summ.",
              "question_answering": "QA", "math_reasoning": "math", "rag": "RAG", "code": "code",
              "agentic": "agentic", "all": "all"}
DASH = "—"


class TableError(Exception):
    """A manifest entry, marker or result that cannot give a table (the message says which)."""


# ---- reading results --------------------------------------------------------------------------

@cache
def _json(path: Path) -> dict:
    if not path.is_file():
        raise TableError(f"{path} does not exist: the manifest names a result that is not there")
    return json.loads(path.read_text())


def bench_run(results: Path, name: str) -> dict:
    """A ``speculant bench`` folder's results.json (``name``: the folder, relative to results/)."""
    return _json(results / name / "results.json")


def primary_rows(run: dict) -> list[dict]:
    """The summary rows of the run's primary setting (batch 1; a method without a drafter has γ None)."""
    s = run["settings"]
    primary = s.get("primary") or {"gamma": s["gammas"][0] if len(s["gammas"]) == 1 else "auto",
                                   "temperature": 0.0 if 0.0 in s["temperatures"] else s["temperatures"][0]}
    return [r for r in run["summary"] if r["batch_size"] == 1 and r["temperature"] == primary["temperature"]
            and r["gamma"] in (None, primary["gamma"])]


def summary_row(rows: list[dict], method: str, category: str = "all", where: str = "") -> dict:
    hits = [r for r in rows if r["method"] == method and r["category"] == category]
    if not hits:
        raise TableError(f"{where}: no summary row for method {method!r}, category {category!r}")
    return hits[0]


def machine_of(name: str, manifest: dict, results: Path) -> dict:
    """What a result ran on: its own record (results.json's ``machine`` with a ``cpu_class``), else
    the manifest's entry for its folder-name prefix (marked inferred)."""
    path = results / name / "results.json"
    if not path.is_file():
        path = results / name / "serve_load.json"
    machine = _json(path).get("machine") if path.is_file() else None
    top = name.split("/")[0]
    known = next((entry for prefix, entry in manifest["machines"].items() if top.startswith(prefix)), None)
    if isinstance(machine, dict) and machine.get("cpu_class"):
        # the manifest's words for that machine where they name the same class (a VM's model name
        # alone, "AMD EPYC", says neither the generation nor the ISA)
        same = known is not None and known["cpu_class"] == machine["cpu_class"]
        return {"cpu_class": machine["cpu_class"], "cpu": known["cpu"] if same else machine["cpu"], "inferred": False}
    if known is not None:
        return {**known, "inferred": True}
    raise TableError(f"{name}: its results record no CPU class and no manifest 'machines' prefix matches it")


# ---- cells --------------------------------------------------------------------------------------

def fmt(x, spec: str = ".2f") -> str:
    return DASH if x is None else format(x, spec)


def speedup_cell(row: dict, vs: str, tau_prefix: str = "", base: dict | None = None) -> str:
    """Speedup against ``vs`` ("speculant none" | "hf generate", or ``base``: the summary row of
    another method in the same category, a peer runtime's), and τ where the method drafts."""
    if base is not None:
        ratio = row["tokens_per_second"] / base["tokens_per_second"] if base.get("tokens_per_second") else None
        cell = f"{fmt(ratio)}×" if ratio is not None else DASH
    else:
        key = "speedup_vs_speculant_none" if vs == "speculant none" else "speedup_vs_hf_generate"
        cell = f"{fmt(row[key])}×" if row.get(key) is not None else DASH
    if row["drafter"] != "none" and row["mean_accepted_tokens"] is not None:
        cell += f" · {tau_prefix}{row['mean_accepted_tokens']:.2f}"
    return cell


EXTRA = {  # optional columns of a bench table: header -> the cell from the "all" row
    "tok/s": lambda r: fmt(r["tokens_per_second"], ".1f"),
    "tree nodes/pass": lambda r: fmt(r.get("mean_tree_nodes"), ".1f").replace(DASH, ""),
    "drafter µs/pass": lambda r: fmt(r.get("drafter_us_per_pass"), ".0f").replace(DASH, ""),
    "identical": lambda r: r["identical"],
}


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def link(name: str, to_results: str) -> str:
    return f"[`{name}/`]({to_results}/{name}/)"


# ---- the kinds of table -------------------------------------------------------------------------

def bench_table(spec: dict, ctx: dict) -> str:
    """A bench run's methods (rows, with labels) by category: speedup against ``vs`` · τ."""
    run = bench_run(ctx["results"], spec["result"])
    rows = primary_rows(run)
    categories = list(dict.fromkeys(p["category"] for p in run["prompts"])) + ["all"]
    extra = spec.get("extra", ["tok/s"])
    head = [spec.get("corner", "method")] + [CATEGORIES.get(c, c) for c in categories] + extra
    body = []
    vs = spec["vs"]
    own = vs in ("speculant none", "hf generate")  # else another method of the run (a peer runtime)
    for method, label in spec["methods"]:
        cells = [speedup_cell(summary_row(rows, method, c, spec["result"]), vs, spec.get("tau_prefix", ""),
                              None if own else summary_row(rows, vs, c, spec["result"]))
                 for c in categories]
        everything = summary_row(rows, method, "all", spec["result"])
        body.append([label] + cells + [EXTRA[x](everything) for x in extra])
    return markdown(head, body)


def sweep_table(spec: dict, ctx: dict) -> str:
    """Methods (rows) by settings (columns: each a γ and a temperature), category all, batch 1."""
    run = bench_run(ctx["results"], spec["result"])
    body = []
    for method, label in spec["methods"]:
        cells = []
        for col in spec["columns"]:
            hits = [r for r in run["summary"] if r["method"] == method and r["category"] == "all"
                    and r["batch_size"] == 1 and r["temperature"] == col["temperature"]
                    and r["gamma"] in (None, col["gamma"])]
            cells.append(speedup_cell(hits[0], spec["vs"], spec.get("tau_prefix", "")) if hits else DASH)
        body.append([label] + cells)
    return markdown([spec.get("corner", "method")] + [c["label"] for c in spec["columns"]], body)


def weights(ran: dict) -> str:
    """The weights a run multiplied with: its dtype, or "quantized" / "q8" where those kernels ran
    (the backend's dtype alone reads float32 there); a CPU bench's default (no dtype given) is
    float32."""
    mode = str(ran.get("cpu_kernels", "")).split(" ")[0]
    if mode in ("quantized", "q8"):
        return mode
    return ran.get("dtype") or "float32"


def defaults_table(spec: dict, ctx: dict) -> str:
    """Per CPU class: what ``speculant generate`` runs there by default, and how fast, from the run
    each row names (its method's dtype and drafter, tok/s, × plain, × HF generate, τ)."""
    head = ["CPU", "runs by default", "tok/s", "× `speculant none`", "× HF `generate`", "τ", "measured"]
    body = []
    for row in spec["rows"]:
        run = bench_run(ctx["results"], row["result"])
        r = summary_row(primary_rows(run), row["method"], "all", row["result"])
        machine = machine_of(row["result"], ctx["manifest"], ctx["results"])
        ran = run.get("ran", {}).get(row["method"]) or {"dtype": run["settings"]["dtype"], "drafter": r["drafter"]}
        cpu = f"{machine['cpu_class']}: {machine['cpu']}"
        runs = f"{weights(ran)}, `{ran['drafter']}`" + (f" ({row['note']})" if row.get("note") else "")
        date = re.search(r"\d{4}-\d{2}-\d{2}", row["result"])
        body.append([cpu, runs, fmt(r["tokens_per_second"], ".1f"),
                     f"{fmt(r['speedup_vs_speculant_none'])}×", f"{fmt(r['speedup_vs_hf_generate'])}×",
                     fmt(r["mean_accepted_tokens"]), f"{date.group(0) if date else ''}, "
                     f"{link(row['result'], ctx['to_results'])}"])
    return markdown(head, body)


def serve_load_table(spec: dict, ctx: dict) -> str:
    """A serve_load run: per concurrency level, plain against speculative throughput and latency."""
    run = _json(ctx["results"] / spec["result"] / "serve_load.json")
    label = spec.get("speculative", "speculative")
    head = ["concurrency", "requests", "plain tok/s", f"{label} tok/s", "p50 / p99 latency, plain",
            "p50 / p99, speculative"]
    levels = list(dict.fromkeys(r["concurrency"] for r in run["rows"]))
    body = []
    for c in levels:
        plain, spec_row = (next(r for r in run["rows"] if r["concurrency"] == c and r["speculate"] == s)
                           for s in (False, True))
        ratio = spec_row["tokens_per_second"] / plain["tokens_per_second"]
        body.append([str(c), str(plain["requests"]), f"{plain['tokens_per_second']:.1f}",
                     f"{spec_row['tokens_per_second']:.1f} ({ratio:.2f}×)",
                     f"{plain['p50_latency_s']:.2f} / {plain['p99_latency_s']:.2f} s",
                     f"{spec_row['p50_latency_s']:.2f} / {spec_row['p99_latency_s']:.2f} s"])
    return markdown(head, body)


KINDS = {"bench": bench_table, "sweep": sweep_table, "defaults": defaults_table, "serve_load": serve_load_table}


# ---- the docs -----------------------------------------------------------------------------------

def render(name: str, manifest: dict, results: Path, md_dir: Path) -> str:
    """Table ``name`` as it belongs in a .md file in ``md_dir`` (links relative to it)."""
    spec = manifest["tables"].get(name)
    if spec is None:
        raise TableError(f"a marker names table {name!r}, which the manifest's 'tables' does not have")
    if spec.get("kind") not in KINDS:
        raise TableError(f"table {name!r}: kind {spec.get('kind')!r} is none of {', '.join(KINDS)}")
    ctx = {"manifest": manifest, "results": results, "to_results": os.path.relpath(results, md_dir)}
    return KINDS[spec["kind"]](spec, ctx)


def filled(text: str, manifest: dict, results: Path, md_dir: Path) -> tuple[str, list[str]]:
    """``text`` with every marked table written afresh, and the names of those that changed."""
    changed = []

    def one(m: re.Match) -> str:
        table = render(m["name"], manifest, results, md_dir) + "\n"
        if table != m["body"]:
            changed.append(m["name"])
        return m.group(1) + table + m.group(4)

    out = MARKER.sub(one, text)
    if len(OPENING.findall(out)) != len(CLOSING.findall(out)):
        raise TableError("a results-table marker is not closed by <!-- /results-table -->")
    return out, changed


def doc_files(repo: Path) -> list[Path]:
    return sorted({p for pattern in DOCS for p in repo.glob(pattern)})


def update(repo: Path | None = None, check: bool = False) -> list[str]:
    """Write (or with ``check`` only compare) every marked table of the checkout ``repo`` (default:
    this one); returns "file: table" for each that differed. A table of the manifest that no file
    shows is an error."""
    repo = repo or REPO
    manifest = json.loads((repo / MANIFEST).read_text())
    results, differ, shown = repo / RESULTS, [], set()
    for path in doc_files(repo):
        text = path.read_text()
        shown.update(m["name"] for m in MARKER.finditer(text))
        new, changed = filled(text, manifest, results, path.parent)
        differ += [f"{path.relative_to(repo)}: {name}" for name in changed]
        if changed and not check:
            path.write_text(new)
    unused = sorted(set(manifest["tables"]) - shown)
    if unused:
        raise TableError(f"the manifest's tables {', '.join(unused)} are in no doc: add their markers or drop them")
    return differ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculant.bench.tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs")
    args = p.parse_args(argv)
    try:
        differ = update(check=args.check)
    except TableError as e:
        print(f"tables: error: {e}", file=sys.stderr)
        return 2
    for d in differ:
        print(f"tables: {'differs' if args.check else 'written'}: {d}")
    return 1 if differ and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
