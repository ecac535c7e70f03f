"""scripts/gpu_eagle.py (how the shipped EAGLE head was trained further on a GPU: a command over
speculant.tools.texts and speculant.tools.train_batched) on a CPU and a tiny target: the batched,
left-padded self-distillation writes the target's own greedy answers, the text files round-trip,
and train + join give a folder that loads as a drafter and keeps the target's greedy output."""
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculant
from speculant.drafters.eagle import load_eagle
from speculant.tools.texts import load_texts, save_texts
from helpers import greedy_texts, hf_greedy, save_tiny_folder
from test_eagle import _random_eagle_folder

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_eagle.py"


def _run(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["gpu_eagle.py", *map(str, args)])
    runpy.run_path(str(SCRIPT), run_name="__main__")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_folder(tmp_path_factory.mktemp("gpu-eagle") / "target", seed=0)
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval()


def test_texts_round_trip_whole_and_packed_in_parts(tmp_path):
    g = torch.Generator().manual_seed(0)
    texts = [(torch.randint(0, 49152, (n,), generator=g).to(torch.int32).to(torch.uint16), n // 3)
             for n in (5, 40, 17, 60, 9)]
    save_texts(texts, tmp_path / "t.pt", tmp_path / "parts", part_tokens=64)
    parts = sorted((tmp_path / "parts").glob("t-*.pt"))
    assert len(parts) == 3  # 5+40+17 | 60 | 9 (each part under 64 tokens, unless one text is longer)
    for got in (load_texts(tmp_path / "t.pt"), [x for p in parts for x in load_texts(p)]):
        assert [(x.long().tolist(), lf) for x, lf in got] == [(x.long().tolist(), lf) for x, lf in texts]


def test_distill_writes_the_targets_greedy_answers(tmp_path, monkeypatch, tiny):
    folder, model = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 96, (n,), generator=g).to(torch.int32).to(torch.uint16) for n in (3, 9, 6, 12, 4)]
    torch.save({"A": prompts[:3], "B": prompts[3:]}, tmp_path / "p.pt")
    _run(monkeypatch, "distill", "--target", folder, "--device", "cpu", "--dtype", "float32", "--prompts",
         tmp_path / "p.pt", "--groups", "A,B", "--batch", 2, "--answer-tokens", 10, "--out", tmp_path / "d.pt")
    texts = load_texts(tmp_path / "d.pt")
    assert len(texts) == 5
    by_prompt = {tuple(x[:lf].long().tolist()): x[lf:].long().tolist() for x, lf in texts}
    for p in prompts:
        ref = hf_greedy(model, p.long().tolist(), 10)
        ref = ref[: ref.index(1) + 1] if 1 in ref else ref  # up to the end of text (id 1), kept
        assert by_prompt[tuple(p.long().tolist())] == ref


def test_train_and_join_give_a_drafter_that_keeps_greedy_output(tmp_path, monkeypatch, tiny):
    folder, model = tiny
    config = _random_eagle_folder(tmp_path, model, draft_vocab=48, name="start")
    texts = greedy_texts(model, 12, 20)
    save_texts(texts, tmp_path / "texts.pt")
    out = tmp_path / "trained"
    _run(monkeypatch, "train", "--target", folder, "--device", "cpu", "--dtype", "float32", "--data",
         tmp_path / "texts.pt", "--config", config, "--init", config, "--out", out, "--steps", 6, "--batch", 4,
         "--held-out", 2, "--eval-every", 3, "--lr", 3e-3, "--warmup", 2)
    log = json.loads((out / "gpu_training.json").read_text())
    assert log["steps"] == 6 and len(log["loss_curve"]) == 6 and [e["step"] for e in log["evals"]] == [3, 6]
    assert all(x == x and x < 100 for x in log["loss_curve"])  # finite
    _run(monkeypatch, "join", "--out", out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "gpu_training.json", "model.safetensors"]
    prompts = [t[0][: t[1]].long().tolist() for t in texts[:3]]
    outs = speculant.generate(model, prompts, drafter=load_eagle(out, model, "tiny"), gamma=4, max_new_tokens=20)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(model, p, 20)


def _with_chat_template(folder):
    """The tiny target's folder with a chat template: w2 opens a user turn, </s> ends it, w3 opens
    the answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = ("{% for m in messages %}w2 {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}w3 {% endif %}")
    tok.save_pretrained(folder)
    return folder


def test_self_instruct_writes_whole_user_turns_the_target_sampled(tmp_path, monkeypatch):
    folder = _with_chat_template(save_tiny_folder(tmp_path / "chat", seed=3))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    _run(monkeypatch, "self-instruct", "--target", folder, "--device", "cpu", "--dtype", "float32", "--count", 12,
         "--batch", 16, "--query-tokens", 40, "--min-chars", 1, "--out", tmp_path / "m.pt")
    prompts = [p.long().tolist() for p in torch.load(tmp_path / "m.pt")["M"]]
    assert 0 < len(prompts) <= 12 and len({tuple(p) for p in prompts}) == len(prompts)
    for p in prompts:  # w2 <user words, no end of turn> </s> w3: ready for `distill`
        assert p[0] == 2 and p[-2:] == [1, 3] and 1 not in p[1:-2] and len(p) - 3 <= 40
    # the words are the target's: sampling from the opening w2 with the same seed writes the first
    torch.manual_seed(0)
    first = model.generate(torch.tensor([[2]]).expand(16, -1), attention_mask=torch.ones(16, 1, dtype=torch.long),
                           do_sample=True, temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=40,
                           eos_token_id=[1], pad_token_id=1)[:, 1:].tolist()
    whole = [r[: r.index(1)] for r in first if 1 in r and r.index(1) > 0]
    assert prompts[0][1:-2] == whole[0]


def test_self_instruct_refuses_a_target_without_a_chat_template(tmp_path, monkeypatch, capsys, tiny):
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, "self-instruct", "--target", tiny[0], "--device", "cpu", "--dtype", "float32",
             "--out", tmp_path / "m.pt")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("gpu_eagle.py self-instruct: self-instruct needs a chat template")
    assert "\n" not in err and not (tmp_path / "m.pt").exists()


def test_minutes_cut_the_schedule_to_what_fits():
    """--minutes (the script's, not the package's): steps 15 to 45 timed, the total cut to the steps
    that fit the time left, and never raised."""
    script = runpy.run_path(str(SCRIPT))
    ticks = []
    clock = type("Clock", (), {"time": staticmethod(lambda: ticks.pop(0))})
    script["fit_minutes"].__globals__["time"] = clock  # the script's own module: its clock alone

    def schedule(minutes, total, started, clock):
        ticks[:] = clock
        run = type("Run", (), {"step": 0, "total": total, "started": started})()
        on_step = script["fit_minutes"](minutes, log=lambda *a, **k: None)
        for run.step in range(1, 46):
            on_step(run)
        return run.total

    # step 15 at 100 s, step 45 at 130 s (1 s a step), 40 s of 60 gone: 20 more steps
    assert schedule(1, 1000, 90.0, [100.0, 130.0, 130.0]) == 45 + 20
    assert schedule(10, 50, 0.0, [0.0, 3.0, 3.0]) == 50


class _CharTokenizer:
    """A chat tokenizer of one id per character (no model needed)."""
    chat_template = "user: {content}"

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True):
        return [ord(c) % 60000 for c in "user: " + msgs[-1]["content"] + "\nassistant: "]


def test_task_prompts_build_task_shapes_from_sharegpt_text(monkeypatch):
    from speculant.tools import texts
    para = ("The river floods every spring after the snow melts. Farmers plant late so that the young crops are "
            "not washed away. The soil the water leaves behind is rich, and the harvest in autumn is large.")
    code = "def area(w, h):\n    total = w * h\n    return total"
    reply = f"{para}\n\n{para.replace('river', 'lake')}\n\n```python\n{code}\n```\n\n- a list item."
    convs = [[{"role": "user", "content": "Why does the river flood in spring?"},
              {"role": "assistant", "content": reply}],
             [{"role": "user", "content": "Write a Python function that adds two numbers."},
              {"role": "assistant", "content": "Sure."}],
             [{"role": "user", "content": "日本語で答えてください?"}, {"role": "assistant", "content": "はい。"}]]
    monkeypatch.setattr(texts, "sharegpt_conversations", lambda: iter(convs))
    tok = _CharTokenizer()
    sizes = {"T": 3, "Q": 5, "M": 4, "W": 5, "K": 2, "R": 2, "S": 2}
    groups = texts.task_prompts(tok, sizes=sizes, max_tokens=600)
    decode = lambda ids: "".join(map(chr, ids.long().tolist()))
    got = {k: [decode(x) for x in v] for k, v in groups.items()}
    assert list(got) == list(sizes) and all(len(got[k]) <= sizes[k] for k in sizes)
    assert all(len(x) <= 600 and x.dtype == torch.uint16 for v in groups.values() for x in v)
    assert got["Q"] == ["user: Why does the river flood in spring?\nassistant: "]  # English questions only
    assert got["W"] == ["user: Write a Python function that adds two numbers.\nassistant: "]
    assert len(got["M"]) == 4 and all(any(c.isdigit() for c in p) for p in got["M"])
    assert got["T"] and all(any(w in p for w in ("French", "German", "Spanish", "Italian", "Portuguese"))
                            and any(s.rstrip(".") in p for s in para.split(". ")) for p in got["T"])
    assert got["K"] and all(code in p for p in got["K"])
    assert got["S"] and all("Farmers plant late" in p for p in got["S"] + got["R"])
    assert not any("list item" in p for v in got.values() for p in v)  # lists are not prose
    again = texts.task_prompts(tok, sizes=sizes, max_tokens=600)
    assert {k: [x.tolist() for x in v] for k, v in again.items()} == {k: [x.tolist() for x in v] for k, v in groups.items()}
    assert texts.task_prompts(tok, skip=3, sizes=sizes)["T"] == []
