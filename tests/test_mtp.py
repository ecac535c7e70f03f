"""MTP drafters (issue 40): a model's own MTP layers read from its checkpoint in each layout models ship
(DeepSeek-V3 / GLM-4.5, MiMo, Qwen3-Next; sharded or not), a step written out as vLLM computes it,
several layers one step each, the caches after accepted and rejected drafts, speculators' converter
and folders both ways, greedy text equal to plain decoding's bit for bit and sampling that keeps the
target's distribution, ``speculant train --kind mtp``, export, and one-line refusals."""
import json

import pytest
import torch

import speculant
from speculant.drafters import make_drafter
from speculant.drafters.base import DraftContext
from speculant.drafters.mtp import MTPDrafter, load_mtp
from speculant.errors import SpeculantError
from speculant.models.loading import LoadedModel, load_model
from speculant.sampling import LogitsProcessing, SamplingParams
from speculant.trained.format import save_folder
from speculant.trained.mtp import MTPNet, _Joined, mtp_config, native_net
from helpers import hf_greedy, mismatch_report, save_tiny_folder, tiny_llama
from mtp_checkpoints import LAYOUT_OF, save_with_mtp
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts

ARCHS = ["deepseek_v3", "glm4_moe", "mimo", "qwen3_next"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, the model it was cut from) of each (arch, MTP layers, shards), built once."""
    made = {}

    def get(arch, mtp_layers=1, shards=1):
        key = (arch, mtp_layers, shards)
        if key not in made:
            made[key] = save_with_mtp(tmp_path_factory.mktemp(arch) / "model", arch, mtp_layers=mtp_layers,
                                      shards=shards)
        return made[key]
    return get


def _prompts(n=3):
    g = torch.Generator().manual_seed(5)
    out = [torch.randint(2, 96, (4 + 5 * i,), generator=g).tolist() for i in range(n)]
    out[0] = out[0] * 3
    return out


def _hidden(target, ids):
    with torch.no_grad():
        return target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _vllm_step(arch, big, t, hidden, embeds, positions, layer=0, N=2):
    """One MTP step as vLLM's deepseek_mtp / mimo_mtp / qwen3_next_mtp compute it, from the
    checkpoint's tensors ``t`` and the decoder block of the model the layers were cut from: (the
    state the next step reads, logits)."""
    eps = big.config.rms_norm_eps  # N: the target's own layers (the rest of ``big``'s are MTP blocks)
    layout, block = LAYOUT_OF[arch], big.model.layers[N + layer]
    if layout == "deepseek":
        p = f"model.layers.{N + layer}."
        embeds = embeds.masked_fill((positions == 0)[..., None], 0)
        x = torch.cat([_rms(embeds, t[p + "enorm.weight"], eps), _rms(hidden, t[p + "hnorm.weight"], eps)], -1)
        x = x @ t[p + "eh_proj.weight"].T
        final, head = t[p + "shared_head.norm.weight"], t[p + "shared_head.head.weight"]
    elif layout == "mimo":
        p = f"model.mtp_layers.{layer}."
        embeds = embeds.masked_fill((positions == 0)[..., None], 0)
        x = torch.cat([_rms(hidden, t[p + "hidden_layernorm.weight"], eps), _rms(embeds, t[p + "token_layernorm.weight"],
                                                                                   eps)], -1)
        x, final, head = x @ t[p + "input_proj.weight"].T, t[p + "final_layernorm.weight"], t["lm_head.weight"]
    else:
        x = torch.cat([_rms(embeds, t["mtp.pre_fc_norm_embedding.weight"], eps),
                       _rms(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
        x, final, head = x @ t["mtp.fc.weight"].T, t["mtp.norm.weight"], t["lm_head.weight"]
    T = x.shape[1]
    mask = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
    with torch.no_grad():
        out = block(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=big.model.rotary_emb(x, positions))
    out = out[0] if isinstance(out, tuple) else out
    normed = _rms(out, final, eps)
    return (out if layout == "deepseek" else normed), normed @ head.T


def _started(drafter, target, text):
    """A drafter started on ``text`` (as the engine starts it after its first pass): the prompt
    text[:-1], then the target's token text[-1]."""
    prompt = text[:-1]
    drafter.start(DraftContext([prompt], LogitsProcessing(SamplingParams()), None, torch.device("cpu"), 96,
                               max_tokens=256, prompt_hidden=[_hidden(target, prompt)[:, None]]))
    drafter.update([[text[-1]]], [0])
    return drafter


@pytest.mark.parametrize("arch", ARCHS)
def test_a_step_is_vllms_and_chained_steps_read_the_layouts_state(arch, checkpoint):
    """Step 0 over a text and a 3-token chain from its end, against vLLM's formulas written out from
    the checkpoint's own tensor names (DeepSeek/GLM: [enorm(emb), hnorm(h)], the un-normed state
    chained, position 0's embedding zeroed; MiMo: [hidden, embedding]; Qwen3-Next: shared fc)."""
    folder, big = checkpoint(arch, shards=2 if arch == "deepseek_v3" else 1)
    target = load_model(str(folder)).model
    t = _tensors(folder)
    text = _prompts()[1] + [7, 9]
    h = _hidden(target, text)
    emb = target.get_input_embeddings()
    with torch.no_grad():
        positions = torch.arange(len(text) - 1)[None]
        state, logits = _vllm_step(arch, big, t, h[None, :-1], emb(torch.tensor([text[1:]])), positions)
        drafts, chained = [int(logits[0, -1].argmax())], [state[:, -1:]]
        for _ in range(2):  # a chain: each step's own state and draft, one position on, over the same keys
            ids = torch.tensor([text[1:] + drafts])
            hid = torch.cat([h[None, :-1]] + chained, 1)
            state, logits = _vllm_step(arch, big, t, hid, emb(ids), torch.arange(ids.shape[1])[None])
            drafts.append(int(logits[0, -1].argmax()))
            chained.append(state[:, -1:])
    drafter = _started(MTPDrafter(native_net(target, folder), target), target, text)
    assert drafter.propose(3).tokens[0].tolist() == drafts
    with torch.no_grad():  # every position's state and logits, not only the argmax at the end
        mask = torch.ones(len(text) - 1, len(text) - 1, dtype=torch.bool).tril()[None, None]
        net = drafter.net
        got, normed = net.step(0, emb(torch.tensor([text[1:]])), h[None, :-1], positions, _Joined(lambda a, b: (a, b)),
                               mask)
        want, want_logits = _vllm_step(arch, big, t, h[None, :-1], emb(torch.tensor([text[1:]])), positions)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter._logits(0, normed), want_logits, atol=1e-4, rtol=1e-4)
    chain = []
    drafter._logits = lambda i, x, f=drafter._logits: chain.append(f(i, x)) or chain[-1]
    drafter = _started(drafter, target, text)
    drafter.propose(3)
    torch.testing.assert_close(chain[-1][0], logits[0, -1], atol=1e-4, rtol=1e-4)


def test_two_mtp_layers_draft_one_step_each_then_the_last_repeats(checkpoint):
    """DeepSeek's design: layer k reads layer k-1's output at the same position and the token k
    ahead; past the last layer, the last layer again (as vLLM chains one)."""
    folder, big = checkpoint("deepseek_v3", mtp_layers=2)
    target = load_model(str(folder)).model
    t, text = _tensors(folder), _prompts()[2]
    h, emb, T = _hidden(target, text), target.get_input_embeddings(), len(text) - 1
    pos = torch.arange(T)[None]
    with torch.no_grad():
        s0, logits = _vllm_step("deepseek_v3", big, t, h[None, :-1], emb(torch.tensor([text[1:]])), pos)
        d = [int(logits[0, -1].argmax())]
        s1, logits = _vllm_step("deepseek_v3", big, t, s0, emb(torch.tensor([text[2:] + d])), pos, layer=1)
        d.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([text[2:] + d])
        _, logits = _vllm_step("deepseek_v3", big, t, torch.cat([s0, s1[:, -1:]], 1), emb(ids),
                               torch.arange(T + 1)[None], layer=1)
        d.append(int(logits[0, -1].argmax()))
    drafter = _started(MTPDrafter(native_net(target, folder), target), target, text)
    assert drafter.propose(3).tokens[0].tolist() == d


@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_after_accepted_and_rejected_drafts_the_caches_hold_the_accepted_text(checkpoint, mtp_layers):
    """Random accepted prefixes of each proposal: every later proposal is the one a drafter started
    afresh on the accepted text makes (its caches hold exactly that text, the rest overwritten)."""
    folder, _ = checkpoint("deepseek_v3", mtp_layers=mtp_layers)
    target = load_model(str(folder)).model
    net = native_net(target, folder)
    g = torch.Generator().manual_seed(4)
    text = list(_prompts()[1])
    drafter = _started(MTPDrafter(net, target), target, text)
    for _ in range(6):
        gamma = int(torch.randint(1, 5, (1,), generator=g))
        prop = drafter.propose(gamma).tokens[0].tolist()
        assert prop == _started(MTPDrafter(net, target), target, text).propose(gamma).tokens[0].tolist()
        n = int(torch.randint(0, gamma + 1, (1,), generator=g))
        new = prop[:n] + [int(torch.randint(2, 96, (1,), generator=g))]
        fed = _hidden(target, text + new[:-1])[len(text) - 1:]  # the tokens this pass put in the cache
        drafter.observe_hidden([fed[:, None]])
        drafter.update([new], [n])
        text += new


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_own_mtp_layers_give_plain_decodings_text_bit_for_bit(checkpoint, dtype):
    """The every-drafter test (issue 28) for ``mtp`` on a DeepSeek-V3 checkpoint (MLA, experts,
    sharded): γ 1, 4 and auto, alone and batched; float32 also equals HF generate."""
    folder, _ = checkpoint("deepseek_v3", shards=2)
    gen = speculant.load(str(folder), drafter="none", dtype=dtype)
    target = gen.target.model
    plain = [o.token_ids for o in gen.generate_ids(_prompts(), max_new_tokens=20)]
    if dtype == "float32":
        for p, out in zip(_prompts(), plain):
            assert out == hf_greedy(target, p, 20), mismatch_report(target, p, hf_greedy(target, p, 20), out)
    accepted = 0
    drafter = make_drafter("mtp", gen.target)
    for gamma in (1, 4, "auto"):
        for batch in (1, 3):
            outs = speculant.generate(target, _prompts()[:batch], drafter=drafter, gamma=gamma, max_new_tokens=20)
            for i, out in enumerate(outs):
                assert out.token_ids == plain[i], f"gamma={gamma} batch={batch} row {i}"
                assert out.stats["exact"] == "bitwise"
            accepted += sum(o.stats["accepted_draft_tokens"] for o in outs)
    assert accepted > 0


@pytest.mark.parametrize("arch", ["glm4_moe", "mimo", "qwen3_next"])
def test_every_layout_drafts_losslessly(checkpoint, arch):
    folder, _ = checkpoint(arch)
    target = load_model(str(folder)).model
    outs = speculant.generate(target, _prompts(), drafter="mtp", gamma=4, max_new_tokens=20)
    for p, out in zip(_prompts(), outs):
        ref = hf_greedy(target, p, 20)
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    assert sum(o.stats["accepted_draft_tokens"] for o in outs) > 0


def test_a_folder_speculators_converter_wrote_drafts_what_the_checkpoint_does(checkpoint, tmp_path, float32_drafts):
    """speculators.convert.mtp extracts a Qwen3-Next-layout checkpoint's MTP layer into a
    speculators folder: ``mtp:DIR`` drafts exactly what ``mtp`` (the checkpoint's own) drafts, both
    in float32 (a folder's network beside a target on the kernel core would run on the int8 kernels)."""
    converter = pytest.importorskip("speculators.convert.mtp.converter")
    folder, _ = checkpoint("qwen3_next")
    converter.MTPConverter().convert(str(folder), str(tmp_path / "converted"), base_model=str(folder),
                                     num_speculative_steps=3, validate=True)
    loaded = load_model(str(folder))
    target, text = loaded.model, _prompts()[2]
    ours = _started(make_drafter(f"mtp:{tmp_path / 'converted'}", loaded), target, text)
    own = _started(make_drafter("mtp", loaded), target, text)
    assert ours.propose(5).tokens.tolist() == own.propose(5).tokens.tolist()
    out = speculant.generate(target, text, drafter=f"trained:{tmp_path / 'converted'}", gamma=3, max_new_tokens=16)
    assert out.token_ids == hf_greedy(target, text, 16) and out.stats["accepted_draft_tokens"] > 0


def test_own_mtp_layers_run_on_the_int8_kernels_where_a_folders_network_would(checkpoint, monkeypatch):
    """Beside a target on the kernel core the checkpoint's own MTP layers get the int8 kernels, as
    a speculators folder's network does (``trained.format.load_network``); SPECULANT_CPU_KERNELS=onednn
    keeps them float32. Plain decoding's text either way."""
    from speculant.models import cpu_kernels, quantized

    folder, _ = checkpoint("qwen3_next")
    loaded = load_model(str(folder))
    if not quantized.drafts_on_kernels(loaded.model):
        pytest.skip("no CPU kernels built here")
    linears = lambda d: [m for m in d.net.modules() if isinstance(m, torch.nn.Linear)]
    on_kernels = make_drafter("mtp", loaded)
    assert linears(on_kernels) and all(isinstance(vars(m).get("forward"), quantized.QuantLinear) for m in linears(on_kernels))
    plain = [o.token_ids for o in speculant.generate(loaded.model, _prompts(), drafter="none", max_new_tokens=16)]
    outs = speculant.generate(loaded.model, _prompts(), drafter=on_kernels, gamma=3, max_new_tokens=16)
    assert [o.token_ids for o in outs] == plain and sum(o.stats["accepted_draft_tokens"] for o in outs) > 0
    monkeypatch.setenv(cpu_kernels.ENV, "onednn")
    assert not any("forward" in vars(m) for m in linears(make_drafter("mtp", loaded)))


def _random_mtp_folder(tmp_path, target, verifier="tiny", name="mtp"):
    cfg = mtp_config(target, verifier, 3)
    torch.manual_seed(0)
    net = MTPNet(cfg)
    save_folder(tmp_path / name, cfg, dict(net.state_dict()))
    return tmp_path / name


@pytest.mark.usefixtures("float32_drafts")
def test_our_folder_loads_in_speculators_and_computes_our_steps(tmp_path):
    """speculators' MTPDraftModel loads a folder we save; its teacher-forced forward (3 steps, each
    reading the last one's output) gives our layer's logits."""
    spec = pytest.importorskip("speculators.models.mtp")
    target_dir = save_tiny_folder(tmp_path / "target", seed=0)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    folder = _random_mtp_folder(tmp_path, target, verifier=str(target_dir))
    theirs = spec.MTPDraftModel.from_pretrained(str(folder)).float().eval()
    ours = load_mtp(str(folder), target, "tiny").net.float()
    ids = torch.randint(2, 96, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    h = _hidden(target, ids)[None]
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor([ids]), hidden_states=h)[0]
        n = len(want[0][0])
        hidden, pos = h[:, :n], torch.arange(n)[None]
        for k in range(3):
            embeds = target.get_input_embeddings()(torch.tensor([ids[k + 1 : k + 1 + n]]))
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
            hidden, normed = ours.step(0, embeds, hidden, pos, _Joined(lambda a, b: (a, b)), mask)
            torch.testing.assert_close(target.lm_head(normed), want[k], atol=1e-4, rtol=1e-4)


def test_mtp_sampling_matches_the_target_distribution(tmp_path):
    target = peaked(0)
    folder = _random_mtp_folder(tmp_path, target)
    counts, alpha = sample_counts(target, load_mtp(str(folder), target, "tiny"), PARAMS["t=0.8,top_k=3,rep=1.3"], seed=7)
    pvalue = fit_pvalue(counts, exact_distribution(target, PARAMS["t=0.8,top_k=3,rep=1.3"]))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.05 < alpha < 0.95, alpha


def test_refusals_are_one_line(tmp_path):
    target = LoadedModel(tiny_llama(0), None, "tiny")
    with pytest.raises(SpeculantError, match="tiny has no MTP layers in its checkpoint"):
        make_drafter("mtp", target)
    with pytest.raises(SpeculantError, match="must draft token trees"):
        make_drafter(f"trained:{_random_mtp_folder(tmp_path, target.model)}+ngram", target)
    from speculant.export import vllm_config

    assert vllm_config("mtp", 2) == {"method": "mtp", "num_speculative_tokens": 2}
    folder = _random_mtp_folder(tmp_path, target.model, name="m2")
    assert vllm_config(f"mtp:{folder}")["model"] == str(folder.resolve())


def test_speculant_train_kind_mtp_writes_a_folder_speculators_loads(tmp_path):
    """For a target without MTP layers: training lowers the loss and raises held-out τ, the folder is
    speculators' (its MTPDraftModel loads it), drafts losslessly here and exports to vLLM's mtp."""
    from speculant.export import vllm_config
    from speculant.tools.train import TrainSettings, run_train
    from test_dflash import _jsonl

    target_dir = save_tiny_folder(tmp_path / "target", seed=0)
    common = dict(kind="mtp", target=str(target_dir), data=str(_jsonl(tmp_path / "data.jsonl")), batch=4,
                  eval_sequences=4, checkpoint_every=1000, work=str(tmp_path / "cache"), self_distill=False)
    first = run_train(TrainSettings(out=str(tmp_path / "m1"), steps=1, **common), progress_bar=False,
                      log=lambda *a: None)
    trained = run_train(TrainSettings(out=str(tmp_path / "m2"), steps=40, lr=3e-3, **common), progress_bar=False,
                        log=lambda *a: None)
    curve, folder = trained["loss_curve"], tmp_path / "m2"
    assert sum(curve[-5:]) / 5 < 0.7 * sum(curve[:5]) / 5, curve
    assert trained["held_out"]["tau"] >= first["held_out"]["tau"], (first["held_out"], trained["held_out"])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["speculators_model_type"] == "mtp" and cfg["transformer_layer_config"]["model_type"] == "qwen3"
    spec = pytest.importorskip("speculators.models.mtp")
    spec.MTPDraftModel.from_pretrained(str(folder))  # reads the target's embeddings and head from its folder
    gen = speculant.load(str(target_dir), drafter=f"mtp:{folder}", dtype="float32", gamma=4)
    ids = gen.tokenizer(json.loads((tmp_path / "data.jsonl").read_text().splitlines()[0])["text"])["input_ids"][:12]
    out = gen.generate_ids([ids], max_new_tokens=24)[0]
    assert out.token_ids == hf_greedy(gen.target.model, ids, 24)[: len(out.token_ids)]
    assert out.stats["accepted_draft_tokens"] > 0, out.stats
    assert vllm_config(f"mtp:{folder}", 3) == {"method": "mtp", "num_speculative_tokens": 3,
                                                "model": str(folder.resolve())}
