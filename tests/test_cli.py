"""The CLI and the API on model folders: bad input is one clear line and exit code 2, never a traceback."""
import json
import subprocess
import sys

import pytest
import torch

import speculant
from speculant.cli import main
from helpers import hf_greedy, save_tiny_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": str(save_tiny_folder(root / "target", seed=0, context=64)),
        "draft": str(save_tiny_folder(root / "draft", seed=1, context=64)),
        "other_vocab": str(save_tiny_folder(root / "other", vocab=120, seed=2)),
        "root": root,
    }


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


PROMPT = "w5 w6 w7 w5 w6 w7 w5 w6"


def test_json_output_from_a_model_folder(folders, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--drafter", f"model:{folders['draft']}",
                              "--gamma", "3", "--max-new-tokens", "12", "--json"], capsys)
    assert code == 0, err
    obj = json.loads(out)
    assert set(obj) >= {"text", "prompt_token_ids", "token_ids", "stats"}
    assert set(obj["stats"]) >= {"acceptance_rate", "mean_accepted_tokens", "target_forward_passes",
                                 "tokens_per_second", "drafter", "gamma"}
    assert obj["stats"]["gamma"] == 3 and obj["stats"]["drafter"].startswith("model:")
    # the folder has no chat template: the prompt is the raw text's tokens
    gen = speculant.load(folders["target"], drafter="none")
    assert obj["prompt_token_ids"] == gen.tokenizer(PROMPT)["input_ids"]
    ref = hf_greedy(gen.target.model, obj["prompt_token_ids"], 12)
    assert obj["token_ids"] == ref[: len(obj["token_ids"])] and (len(obj["token_ids"]) == 12 or ref[len(obj["token_ids"]) - 1] == 1)


def test_gamma_auto_logprobs_and_penalties_in_json(folders, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--drafter", "ngram", "--gamma", "auto",
                              "--max-new-tokens", "12", "--json", "--logprobs", "2", "--frequency-penalty", "0.5",
                              "--presence-penalty", "0.2", "--logit-bias", "5:1.5"], capsys)
    assert code == 0, err
    obj = json.loads(out)
    assert obj["stats"]["gamma"] == "auto" and "mean_gamma" in obj["stats"]
    assert [e["token"] for e in obj["logprobs"]] == obj["token_ids"]
    assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in obj["logprobs"])


def test_streaming_prints_text_and_a_stats_line(folders, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--drafter", "ngram",
                              "--max-new-tokens", "10"], capsys)
    assert code == 0
    assert out.strip() and out.strip().split()[0].startswith("w")
    assert "α=" in err and "τ=" in err and "tok/s" in err


BAD = [
    (["--target", "/no/such/model"], "does not exist"),
    (["--gamma", "0"], "gamma"),
    (["--gamma", "-3"], "gamma"),
    (["--temperature", "-0.5"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--drafter", "bogus"], "unknown drafter"),
    (["--drafter", "model:/no/such/draft"], "does not exist"),
    (["--presence-penalty", "nan"], "presence penalty"),
    (["--logit-bias", "99999:1", "--drafter", "ngram"], "outside the vocabulary"),
    (["--logprobs", "3"], "--json"),
    (["--logprobs", "-1", "--json"], "logprobs"),
    (["--logprobs", "1000000", "--json"], "0..20"),
    (["--gamma", "1000000"], "1..64"),
    (["--json-schema", "/no/such/schema.json"], "schema"),
    (["--show-acceptance", "--json"], "--show-acceptance"),
]


@pytest.mark.parametrize("extra,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line_and_exit_2(folders, capsys, extra, words):
    args = ["generate", PROMPT, "--target", folders["target"], *extra]
    if "--target" in extra:
        args = ["generate", PROMPT, *extra]
    code, out, err = run_cli(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculant: error:") and words in lines[0], err


def test_a_schema_the_enforcer_cannot_follow_is_one_line(folders, capsys, tmp_path):
    pytest.importorskip("lmformatenforcer")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "objectx"}')
    code, _, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--json-schema", str(schema)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "unusable JSON schema" in err, err


def test_argument_errors_and_a_busy_port_are_one_line(folders, capsys):
    import socket

    code, _, err = run_cli(["generate", PROMPT, "--gamma", "abc"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "gamma" in err and "usage" not in err, err
    with socket.create_server(("127.0.0.1", 0)) as busy:  # refused before the model loads
        port = busy.getsockname()[1]
        code, _, err = run_cli(["serve", "--target", folders["target"], "--port", str(port)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err


def test_not_a_model_file(folders, capsys, tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" * 10)
    for path in (junk, fake, folders["root"]):
        code, _, err = run_cli(["generate", PROMPT, "--target", str(path)], capsys)
        assert code == 2 and "not a" in err and len(err.strip().splitlines()) == 1, err


def test_drafter_with_another_vocabulary_drafts_through_text(folders, capsys):
    """A 120-token drafter for a 96-token target: converted through text, output = the target alone."""
    args = ["generate", PROMPT, "--target", folders["target"], "--max-new-tokens", "12", "--json", "--gamma", "3"]
    code, out, err = run_cli(args + ["--drafter", f"model:{folders['other_vocab']}"], capsys)
    assert code == 0, err
    obj = json.loads(out)
    assert "via text" in obj["stats"]["drafter"]
    code, ref, err = run_cli(args + ["--drafter", "none"], capsys)
    assert code == 0, err
    assert obj["token_ids"] == json.loads(ref)["token_ids"]


def test_cascade_level_with_another_vocabulary_names_both_sizes(folders, capsys):
    code, _, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--drafter",
                            f"cascade:ngram,model:{folders['other_vocab']}"], capsys)
    assert code == 2 and "120" in err and "96" in err and len(err.strip().splitlines()) == 1, err


def test_new_drafter_specs_from_the_cli(folders, capsys):
    args = ["generate", PROMPT, "--target", folders["target"], "--max-new-tokens", "10", "--json", "--gamma", "3"]
    ref = json.loads(run_cli(args + ["--drafter", "none"], capsys)[1])["token_ids"]
    for spec in (f"cascade:ngram,model:{folders['draft']}", f"cascade:model:{folders['draft']},model:{folders['draft']}"):
        code, out, err = run_cli(args + ["--drafter", spec], capsys)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == ref
    for bad in ("cascade:ngram", "cascade:none,model:x", "layerskip:zz", "layerskip:1-5:2", "layerskip:5-3:1",
                "layerskip:2-4:0"):
        code, _, err = run_cli(args + ["--drafter", bad], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, (bad, err)


def test_empty_prompt_and_prompt_longer_than_context(folders, capsys):
    code, _, err = run_cli(["generate", "   ", "--target", folders["target"]], capsys)
    assert code == 2 and "empty" in err
    long_prompt = " ".join(f"w{i % 90 + 2}" for i in range(80))
    code, _, err = run_cli(["generate", long_prompt, "--target", folders["target"]], capsys)
    assert code == 2 and "64" in err and "80" in err, err  # says the limit and the length


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu(folders, capsys):
    code, _, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--device", "cuda"], capsys)
    assert code == 2 and "no CUDA GPU" in err


def test_ctrl_c_while_streaming_keeps_what_was_printed(folders, capsys, monkeypatch):
    real_stream = speculant.Generator.stream

    def interrupted(self, *a, **k):
        for i, piece in enumerate(real_stream(self, *a, **k)):
            if i == 3:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(speculant.Generator, "stream", interrupted)
    code, out, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--drafter", "none",
                              "--max-new-tokens", "20"], capsys)
    assert code == 130
    assert len(out.split()) == 3  # the three pieces printed before Ctrl-C are still there
    assert "interrupted" in err and "Traceback" not in err


def test_real_entry_point_has_no_traceback(folders):
    proc = subprocess.run([sys.executable, "-m", "speculant", "generate", PROMPT, "--target", folders["target"],
                           "--gamma", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_api_batch_and_stop_strings(folders):
    gen = speculant.load(folders["target"], drafter="ngram", gamma=3)
    outs = gen.generate([PROMPT, "w9 w10", "w3 w3 w3 w3"], max_new_tokens=12)
    assert len(outs) == 3
    for o in outs:
        ref = hf_greedy(gen.target.model, o.prompt_token_ids, 12)
        assert o.token_ids == ref[: len(o.token_ids)]
    first_word = outs[0].text.split()[1]
    cut = gen.generate(PROMPT, max_new_tokens=12, stop=[first_word])
    assert cut.finish_reason == "stop" and first_word not in cut.text


def test_show_acceptance_marks_drafted_tokens_and_keeps_the_text(folders, capsys, monkeypatch):
    gen = speculant.load(folders["target"], drafter="ngram", device="cpu", dtype="float32")
    pieces = list(gen.stream(PROMPT, max_new_tokens=30, chat_template=False, origins=True))
    plain = gen.generate(PROMPT, max_new_tokens=30, chat_template=False)
    assert "".join(p for p, _ in pieces) == plain.text
    drafted = sum(d for _, d in pieces)
    assert drafted == gen.last.stats["accepted_draft_tokens"] > 0  # this repetitive prompt gets drafts accepted
    assert not pieces[0][1]  # the first token comes from the prefill: the target's own
    code, out, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--max-new-tokens", "30",
                              "--no-chat-template", "--dtype", "float32", "--show-acceptance"], capsys)
    assert code == 0, err
    assert out.strip() == plain.text.strip() and "draft token accepted" not in err  # piped: no colours, no legend
    monkeypatch.setenv("FORCE_COLOR", "1")  # as on a terminal
    code, out, err = run_cli(["generate", PROMPT, "--target", folders["target"], "--max-new-tokens", "30",
                              "--no-chat-template", "--dtype", "float32", "--show-acceptance"], capsys)
    assert code == 0 and "draft token accepted" in err and "\x1b[" in out, err


def test_bench_refuses_an_unwritable_out_before_it_generates(folders, capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where a folder would have to be made
    code, _, err = run_cli(["bench", "--target", folders["target"], "--drafters", "none", "--quick",
                            "--out", str(blocker / "results")], capsys)
    assert code == 2 and "cannot write" in err and "--out" in err and len(err.strip().splitlines()) == 1, err


def test_serve_limits_must_be_positive(folders, capsys):
    for flag in ("--max-body-mib", "--max-request-memory"):
        code, _, err = run_cli(["serve", "--target", folders["target"], flag, "0"], capsys)
        assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err


def test_a_second_generate_starts_from_the_costs_the_first_kept(folders, capsys, monkeypatch, tmp_path):
    """γ auto's pass times and acceptance per grade outlive a `speculant generate`: the next run on
    the same machine, model, kernels and drafter starts from them (no wide blocks verified to time
    them again); a file it cannot read is ignored and written anew."""
    from speculant.tools import kept_costs

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    restored = []
    original = kept_costs.restore

    def spy(gen, target, drafter):
        ok = original(gen, target, drafter)
        restored.append((ok, dict(gen.engine.costs.verify.points)))
        return ok

    monkeypatch.setattr(kept_costs, "restore", spy)
    args = ["generate", PROMPT, "--target", folders["target"], "--drafter", "ngram", "--max-new-tokens", "12", "--json"]
    assert run_cli(args, capsys)[0] == 0
    kept = list((tmp_path / "costs").glob("*.json"))
    assert len(kept) == 1 and restored == [(False, {})]
    learnt = json.loads(kept[0].read_text())["times"]["verify"]["points"]
    assert len(learnt) >= 2  # a plain pass and wider ones were timed
    assert run_cli(args, capsys)[0] == 0
    assert restored[1][0] and len(restored[1][1]) == len(learnt)
    kept[0].write_text("{not json")
    assert run_cli(args, capsys)[0] == 0
    assert not restored[2][0] and json.loads(kept[0].read_text())["times"]["verify"]["points"]
    other = ["generate", PROMPT, "--target", folders["target"], "--drafter", "suffix", "--max-new-tokens", "4"]
    assert run_cli(other, capsys)[0] == 0
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2  # another drafter: costs of its own
