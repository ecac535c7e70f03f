"""Results that write the docs: every results table in README.md and docs/*.md is what
``speculant.bench.tables`` writes from the runs benchmarks/results/manifest.json names; a number
edited by hand, a marker left open or a table the manifest lacks is caught; a new run (which records
its machine and what ran, speculant/bench/machine.py) becomes a table row by a manifest edit alone;
every result folder says, or the manifest infers, which CPU it ran on."""
from __future__ import annotations

import json
import shutil

import pytest

from speculant.bench import machine, tables

RESULTS = tables.REPO / tables.RESULTS


def test_every_table_in_the_docs_is_what_the_manifest_and_its_results_write():
    differ = tables.update(tables.REPO, check=True)
    assert differ == [], f"run `python -m speculant.bench.tables`: these tables differ from their results: {differ}"


def test_a_number_edited_by_hand_is_caught_and_rewritten():
    readme = (tables.REPO / "README.md").read_text()
    manifest = json.loads((tables.REPO / tables.MANIFEST).read_text())
    row = next(line for line in readme.splitlines() if line.startswith("| AMX: "))
    edited = readme.replace(row, row.replace("× |", "0× |", 1))
    new, changed = tables.filled(edited, manifest, RESULTS, tables.REPO)
    assert changed == ["readme-defaults"] and new == readme


def test_an_open_marker_or_an_unknown_table_is_an_error():
    manifest = json.loads((tables.REPO / tables.MANIFEST).read_text())
    with pytest.raises(tables.TableError, match="not closed"):
        tables.filled("<!-- results-table: readme-defaults -->\n| x |\n", manifest, RESULTS, tables.REPO)
    with pytest.raises(tables.TableError, match="does not have"):
        tables.filled("<!-- results-table: nothing-like-it -->\n<!-- /results-table -->", manifest, RESULTS,
                      tables.REPO)


def test_every_result_folder_says_or_the_manifest_infers_its_cpu():
    manifest = json.loads((tables.REPO / tables.MANIFEST).read_text())
    names = [p.name for p in RESULTS.iterdir() if p.name not in ("README.md", "manifest.json")]
    classes = {name: tables.machine_of(name, manifest, RESULTS)["cpu_class"] for name in names}
    assert classes["cpu-2core-2026-11-23-main"] == "AVX512" and classes["cpu-AVX2-2026-11-23-trees"] == "AVX2"
    index = (RESULTS / "README.md").read_text()
    unindexed = [n for n in names if n not in index]
    assert not unindexed, f"benchmarks/results/README.md does not index {unindexed}"


def _new_run(folder, cpu_class="AVX2", tok_s=30.0):
    """A results.json as speculant bench now writes it: the machine and what ran recorded."""
    def row(method, drafter, category, speed_none, speed_hf, tau, tps):
        return {"method": method, "drafter": drafter, "gamma": None if drafter == "none" else "auto",
                "temperature": 0.0, "batch_size": 1, "category": category, "tokens_per_second": tps,
                "speedup_vs_speculant_none": speed_none, "speedup_vs_hf_generate": speed_hf,
                "mean_accepted_tokens": tau, "identical": "yes"}

    summary = [row("hf generate", "none", c, 0.5, 1.0, 1.0, tok_s / 4) for c in ("code", "all")]
    summary += [row("speculant none", "none", c, 1.0, 2.0, 1.0, tok_s / 2) for c in ("code", "all")]
    summary += [row("speculant ngram", "ngram", c, 2.0, 4.0, 1.75, tok_s) for c in ("code", "all")]
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({
        "machine": {"cpu": "Some CPU", "cpu_class": cpu_class, "cpu_flags": ["avx2", "fma"], "commit": "abc"},
        "ran": {"speculant ngram": {"drafter": "ngram", "dtype": "float32", "path": "fast",
                                    "cpu_kernels": "quantized (Q4_1 x210, Q8_0 x1)"}},
        "settings": {"gammas": ["auto"], "temperatures": [0.0], "dtype": None,
                     "primary": {"gamma": "auto", "temperature": 0.0, "batch_size": 1}},
        "prompts": [{"category": "code"}], "summary": summary}))


def test_a_new_run_becomes_a_row_by_a_manifest_edit_alone(tmp_path):
    """The lead's path: a new folder, its name in the manifest, the module run; --check then passes."""
    results = tmp_path / tables.RESULTS
    _new_run(results / "cpu-AVX2-2030-01-01-new")
    manifest = {"machines": {}, "tables": {
        "defaults": {"kind": "defaults", "rows": [{"result": "cpu-AVX2-2030-01-01-new", "method": "speculant ngram"}]},
        "per-category": {"kind": "bench", "result": "cpu-AVX2-2030-01-01-new", "vs": "speculant none",
                         "methods": [["speculant none", "plain"], ["speculant ngram", "**ngram**"]]}}}
    (results / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("A\n<!-- results-table: defaults -->\nold\n<!-- /results-table -->\nB\n")
    (tmp_path / "docs" / "x.md").write_text("<!-- results-table: per-category -->\n<!-- /results-table -->\n")
    assert tables.update(tmp_path, check=True) == ["README.md: defaults", "docs/x.md: per-category"]
    assert "old" in (tmp_path / "README.md").read_text()  # --check writes nothing
    tables.update(tmp_path)
    assert tables.update(tmp_path, check=True) == []
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("A\n<!-- results-table: defaults -->\n| CPU |") and readme.endswith("-->\nB\n")
    assert ("| AVX2: Some CPU | quantized, `ngram` | 30.0 | 2.00× | 4.00× | 1.75 | 2030-01-01, "
            "[`cpu-AVX2-2030-01-01-new/`](benchmarks/results/cpu-AVX2-2030-01-01-new/) |") in readme
    doc = (tmp_path / "docs" / "x.md").read_text()
    assert "| plain | 1.00× | 1.00× | 15.0 |" in doc and "| **ngram** | 2.00× · 1.75 | 2.00× · 1.75 | 30.0 |" in doc
    manifest["tables"]["orphan"] = manifest["tables"]["defaults"]
    (results / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(tables.TableError, match="orphan"):
        tables.update(tmp_path, check=True)


def test_the_module_exits_1_where_a_table_differs(tmp_path, monkeypatch, capsys):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / tables.RESULTS).symlink_to(RESULTS)
    shutil.copy(tables.REPO / "README.md", tmp_path / "README.md")
    (tmp_path / "docs").mkdir()
    for doc in (tables.REPO / "docs").glob("*.md"):
        shutil.copy(doc, tmp_path / "docs" / doc.name)
    monkeypatch.setattr(tables, "REPO", tmp_path)
    assert tables.main(["--check"]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("| AMX: ", "| AMX (edited): ", 1))
    assert tables.main(["--check"]) == 1 and "differs: README.md: readme-defaults" in capsys.readouterr().out
    assert tables.main([]) == 0 and tables.main(["--check"]) == 0


# ---- what a run records -------------------------------------------------------------------------

@pytest.mark.parametrize("arch,info,flags,cls", [
    ("x86_64", {"flags": "fpu sse avx2 fma avx512f avx512_bf16 amx_tile amx_bf16"},
     ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], "AMX"),
    ("x86_64", {"flags": "fpu avx2 fma avx512f avx512bw avx512_bf16"}, ["avx2", "fma", "avx512f", "avx512bw",
                                                                          "avx512_bf16"], "AVX512BF16"),
    ("x86_64", {"flags": "fpu avx2 fma avx512f"}, ["avx2", "fma", "avx512f"], "AVX512"),
    ("x86_64", {"flags": "fpu avx2 fma"}, ["avx2", "fma"], "AVX2"),
    ("aarch64", {"Features": "fp asimd sve bf16 i8mm"}, ["asimd", "bf16", "i8mm", "sve"], "aarch64+sve"),
    ("aarch64", {}, [], "aarch64"),
])
def test_the_cpu_class_and_flags_come_from_cpuinfo(monkeypatch, arch, info, flags, cls):
    monkeypatch.setattr(machine, "_cpuinfo", lambda: info)
    monkeypatch.setattr(machine.platform, "machine", lambda: arch)
    assert machine.cpu_flags() == flags
    assert machine.cpu_class(flags) == cls


def test_a_run_records_the_commit_cpu_and_isa(monkeypatch):
    info = machine.machine_info()
    assert info["cpu_class"] == machine.cpu_class(info["cpu_flags"]) and info["cpu_capability"]
    if (machine.REPO / ".git").exists():  # a checkout (CI's); a copy without .git says so instead
        assert info["source"] == "git" and len(info["commit"]) == 40 and isinstance(info["dirty"], bool)
    monkeypatch.setattr(machine, "REPO", machine.REPO / "speculant")  # not the checkout's top: a copy
    monkeypatch.setenv("SPECULANT_COMMIT", "feed")
    assert machine.commit() == {"commit": "feed", "dirty": None, "source": "$SPECULANT_COMMIT"}
