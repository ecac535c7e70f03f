"""Writing a results folder: results.json (every raw record, the machine and what ran), summary.csv,
records.csv, results.md (README-ready tables) and PNG plots."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from .machine import device_label
from .methods import HF_GENERATE, SPECULANT_NONE
from .metrics import ALL, find, mismatches, sweep_series

SWEEP_AXES = {"gamma": "γ", "temperature": "temperature", "batch_size": "batch size"}


def _fmt(x, spec=".2f", none="—"):
    return none if x is None else format(x, spec)


def _mib(b):
    return None if b is None else b / 2**20


def method_order(summary: list[dict]) -> list[str]:
    return list(dict.fromkeys(s["method"] for s in summary))


def primary_rows(summary: list[dict], primary) -> list[dict]:
    """The summary rows of the primary setting (batch 1; methods without a drafter have γ None)."""
    return [s for s in summary if s["temperature"] == primary.temperature and s["batch_size"] == 1
            and s["gamma"] in (None, primary.gamma)]


def _speedup_cells(summary: list[dict], method: str, cols: list[str], key: str) -> list[str]:
    """One method's cells: speedup (``key``) · τ per category."""
    cells = []
    for c in cols:
        hit = find(summary, method=method, category=c)
        s = hit[0] if hit else None
        if s is None or s[key] is None:
            cells.append("—")
        else:
            tau = f" · τ {s['mean_accepted_tokens']:.2f}" if s["mean_accepted_tokens"] is not None else ""
            cells.append(f"{_fmt(s[key])}×{tau}")
    return cells


def primary_table(summary: list[dict], categories: list[str]) -> str:
    """Method rows x category columns: speedup vs HF generate and τ; then the overall numbers.
    ``summary``: the primary rows only."""
    cols = categories + [ALL]
    head = "| method | " + " | ".join(cols) + " | tok/s | α | tree nodes/pass | drafter µs/pass | peak MiB | identical |"
    lines = [head, "|" + "---|" * (len(cols) + 7)]
    for m in method_order(find(summary)):
        cells = _speedup_cells(summary, m, cols, "speedup_vs_hf_generate")
        a = find(summary, method=m, category=ALL)[0]
        ident = a["identical"] if not a["identical"].startswith("NO") else f"**❌ {a['identical']}**"
        lines.append(f"| {m} | " + " | ".join(cells) +
                     f" | {_fmt(a['tokens_per_second'], '.1f')} | {_fmt(a['acceptance_rate'])} "
                     f"| {_fmt(a.get('mean_tree_nodes'), '.1f')} | {_fmt(a.get('drafter_us_per_pass'), '.0f')} "
                     f"| {_fmt(_mib(a['peak_memory_bytes']), '.0f')} | {ident} |")
    return "\n".join(lines)


def vs_none_table(summary: list[dict], categories: list[str]) -> str:
    """The same rows against ``speculant none`` (plain decoding through the same engine, dtype and path):
    what speculation itself gains."""
    cols = categories + [ALL]
    lines = ["| method | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for m in method_order(find(summary)):
        lines.append(f"| {m} | " + " | ".join(_speedup_cells(summary, m, cols, "speedup_vs_speculant_none")) + " |")
    return "\n".join(lines)


def sweep_table(series: dict, axis: str, values: list) -> str:
    head = f"| method \\ {SWEEP_AXES[axis]} | " + " | ".join(str(v) for v in values) + " |"
    lines = [head, "|" + "---|" * (len(values) + 1)]
    for m, row in series.items():
        cells = []
        for s in row:
            if s is None:
                cells.append("—")
                continue
            tau = f" · τ {s['mean_accepted_tokens']:.2f}" if s["mean_accepted_tokens"] is not None else ""
            bad = " ❌" if s["identical"].startswith("NO") else ""
            cells.append(f"{_fmt(s['speedup_vs_hf_generate'])}×{tau}{bad}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})


def flat_rows(records: list[dict]) -> list[dict]:
    """One CSV line per prompt row of every call."""
    out = []
    for i, rec in enumerate(records):
        call = {k: v for k, v in rec.items() if k != "rows"}
        for row in rec["rows"]:
            out.append({"call": i, **call, **row})
    return out


def _plot_lines(path: Path, series: dict, values: list, xlabel: str, title: str) -> None:
    import matplotlib.pyplot as plt  # plots only: matplotlib is slow to import

    fig, ax = plt.subplots(figsize=(9, 4.2))
    xs = list(range(len(values)))
    for m, row in series.items():
        ys = [s["speedup_vs_hf_generate"] if s else None for s in row]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(xs, [str(v) for v in values])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup vs HF generate (×)")
    ax.set_title(title)
    if ax.lines[1:]:  # the first line is the 1.0 guide
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup_by_category(path: Path, summary: list[dict], categories: list[str]) -> None:
    import matplotlib.pyplot as plt  # plots only: matplotlib is slow to import

    methods = [m for m in method_order(find(summary)) if m != HF_GENERATE]
    cols = categories + [ALL]
    fig, ax = plt.subplots(figsize=(max(9, 1.3 * len(cols) + 3), 4.5))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ys = []
        for c in cols:
            hit = find(summary, method=m, category=c)
            ys.append(hit[0]["speedup_vs_hf_generate"] or 0.0 if hit else 0.0)
        ax.bar([x + i * width for x in range(len(cols))], ys, width, label=m)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cols))], cols, rotation=30, ha="right")
    ax.set_ylabel("speedup vs HF generate (×)")
    ax.set_title("Speedup by category")
    if methods:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance_by_position(path: Path, summary: list[dict]) -> None:
    import matplotlib.pyplot as plt  # plots only: matplotlib is slow to import

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in find(summary, category=ALL):
        hist = s["acceptance_by_position"]
        if hist:
            ax.plot(range(1, len(hist) + 1), hist, marker="o", label=f"{s['method']} (γ={s['gamma_used']})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (mean over prompts)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no drafted tokens", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweeps(config, summary: list[dict]) -> dict:
    """axis -> (values, series) for every sweep asked for."""
    p = config.primary
    methods = method_order(summary)
    drafted = [m for m in methods if m.startswith("speculant ") and m != SPECULANT_NONE]
    base = [HF_GENERATE, SPECULANT_NONE] + drafted
    out = {}
    if len(config.gammas) > 1:
        out["gamma"] = (config.gammas, sweep_series(summary, "gamma", config.gammas,
                                                    {"temperature": p.temperature, "batch_size": 1}, drafted))
    if len(config.temperatures) > 1:
        out["temperature"] = (config.temperatures, sweep_series(
            summary, "temperature", config.temperatures, {"gamma": p.gamma, "batch_size": 1}, base))
    if len(config.batch_sizes) > 1:
        out["batch_size"] = (config.batch_sizes, sweep_series(
            summary, "batch_size", config.batch_sizes, {"gamma": p.gamma, "temperature": p.temperature}, base))
    return out


def write_results(out_dir: Path, config, prompts, records: list[dict], summary: list[dict], machine: dict,
                  ran: dict | None = None) -> dict:
    """Write every output file; returns {name: path}. ``machine``: ``machine.machine_info()``;
    ``ran``: each speculant method's ``machine.what_ran`` (its drafter, dtype, path, kernels)."""
    import matplotlib  # plots only: matplotlib is slow to import

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    p = config.primary
    prim = primary_rows(summary, p)
    categories = list(dict.fromkeys(x.category for x in prompts))
    bad = mismatches(records)
    plain_vs_hf = mismatches(records, plain=True)
    swept = sweeps(config, summary)
    files = {}

    settings = {k: v for k, v in vars(config).items()}
    settings["primary"] = {"gamma": p.gamma, "temperature": p.temperature, "batch_size": 1}
    settings["gamma_auto_means"] = "speculant's adaptive controller (speculant/controller.py); HF's own schedule for HF assisted"
    files["json"] = out_dir / "results.json"
    with open(files["json"], "w") as f:
        json.dump({"machine": machine, "ran": ran or {}, "settings": settings,
                   "prompts": [vars(x) for x in prompts], "summary": summary,
                   "mismatches": bad, "plain_vs_hf": plain_vs_hf, "records": records}, f, indent=1)
    files["summary_csv"] = out_dir / "summary.csv"
    write_csv(files["summary_csv"], summary)
    files["records_csv"] = out_dir / "records.csv"
    write_csv(files["records_csv"], flat_rows(records))

    md = [f"## speculant bench: {config.target} on {device_label(machine)}", ""]
    if bad:
        md += [f"**❌ OUTPUT MISMATCH: {len(bad)} greedy output(s) differ from their reference** (speculation: "
               "`speculant none`'s text; other methods: HF generate's; see `mismatches` in results.json)", ""]
    compared = [r for rec in records if rec["method"] == SPECULANT_NONE and rec["temperature"] == 0
                and rec["batch_size"] == 1 for r in rec["rows"]]
    if compared and plain_vs_hf:
        md += [f"Plain decoding (`speculant none`) differs from HF `generate` on {len(plain_vs_hf)} of "
               f"{len(compared)} greedy outputs: its kernels round otherwise than HF's (in bf16 that parts texts "
               "at near-ties; speculation keeps plain decoding's text): `plain_vs_hf` in results.json.", ""]
    md += [f"{'Greedy speedup' if p.temperature == 0 else 'Speedup'} vs HF `generate` · τ (tokens per target pass), batch 1, "
           f"temperature {p.temperature}, γ {p.gamma}, {config.max_new_tokens} new tokens, "
           f"torch {machine['torch']}, transformers {machine['transformers']}.", "",
           primary_table(prim, categories), "",
           "The same runs against `speculant none` (plain decoding, same engine, dtype and path) · τ:", "",
           vs_none_table(prim, categories), ""]
    for axis, (values, series) in swept.items():
        md += [f"### Speedup vs {SWEEP_AXES[axis]}", "", sweep_table(series, axis, values), ""]
    files["markdown"] = out_dir / "results.md"
    files["markdown"].write_text("\n".join(md))

    files["plot_category"] = out_dir / "speedup_by_category.png"
    plot_speedup_by_category(files["plot_category"], prim, categories)
    files["plot_position"] = out_dir / "acceptance_by_position.png"
    plot_acceptance_by_position(files["plot_position"], prim)
    for axis, (values, series) in swept.items():
        files[f"plot_{axis}"] = out_dir / f"speedup_vs_{axis}.png"
        _plot_lines(files[f"plot_{axis}"], series, values, SWEEP_AXES[axis], f"Speedup vs {SWEEP_AXES[axis]}")
    return files
