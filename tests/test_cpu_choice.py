"""dtype "auto" on a CPU (tools/cpu_choice.py): measured once per machine and model, cached, reported."""
import json
import time

import pytest

import speculant
from speculant.cli import main
from speculant.tools import cpu_choice
from helpers import hf_greedy, save_tiny_folder


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    return str(save_tiny_folder(tmp_path / "model", seed=3))


def test_measured_once_then_cached(folder, monkeypatch, capsys):
    choice = cpu_choice.choose(folder)
    assert choice.dtype in cpu_choice.CANDIDATES and not choice.cached
    assert set(choice.ms_per_token) == {"float32", "bfloat16"} and min(choice.ms_per_token.values()) > 0  # a folder: no GGUF
    assert choice.dtype == cpu_choice.pick(choice.ms_per_token)
    assert choice.path == "fast"  # a Llama: the fast path
    assert "measuring which dtype" in capsys.readouterr().err

    def no_measuring(spec, drafter="none", rounds=2, log=None):
        raise AssertionError("measured again: the cache was not used")

    monkeypatch.setattr(cpu_choice, "measure", no_measuring)
    again = cpu_choice.choose(folder)
    assert again.cached and (again.dtype, again.path) == (choice.dtype, choice.path)
    assert "cached" in again.describe()
    # another machine (CPU, ISA, torch, threads or kernel choice) measures anew
    monkeypatch.setattr(cpu_choice, "machine_key", lambda: "another CPU")
    with pytest.raises(AssertionError, match="measured again"):
        cpu_choice.choose(folder)


def test_bfloat16_is_chosen_only_by_a_clear_margin():
    # a near-draw (here measured beside another busy process) keeps float32, HF's exact twin
    assert cpu_choice.pick({"float32": 1037.1, "bfloat16": 1030.5}) == "float32"
    assert cpu_choice.pick({"float32": 100.0, "bfloat16": 89.0}) == "bfloat16"
    assert cpu_choice.pick({"float32": 64.4, "bfloat16": 117.5}) == "float32"
    # quantized weights: the fastest of the rivals, by the same margin
    assert cpu_choice.pick({"float32": 100.0, "bfloat16": 89.0, "quantized": 60.0}) == "quantized"
    assert cpu_choice.pick({"float32": 100.0, "bfloat16": 70.0, "quantized": 80.0}) == "bfloat16"
    assert cpu_choice.pick({"float32": 100.0, "bfloat16": 95.0, "quantized": 93.0}) == "float32"


def test_int8_activations_are_chosen_only_by_a_clear_margin_over_quantized():
    # each dtype must beat every more faithful one by 10%: float32, quantized, bfloat16, q8
    assert cpu_choice.pick({"float32": 60.0, "quantized": 10.0, "bfloat16": 50.0, "q8": 9.5}) == "quantized"
    assert cpu_choice.pick({"float32": 60.0, "quantized": 10.0, "bfloat16": 50.0, "q8": 8.5}) == "q8"
    assert cpu_choice.pick({"q8": 8.5}) == "q8"  # whatever alone was measured
    assert cpu_choice.pick({}) == "float32"


def test_measuring_stops_at_its_bound_and_says_so(folder, capsys):
    import sys

    choice = cpu_choice.measure(folder, "none", log=lambda msg: print(msg, file=sys.stderr), bound_s=0.0)
    err = capsys.readouterr().err
    assert list(choice.ms_per_token) == ["float32"]  # the first candidate, from its warm-up request
    assert "at most ~0 s" in err and "bfloat16 not measured" in err and "its warm-up" in err
    assert choice.dtype == "float32"


def test_a_models_first_request_is_not_timed_as_its_tokens(folder, monkeypatch):
    """A first request's one-time work (the general path's width checks: ~40 s for Gemma 3 270M's
    262k-token LM head) made a dtype look 11.9 s a token and used up the bound before bfloat16 was
    reached: each candidate's first token is now asked for untimed, before its warm-up."""
    seen, request = set(), cpu_choice._request

    def slow_first(gen, prompt, new_tokens):
        if id(gen) not in seen:
            seen.add(id(gen))
            time.sleep(0.5)
        return request(gen, prompt, new_tokens)

    monkeypatch.setattr(cpu_choice, "_request", slow_first)
    choice = cpu_choice.measure(folder, "none", bound_s=0.0)  # the warm-up's rate is what is kept
    assert list(choice.ms_per_token) == ["float32"] and choice.ms_per_token["float32"] < 0.5e3 / 8
    assert "(the only dtype measured; measured now)" in choice.describe()


def test_load_with_auto_dtype_reports_the_choice_and_stays_exact(folder):
    gen = speculant.load(folder, drafter="ngram", gamma=3, device="cpu")
    choice = cpu_choice.choose(folder, "ngram")
    assert choice.cached  # load measured with the drafter it runs
    assert str(gen.target.model.dtype) == f"torch.{choice.dtype}"
    ids = gen.tokenizer("w5 w6 w7 w5 w6 w7 w5 w6")["input_ids"]
    out = gen.generate_ids([ids], max_new_tokens=16)[0]
    assert out.stats["dtype"] == choice.dtype and out.stats["dtype_choice"].startswith("auto: ")
    assert out.stats["path"] == "fast" and "cpu_kernels" in out.stats
    if choice.dtype == "float32":
        assert out.token_ids == hf_greedy(gen.target.model, ids, 16)[: len(out.token_ids)]


def test_cli_dtype_auto_and_a_bad_dtype(folder, capsys):
    assert main(["generate", "w5 w6 w7", "--target", folder, "--max-new-tokens", "4", "--json", "--dtype", "auto"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stats"]["dtype_choice"].startswith("auto: ")
    assert main(["generate", "w5 w6 w7", "--target", folder, "--dtype", "float64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown dtype 'float64'" in err


def test_measured_with_the_drafter_that_will_run_and_a_bad_one_fails_in_one_line(folder, capsys):
    first = cpu_choice.choose(folder, "ngram")
    assert not first.cached and "drafter ngram" in capsys.readouterr().err
    assert cpu_choice.choose(folder, "ngram").cached
    assert not cpu_choice.choose(folder, "none").cached  # another drafter: measured anew
    capsys.readouterr()
    # a drafter that cannot be built fails before any measuring, with its own one line
    assert main(["generate", "w5 w6 w7", "--target", folder, "--drafter", "layerskip:1-5:2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layers to skip" in err
