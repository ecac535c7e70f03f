"""Pure aggregation of raw records into the numbers a benchmark reports.

Definitions (per method, setting and category; pooled over prompts and repeats):
- tokens/s: new tokens / wall-clock seconds of the calls (the harness's clock, same for all methods);
  with repeats, each call counts by its median repeat (the faster middle one of an even number),
  so a pause of the machine during one call does not move a category
- speedup: tokens/s over the tokens/s of HF ``generate`` (and of ``speculant none``) at the same
  temperature, batch size and category, measured in the same run
- α (acceptance rate): accepted draft tokens / draft tokens
- τ (mean accepted tokens): new tokens / target forward passes (1 for plain decoding; for HF
  methods the passes are counted with a forward hook on the target)
- acceptance by position j: the mean over prompts of each prompt's acceptance at draft position j
  (prompts that never drafted position j are left out)
- identical: greedy output equal to its reference's (batch 1) token for token, prompt by prompt:
  a speculant method's is ``speculant none`` (plain decoding through the same engine, dtype and
  kernels: speculation promises its text bit for bit), any other method's HF ``generate``'s.
  ``speculant none`` itself is held to HF ``generate`` (in bf16 it parts from HF's own kernels at
  rounding near-ties: ``plain_vs_hf``); a peer runtime's count of texts equal to HF's is for
  information (it re-quantizes or rounds otherwise)
"""
from __future__ import annotations

from collections import defaultdict

from .methods import HF_GENERATE, SPECULANT_NONE

ALL = "all"


def setting_key(rec: dict) -> tuple:
    return (rec["method"], rec["gamma"], float(rec["temperature"]), int(rec["batch_size"]))


def greedy_reference(records: list[dict], method: str = HF_GENERATE) -> dict[int, list[int]]:
    """prompt id -> ``method``'s greedy batch-1 output (first repeat)."""
    ref: dict[int, list[int]] = {}
    for rec in records:
        if rec["method"] == method and rec["temperature"] == 0 and rec["batch_size"] == 1:
            for row in rec["rows"]:
                ref.setdefault(row["prompt_id"], row["token_ids"])
    return ref


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def references(records: list[dict]) -> dict[str, dict[int, list[int]]]:
    return {m: greedy_reference(records, m) for m in (HF_GENERATE, SPECULANT_NONE)}


def reference_of(method: str, refs: dict) -> tuple[str, dict]:
    """The output a method must reproduce: plain decoding for speculation, HF generate otherwise."""
    if method.startswith("speculant") and method != SPECULANT_NONE and refs[SPECULANT_NONE]:
        return SPECULANT_NONE, refs[SPECULANT_NONE]
    return HF_GENERATE, refs[HF_GENERATE]


def mismatches(records: list[dict], plain: bool = False) -> list[dict]:
    """Every greedy row whose output differs from its reference's (``reference_of``): never averaged
    away. ``plain``: instead, the rows of ``speculant none`` that differ from HF generate's."""
    refs = references(records)
    out = []
    for rec in records:
        if rec["temperature"] != 0 or (rec["method"] == SPECULANT_NONE) != plain or rec["kind"] == "peer":
            continue  # peers: another runtime's rounding, compared for information (summary "identical")
        name, ref = reference_of(rec["method"], refs)
        for row in rec["rows"]:
            want = ref.get(row["prompt_id"])
            if want is None:
                continue
            k = first_divergence(want, row["token_ids"])
            if k is not None:
                out.append({
                    "method": rec["method"], "reference": name, "gamma": rec["gamma"], "batch_size": rec["batch_size"],
                    "repeat": rec.get("repeat"), "prompt_id": row["prompt_id"], "category": row["category"],
                    "first_divergence": k,
                    "reference_token": want[k] if k < len(want) else None,
                    "got_token": row["token_ids"][k] if k < len(row["token_ids"]) else None,
                })
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def acceptance_by_position(rows: list[dict]) -> list[float]:
    sums, counts = [], []
    for row in rows:
        for j, rate in enumerate(row.get("acceptance_by_position") or []):
            if j >= len(sums):
                sums.append(0.0)
                counts.append(0)
            sums[j] += rate
            counts[j] += 1
    return [s / c for s, c in zip(sums, counts)]


def median_repeats(recs: list[dict]) -> list[dict]:
    """Each call's median repeat by seconds per token (the faster middle one of an even number): the
    same prompts and setting are one call."""
    calls: dict[tuple, list[dict]] = defaultdict(list)
    for rec in recs:
        calls[tuple(r["prompt_id"] for r in rec["rows"])].append(rec)

    def rate(rec):
        return rec["seconds"] / max(1, sum(r["new_tokens"] for r in rec["rows"]))

    return [sorted(reps, key=rate)[(len(reps) - 1) // 2] for reps in calls.values()]


def _group_metrics(recs: list[dict], rows: list[dict], ref: dict) -> dict:
    """``rows``: all rows of ``recs``."""
    timed = median_repeats(recs)
    tokens = sum(r["new_tokens"] for rec in timed for r in rec["rows"])  # the tokens/s of the median repeats
    seconds = sum(rec["seconds"] for rec in timed)
    all_tokens = sum(r["new_tokens"] for r in rows)
    passes = sum(r["target_forward_passes"] for r in rows if r["target_forward_passes"] is not None)
    drafted = [r["draft_tokens"] for r in rows if r["draft_tokens"] is not None]
    accepted = [r["accepted_draft_tokens"] for r in rows if r["accepted_draft_tokens"] is not None]
    by_repeat: dict[int, list] = defaultdict(lambda: [0, 0.0])
    for rec in recs:
        by_repeat[rec.get("repeat", 0)][1] += rec["seconds"]
        by_repeat[rec.get("repeat", 0)][0] += sum(r["new_tokens"] for r in rec["rows"])
    tau = _ratio(all_tokens, passes) if passes else None
    tree_passes = sum(r.get("tree_passes") or 0 for r in rows)
    drafter_seconds = sum(r.get("drafter_seconds") or 0.0 for r in rows)
    out = {
        "prompts": len({r["prompt_id"] for r in rows}),
        "calls": len(recs),
        "new_tokens": all_tokens,
        "seconds": seconds,  # of the median repeats
        "tokens_per_second": _ratio(tokens, seconds),
        "tokens_per_second_by_repeat": [_ratio(t, s) for _, (t, s) in sorted(by_repeat.items())],
        "acceptance_rate": _ratio(sum(accepted), sum(drafted)) if drafted and sum(drafted) else None,
        "mean_accepted_tokens": tau,
        "target_passes_per_token": _ratio(passes, all_tokens) if passes else None,
        "acceptance_by_position": acceptance_by_position(rows) if drafted else [],
        # token trees: nodes verified per tree pass; what drafting costs per target pass
        "mean_tree_nodes": _ratio(sum(r.get("tree_nodes") or 0 for r in rows), tree_passes) if tree_passes else None,
        "drafter_us_per_pass": drafter_seconds / passes * 1e6 if passes and drafted else None,
        "peak_memory_bytes": max(rec["peak_memory_bytes"] for rec in recs),
        "peak_memory_above_start_bytes": max(rec.get("peak_memory_above_start_bytes", 0) for rec in recs),
    }
    greedy = all(rec["temperature"] == 0 for rec in recs)
    compared = [r for r in rows if greedy and r["prompt_id"] in ref]
    bad = [r for r in compared if first_divergence(ref[r["prompt_id"]], r["token_ids"]) is not None]
    out["compared"], out["mismatched"] = len(compared), len(bad)
    if not greedy:
        out["identical"] = "n/a (sampling)"
    elif not compared:
        out["identical"] = "n/a (no reference)"
    elif recs[0]["kind"] == "peer":  # another runtime: how often its text is HF's, for information
        out["identical"] = f"{len(compared) - len(bad)} of {len(compared)} as HF (another runtime)"
    elif bad:
        out["identical"] = f"NO ({len(bad)} of {len(compared)} differ)"
    else:
        out["identical"] = "yes"
    return out


def summarize(records: list[dict]) -> list[dict]:
    """One summary row per (method, γ, temperature, batch size, category), plus category ``all``.
    Per-category rows only at batch size 1 (a batched call's time is not split by category)."""
    refs = references(records)
    by_setting: dict[tuple, list[dict]] = defaultdict(list)
    for rec in records:
        by_setting[setting_key(rec)].append(rec)
    summary = []
    for (method, gamma, temperature, batch), recs in by_setting.items():
        groups: dict[str, tuple[list, list]] = {ALL: (recs, [r for rec in recs for r in rec["rows"]])}
        if batch == 1:
            for rec in recs:
                cat = rec["rows"][0]["category"]
                g = groups.setdefault(cat, ([], []))
                g[0].append(rec)
                g[1].extend(rec["rows"])
        for category, (crecs, rows) in groups.items():
            s = {"method": method, "kind": recs[0]["kind"], "drafter": recs[0]["drafter"], "gamma": gamma,
                 "gamma_used": recs[0]["gamma_used"], "temperature": temperature, "batch_size": batch,
                 "category": category}
            s.update(_group_metrics(crecs, rows, reference_of(method, refs)[1]))
            summary.append(s)
    index = {(s["method"], s["temperature"], s["batch_size"], s["category"]): s for s in summary
             if s["method"] in (HF_GENERATE, SPECULANT_NONE)}
    for s in summary:
        key = (s["temperature"], s["batch_size"], s["category"])
        hf, none = index.get((HF_GENERATE, *key)), index.get((SPECULANT_NONE, *key))
        s["speedup_vs_hf_generate"] = _ratio(s["tokens_per_second"], hf and hf["tokens_per_second"])
        s["speedup_vs_speculant_none"] = _ratio(s["tokens_per_second"], none and none["tokens_per_second"])
    return summary


def find(summary: list[dict], **match) -> list[dict]:
    return [s for s in summary if all(s.get(k) == v for k, v in match.items())]


def sweep_series(summary: list[dict], axis: str, values: list, fixed: dict, methods: list[str]) -> dict:
    """{method: [summary row or None for each value of ``axis``]} at category ``all``.
    A method without a drafter matches any γ (its γ is None)."""
    out = {}
    for m in methods:
        series = []
        for v in values:
            want = dict(fixed, method=m, category=ALL, **{axis: v})
            hits = [s for s in summary if all(
                s.get(k) == val or (k == "gamma" and s["gamma"] is None) for k, val in want.items())]
            series.append(hits[0] if hits else None)
        if any(series):
            out[m] = series
    return out
