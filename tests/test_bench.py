"""speculant bench: the prompt reader's errors, the metric computations on known acceptance
patterns, the run plan, and an end-to-end --quick run on tiny random models. No timing asserted."""
import csv
import json

import pytest
import torch

from speculant.api import Generator
from speculant.bench.methods import HF_GENERATE, SPECULANT_NONE, Method, MethodRunner, Setting, methods_for
from speculant.bench.metrics import ALL, find, first_divergence, mismatches, summarize
from speculant.bench.prompts import BenchPrompt, read_prompts, select_prompts
from speculant.bench.runner import BenchConfig, batches, plan
from speculant.cli import main
from speculant.drafters import make_drafter
from speculant.drafters.base import Drafter, Proposal
from speculant.errors import SpeculantError
from helpers import save_tiny_folder


# ---------------------------------------------------------------- prompts

def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("line3, message", [
    ("{not json", "line 3: not valid JSON"),
    ('["a list"]', "line 3: expected a JSON object"),
    ('{"category": "x"}', 'line 3: "prompt" is missing'),
    ('{"prompt": "  ", "category": "x"}', 'line 3: "prompt" is missing'),
    ('{"prompt": "hi"}', 'line 3: "category" is missing'),
    ('{"prompt": "hi", "category": 7}', 'line 3: "category" is missing'),
])
def test_malformed_line_is_an_error_naming_the_line(tmp_path, line3, message):
    good = '{"prompt": "a", "category": "c"}\n'
    f = write(tmp_path / "p.jsonl", good + "\n" + line3 + "\n" + good)  # line 2 blank: skipped, still counted
    with pytest.raises(SpeculantError, match=message):
        read_prompts(f)


def test_missing_and_empty_prompt_files(tmp_path):
    with pytest.raises(SpeculantError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(SpeculantError, match="has no prompts"):
        read_prompts(write(tmp_path / "e.jsonl", "\n\n"))


def test_shipped_suite_and_selection():
    prompts = read_prompts()
    cats = list(dict.fromkeys(p.category for p in prompts))
    # seven Spec-Bench-like categories and our agentic one (outputs that repeat their inputs)
    assert len(cats) == 8 and cats[-1] == "agentic" and sum(p.category == "agentic" for p in prompts) >= 12
    assert all(sum(p.category == c for p in prompts) >= 20 for c in cats[:-1])
    assert [p.id for p in prompts] == list(range(len(prompts)))
    two = select_prompts(prompts, per_category=2)
    assert len(two) == 16 and all(sum(p.category == c for p in two) == 2 for c in cats)
    only = select_prompts(prompts, [cats[1]], 3)
    assert {p.category for p in only} == {cats[1]} and len(only) == 3
    with pytest.raises(SpeculantError, match="unknown category nope"):
        select_prompts(prompts, ["nope"])


# ---------------------------------------------------------------- metrics on a fake engine

def fake_speculant_stats(pattern, gamma, n_tokens):
    """What an engine whose drafter gets ``pattern[k]`` drafts accepted on pass k reports (the
    engine's γ capping at the end included): returns the stats dict and per-position counts."""
    pos, passes, k = 1, 1, 0  # the prefill pass yields the first token
    drafted_at, accepted_at = [0] * gamma, [0] * gamma
    while pos < n_tokens:
        g = min(gamma, n_tokens - pos - 1)
        a = min(pattern[k % len(pattern)], g) if g > 0 else 0
        if g > 0:
            k += 1
        for j in range(g):
            drafted_at[j] += 1
            accepted_at[j] += j < a
        pos += a + 1
        passes += 1
    return {
        "new_tokens": n_tokens, "target_forward_passes": passes,
        "draft_tokens": sum(drafted_at), "accepted_draft_tokens": sum(accepted_at),
        "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at) if d],
    }


def record(method, rows, seconds, temperature=0.0, gamma=None, kind=None, batch=1):
    return {"method": method, "kind": kind or method.split()[0], "drafter": method.split()[-1], "gamma": gamma,
            "gamma_used": gamma, "temperature": temperature, "batch_size": batch, "seconds": seconds,
            "peak_memory_bytes": 100, "repeat": 0, "rows": rows}


def row(pid, cat, tokens, **stats):
    base = {"new_tokens": len(tokens), "target_forward_passes": len(tokens), "draft_tokens": None,
            "accepted_draft_tokens": None, "acceptance_by_position": None}
    return {**base, **stats, "prompt_id": pid, "category": cat, "token_ids": tokens}


def test_fake_engine_patterns_give_known_alpha_tau_and_histogram():
    # by hand, γ=3, 10 tokens (the prefill pass gives token 1; the engine caps γ at room - 1):
    # [3, 0, 1]: pass 1 drafts 3 accepts 3 (-> 5 tokens), pass 2 drafts 3 accepts 0 (-> 6),
    # pass 3 drafts 3 accepts 1 (-> 8), pass 4 drafts 1 (capped) accepts 1 (-> 10): 5 passes, 10 drafted, 5 accepted
    a = fake_speculant_stats([3, 0, 1], 3, 10)
    assert (a["target_forward_passes"], a["draft_tokens"], a["accepted_draft_tokens"]) == (5, 10, 5)
    assert a["acceptance_by_position"] == pytest.approx([3 / 4, 1 / 3, 1 / 3])
    # [3]: 3 accepted (-> 5), 3 accepted (-> 9), γ capped to 0: plain pass (-> 10): 4 passes, 6 drafted, 6 accepted
    b = fake_speculant_stats([3], 3, 10)
    assert (b["target_forward_passes"], b["draft_tokens"], b["accepted_draft_tokens"]) == (4, 6, 6)
    assert b["acceptance_by_position"] == [1.0, 1.0, 1.0]

    out = list(range(10))
    recs = [
        record(HF_GENERATE, [row(0, "x", out)], 2.0),
        record(HF_GENERATE, [row(1, "y", out)], 2.0),
        record(SPECULANT_NONE, [row(0, "x", out)], 1.75),
        record(SPECULANT_NONE, [row(1, "y", out)], 1.75),
        record("speculant fake", [row(0, "x", out, **a)], 1.0, gamma=3),
        record("speculant fake", [row(1, "y", out, **b)], 0.5, gamma=3),
    ]
    summary = summarize(recs)
    allrow = find(summary, method="speculant fake", category=ALL)[0]
    assert allrow["acceptance_rate"] == pytest.approx((5 + 6) / (10 + 6))
    assert allrow["mean_accepted_tokens"] == pytest.approx(20 / 9)
    assert allrow["target_passes_per_token"] == pytest.approx(9 / 20)
    # histogram: the mean over prompts of each prompt's acceptance at position j
    assert allrow["acceptance_by_position"] == pytest.approx([(3 / 4 + 1) / 2, (1 / 3 + 1) / 2, (1 / 3 + 1) / 2])
    assert allrow["tokens_per_second"] == pytest.approx(20 / 1.5)
    assert allrow["speedup_vs_hf_generate"] == pytest.approx((20 / 1.5) / (20 / 4.0))
    assert allrow["speedup_vs_speculant_none"] == pytest.approx((20 / 1.5) / (20 / 3.5))
    x = find(summary, method="speculant fake", category="x")[0]
    assert x["mean_accepted_tokens"] == pytest.approx(10 / 5) and x["acceptance_rate"] == pytest.approx(5 / 10)
    assert x["speedup_vs_hf_generate"] == pytest.approx((10 / 1.0) / (10 / 2.0))
    assert x["identical"] == "yes" and allrow["identical"] == "yes"
    none = find(summary, method=SPECULANT_NONE, category=ALL)[0]
    assert none["acceptance_rate"] is None and none["mean_accepted_tokens"] == 1.0


def test_speculation_is_held_to_plain_decoding_and_plain_decoding_to_hf_generate():
    """Speculation promises plain decoding's text (speculant none), whatever that is; where plain
    decoding parts from HF generate (bf16 rounding near-ties) that is listed apart, not as a
    speculation mismatch."""
    hf, ours, off = [5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 9, 1]
    recs = [record(HF_GENERATE, [row(0, "x", hf)], 1.0), record(SPECULANT_NONE, [row(0, "x", ours)], 1.0),
            record("speculant good", [row(0, "x", ours)], 1.0, gamma=2),
            record("speculant bad", [row(0, "x", off)], 1.0, gamma=2)]
    summary = summarize(recs)
    assert find(summary, method="speculant good", category=ALL)[0]["identical"] == "yes"
    assert find(summary, method="speculant bad", category=ALL)[0]["identical"] == "NO (1 of 1 differ)"
    assert find(summary, method=SPECULANT_NONE, category=ALL)[0]["identical"] == "NO (1 of 1 differ)"
    bad = mismatches(recs)
    assert [(m["method"], m["reference"], m["first_divergence"]) for m in bad] == [("speculant bad", SPECULANT_NONE, 3)]
    plain = mismatches(recs, plain=True)
    assert [(m["method"], m["reference"], m["first_divergence"]) for m in plain] == [(SPECULANT_NONE, HF_GENERATE, 2)]


def test_a_mismatch_is_shown_loudly_and_sampling_is_not_compared(tmp_path):
    ref, bad = [5, 6, 7, 8], [5, 6, 9, 8]
    recs = [
        record(HF_GENERATE, [row(0, "x", ref)], 1.0),
        record(HF_GENERATE, [row(1, "x", ref)], 1.0),
        record("speculant fake", [row(0, "x", ref)], 1.0, gamma=2),
        record("speculant fake", [row(1, "x", bad)], 1.0, gamma=2),
        record("speculant fake", [row(0, "x", bad)], 1.0, gamma=2, temperature=0.7),
        record(HF_GENERATE, [row(0, "x", ref)], 1.0, temperature=0.7),
    ]
    summary = summarize(recs)
    greedy = find(summary, method="speculant fake", category=ALL, temperature=0.0)[0]
    assert greedy["identical"] == "NO (1 of 2 differ)" and greedy["mismatched"] == 1
    assert find(summary, method="speculant fake", temperature=0.7, category=ALL)[0]["identical"] == "n/a (sampling)"
    bads = mismatches(recs)
    assert len(bads) == 1 and bads[0]["prompt_id"] == 1 and bads[0]["first_divergence"] == 2
    assert (bads[0]["reference_token"], bads[0]["got_token"]) == (7, 9)
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1], [1]) is None

    from speculant.bench.machine import machine_info
    from speculant.bench.report import write_results

    ran = {"speculant fake": {"drafter": "fake", "dtype": "float32", "path": "fast"}}
    files = write_results(tmp_path, BenchConfig(target="fake", drafters=[], gammas=[2]), [BenchPrompt(0, "x", "p")], recs,
                          summary, machine_info(torch.device("cpu")), ran)
    md = files["markdown"].read_text()
    assert "OUTPUT MISMATCH: 1 greedy output(s) differ" in md and "❌ NO (1 of 2 differ)" in md
    saved = json.loads(files["json"].read_text())  # what the docs' tables are written from
    assert saved["ran"] == ran and {"commit", "cpu_class", "cpu_flags", "cpu_capability", "gpu"} <= set(saved["machine"])


# ---------------------------------------------------------------- the real engine, a scripted drafter

class ScriptedDrafter(Drafter):
    """Knows the target's greedy continuation; on pass k proposes its next pattern[k] tokens then wrong ones."""

    name = "scripted"

    def __init__(self, reference, pattern, vocab):
        self.reference, self.pattern, self.vocab = reference, pattern, vocab

    def start(self, ctx):
        self.pos, self.k, self.device = 0, 0, ctx.device

    def update(self, new_tokens, n_accepted):
        self.pos += len(new_tokens[0])

    def select(self, rows):
        pass

    def propose(self, gamma):
        ref, p = self.reference, self.pos
        a = min(self.pattern[self.k % len(self.pattern)], gamma)
        self.k += 1
        toks = ref[p:p + a] + [(ref[p + a] + 1) % self.vocab] * (gamma - a)
        return Proposal(torch.tensor([toks], device=self.device), torch.tensor([gamma], device=self.device))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_folder(root / "target", seed=0, context=128)
    draft = save_tiny_folder(root / "draft", seed=0, context=128)  # same weights: every draft accepted
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for c in ("alpha", "beta"):
            for i in range(3):
                words = " ".join(f"w{(5 * i + 3 * j + (c == 'beta')) % 90 + 2}" for j in range(10))
                f.write(json.dumps({"category": c, "prompt": words}) + "\n")
    return {"target": str(target), "draft": str(draft), "prompts": str(prompts), "root": root}


def test_records_from_the_real_engine_match_the_known_pattern(tiny):
    runner = MethodRunner(tiny["target"], [], device="cpu")
    prompts = read_prompts(tiny["prompts"])[:2]
    n, gamma, patterns = 20, 3, {0: [3, 0, 1], 1: [2, 1]}
    recs = []
    for p in prompts:
        ids = runner.encode(p)
        recs.append(runner.run(methods_for([])[0], Setting(None, 0.0, 1), [p], [ids], n, seed=0))
        reference = recs[-1]["rows"][0]["token_ids"]
        assert len(reference) == n, "pick a prompt whose greedy output does not hit EOS"
        runner.generators["scripted"] = Generator(runner.target, ScriptedDrafter(reference, patterns[p.id], 96))
        recs.append(runner.run(Method("speculant scripted", "speculant", "scripted"), Setting(gamma, 0.0, 1),
                               [p], [ids], n, seed=0))
    want = [fake_speculant_stats(patterns[p.id], gamma, n) for p in prompts]
    got = [r["rows"][0] for r in recs if r["method"] == "speculant scripted"]
    for w, g in zip(want, got):
        assert (g["target_forward_passes"], g["draft_tokens"], g["accepted_draft_tokens"]) == (
            w["target_forward_passes"], w["draft_tokens"], w["accepted_draft_tokens"])
        assert g["acceptance_by_position"] == pytest.approx(w["acceptance_by_position"], abs=1e-4)
    s = find(summarize(recs), method="speculant scripted", category=ALL)[0]
    assert s["acceptance_rate"] == pytest.approx(sum(w["accepted_draft_tokens"] for w in want) /
                                                 sum(w["draft_tokens"] for w in want))
    assert s["mean_accepted_tokens"] == pytest.approx(2 * n / sum(w["target_forward_passes"] for w in want))
    assert s["identical"] == "yes"
    hf = find(summarize(recs), method=HF_GENERATE, category=ALL)[0]
    assert hf["mean_accepted_tokens"] == 1.0  # forward passes counted by hook: one per token


def test_peak_memory_sees_what_a_block_allocates():
    import os

    from speculant.bench.methods import PeakMemory

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux /proc/self/clear_refs")
    with PeakMemory(torch.device("cpu")) as small:
        pass
    with PeakMemory(torch.device("cpu")) as big:
        x = torch.ones(16 * 2**20)  # 64 MiB, freed before the block ends
        del x
    assert big.kind == "process_peak_rss" and big.above_start >= 48 * 2**20 > small.above_start


# ---------------------------------------------------------------- plan

def test_plan_runs_only_what_each_sweep_needs():
    cfg = BenchConfig(drafters=["ngram"], gammas=[1, 2, "auto"], temperatures=[0.0, 0.7], batch_sizes=[1, 4])
    pairs = {(m.name, s.gamma, s.temperature, s.batch_size) for m, s in plan(cfg)}
    assert ("hf assisted ngram", "auto", 0.0, 1) in pairs
    assert not any(n.startswith("hf assisted") and (b > 1 or g != "auto" or t != 0.0) for n, g, t, b in pairs)
    assert {g for n, g, t, b in pairs if n == "speculant ngram" and t == 0.0 and b == 1} == {1, 2, "auto"}
    assert {g for n, g, t, b in pairs if n in (HF_GENERATE, SPECULANT_NONE)} == {None}
    assert (HF_GENERATE, None, 0.7, 1) in pairs and (SPECULANT_NONE, None, 0.0, 4) in pairs
    assert ("speculant ngram", 1, 0.7, 1) not in pairs  # sweeps are one axis at a time
    only_sampling = {(m.name, s.temperature) for m, s in plan(BenchConfig(temperatures=[0.7]))}
    assert (HF_GENERATE, 0.0) in only_sampling  # the greedy reference for output equality is always run
    p = [BenchPrompt(i, "c", "x") for i in range(5)]
    assert [[q.id for q in b] for b in batches(p, 4)] == [[0, 1, 2, 3], [4, 0, 1, 2]]


# ---------------------------------------------------------------- end to end

def test_quick_run_writes_every_output_file(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--quick", "--target", tiny["target"], "--prompts", tiny["prompts"],
                 "--drafters", f"ngram,model:{tiny['draft']}", "--gamma", "2,auto", "--temperature", "0,1.0",
                 "--batch-size", "1,2", "--max-new-tokens", "6", "--device", "cpu", "--out", str(out),
                 "--no-progress"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads((out / "results.json").read_text())
    assert {"machine", "settings", "summary", "records", "mismatches"} <= set(data)
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["cpu"]
    ran = data["ran"]  # what each speculant method ran, as its Generator built it
    assert set(ran) == {SPECULANT_NONE, "speculant ngram", f"speculant model:{tiny['draft']}"}
    assert ran["speculant ngram"]["drafter"] == "ngram" and ran[SPECULANT_NONE]["dtype"] == "float32"
    assert len(data["prompts"]) == 4  # --quick: 2 prompts per category
    methods = {r["method"] for r in data["records"]}
    assert methods == {HF_GENERATE, SPECULANT_NONE, "hf assisted ngram", "speculant ngram",
                       f"hf assisted model:{tiny['draft']}", f"speculant model:{tiny['draft']}"}
    # greedy speculant output equals HF generate's, prompt by prompt (the draft has the target's weights)
    assert not [m for m in data["mismatches"] if m["method"].startswith("speculant")], data["mismatches"]
    # a fixed γ: under "auto" a drafter as costly as the target (the same weights) rightly drafts little
    model_row = find(data["summary"], method=f"speculant model:{tiny['draft']}", category=ALL,
                     temperature=0.0, batch_size=1, gamma=2)[0]
    assert model_row["acceptance_rate"] == 1.0 and model_row["identical"] == "yes"
    for name in ("summary.csv", "records.csv"):
        with open(out / name) as f:
            assert len(list(csv.DictReader(f))) > 0
    md = (out / "results.md").read_text()
    assert "| method | alpha | beta | all |" in md and "Speedup vs γ" in md and md in stdout
    vs_none = md.split("against `speculant none`")[1]  # the second table: what speculation itself gains
    assert "| speculant none | 1.00× · τ 1.00 | 1.00× · τ 1.00 | 1.00× · τ 1.00 |" in vs_none, vs_none
    ngram_all = find(data["summary"], method="speculant ngram", category=ALL, temperature=0.0, batch_size=1,
                     gamma=data["settings"]["primary"]["gamma"])[0]["speedup_vs_speculant_none"]
    row = next(line for line in vs_none.splitlines() if line.startswith("| speculant ngram | "))
    assert row.split(" | ")[-1].startswith(f"{ngram_all:.2f}× · τ"), row  # its overall cell
    import matplotlib.image

    for png in ("speedup_by_category", "acceptance_by_position", "speedup_vs_gamma", "speedup_vs_batch_size",
                "speedup_vs_temperature"):
        assert matplotlib.image.imread(out / f"{png}.png").ndim == 3


def test_cli_errors_exit_2_with_one_line(tiny, tmp_path, capsys):
    bad = write(tmp_path / "bad.jsonl", '{"prompt": "w2", "category": "a"}\n{oops\n')
    assert main(["bench", "--prompts", str(bad), "--target", tiny["target"]]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "--prompts", tiny["prompts"], "--categories", "gamma", "--target", tiny["target"]]) == 2
    assert "unknown category gamma" in capsys.readouterr().err
    assert main(["bench", "--prompts", tiny["prompts"], "--drafters", "hawk", "--target", tiny["target"]]) == 2
    assert "unknown drafter" in capsys.readouterr().err
    assert main(["bench", "--prompts", tiny["prompts"], "--drafters", "eagle", "--target", tiny["target"]]) == 2
    assert "no eagle drafter ships for" in capsys.readouterr().err


def test_drafter_list_keeps_cascade_specs_whole():
    from speculant.bench.cli import _drafter_list

    assert _drafter_list("ngram,cascade:ngram,layerskip,model:x") == ["ngram", "cascade:ngram,layerskip", "model:x"]
    assert _drafter_list("cascade:model:a,model:b") == ["cascade:model:a,model:b"]


def test_serve_load_runs_warm_waves_then_both_modes_and_refuses_bad_options(tmp_path, capsys):
    from speculant.bench import serve_load

    folder = save_tiny_folder(tmp_path / "tiny", context=128)  # no chat template: raw completions
    out = tmp_path / "load"
    assert serve_load.main(["--target", str(folder), "--drafter", "ngram", "--concurrency", "1,4", "--requests", "4",
                            "--batch1-requests", "2", "--max-tokens", "6", "--warmup-waves", "1", "--port", "0",
                            "--out", str(out)]) == 0
    result = json.loads((out / "serve_load.json").read_text())
    assert result["warmup_waves"] == 1 and result["endpoint"] == "completions"
    assert result["ran"]["drafter"] == "ngram" and result["machine"]["cpu_class"]
    assert [(r["concurrency"], r["speculate"]) for r in result["rows"]] == [(1, False), (1, True), (4, False), (4, True)]
    assert all(r["failures"] == 0 and r["generated_tokens"] > 0 for r in result["rows"])
    assert serve_load.main(["--warmup-waves", "-1"]) == 2
    assert "--warmup-waves >= 0" in capsys.readouterr().err


# ---------------------------------------------------------------- peer runtimes (bench/peers.py)

def test_peers_join_the_greedy_primary_run_and_are_compared_for_information():
    cfg = BenchConfig(drafters=["ngram"], peers=["llama.cpp", "openvino"])
    names = [m.name for m, s in plan(cfg)]
    assert {"llama.cpp", "llama.cpp prompt lookup", "openvino", "openvino prompt lookup"} <= set(names)
    assert all(s.batch_size == 1 and s.temperature == 0 for m, s in plan(cfg) if m.kind == "peer")
    sampled = BenchConfig(drafters=["ngram"], temperatures=[0.7], peers=["openvino"])
    assert not [m for m, _ in plan(sampled) if m.kind == "peer"]  # peers run greedy only
    hf = [5, 6, 7, 8]
    recs = [record(HF_GENERATE, [row(0, "x", hf), row(1, "y", hf)], 1.0),
            record("llama.cpp", [row(0, "x", [5, 6, 9]), row(1, "y", hf)], 0.5, kind="peer")]
    summary = summarize(recs)
    assert find(summary, method="llama.cpp", category=ALL)[0]["identical"] == "1 of 2 as HF (another runtime)"
    assert mismatches(recs) == []  # another runtime's rounding is not a speculation mismatch


def test_peers_need_a_gguf_target_and_an_installed_runtime(tiny, capsys, monkeypatch):
    with pytest.raises(SpeculantError, match="other runtimes on the target's .gguf"):
        MethodRunner(tiny["target"], [], "cpu", peers=["openvino"])
    from speculant.bench import peers

    monkeypatch.setattr(peers, "installed", lambda: [])
    assert main(["bench", "--target", tiny["target"], "--peers", "llama.cpp", "--quick"]) == 2
    assert "'llama.cpp' is not installed" in capsys.readouterr().err
    assert main(["bench", "--target", tiny["target"], "--peers", "vllm", "--quick"]) == 2
    assert "unknown peer 'vllm'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not __import__("speculant.bench.peers", fromlist=["x"]).installed(),
                    reason="no peer runtime installed (llama-cpp-python or openvino-genai)")
def test_installed_peers_generate_from_our_token_ids():
    from speculant.bench import peers
    from speculant.models.loading import default_model_path, load_model

    target = load_model("default", device="cpu")
    ids = Generator(target, make_drafter("none", target)).encode("Write a haiku about rivers")
    for name in peers.method_names(peers.installed()):  # llama.cpp's speculation: the target its own draft model
        out = peers.load(name, default_model_path(), 512, default_model_path(), target.tokenizer).generate(
            ids, 12, target.eos_token_ids)
        assert 0 < len(out) <= 12 and all(isinstance(t, int) for t in out), name


def test_repeats_count_by_each_calls_median_so_one_pause_does_not_move_a_category():
    out = list(range(10))

    def rep(method, pid, seconds, repeat):
        return {**record(method, [row(pid, "x", out)], seconds), "repeat": repeat}

    recs = [rep(HF_GENERATE, 0, 2.0, 0), rep(SPECULANT_NONE, 0, 1.0, 0)]
    # prompt 0: a 3x pause in one of three repeats; prompt 1: two repeats (the faster middle one counts)
    recs += [rep("speculant fake", 0, s, r) for r, s in enumerate([3.0, 0.5, 0.6])]
    recs += [rep("speculant fake", 1, s, r) for r, s in enumerate([0.9, 0.7])]
    s = find(summarize(recs), method="speculant fake", category=ALL)[0]
    assert s["tokens_per_second"] == pytest.approx(20 / (0.6 + 0.7))
    assert s["new_tokens"] == 50 and s["calls"] == 5
    assert s["tokens_per_second_by_repeat"] == pytest.approx([20 / 3.9, 20 / 1.2, 10 / 0.6])
