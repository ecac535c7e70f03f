"""The speculators kinds speculant runs from their folders (issue 40): P-EAGLE (``peagle``), and the
DFlash variants ``dflash2``, ``dspark`` and ``xpress``. Each is built from random weights by
speculators itself, saved, loaded here, and its drafts compared with speculators' own forward (its
training forward, or its modules, on the block speculant drafts); then greedy identity and the
target's distribution under sampling, and `speculant train` refusing the kinds it does not train."""
import pytest
import torch

import speculant
from speculant.drafters import make_drafter
from speculant.drafters.base import DraftContext
from speculant.errors import SpeculantError
from speculant.models.loading import LoadedModel
from speculant.sampling import LogitsProcessing, SamplingParams
from helpers import hf_greedy, mismatch_report, tiny_llama
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts

pytest.importorskip("speculators.models.peagle")
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402

TAPS = [0, 1, 2]
EAGER_KL = __import__("speculators.losses", fromlist=["resolve_loss_config"]).resolve_loss_config("kl_div", "eager")


def _speculators_config(algorithm: str, tokens: int) -> SpeculatorsConfig:
    return SpeculatorsConfig(algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))


def _layer(kind: str, vocab: int, hidden: int):
    from transformers import LlamaConfig, Qwen3Config

    cls = LlamaConfig if kind == "llama" else Qwen3Config
    cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512)
    cfg._attn_implementation = "eager"  # speculators' masks as float tensors (its default is flex attention)
    return cfg


def peagle_model(target, depths=4, seed=0, head_scale=1.0):
    """speculators' own P-EAGLE for ``target`` (its embeddings and LM head copied in, as speculators
    reads them from the verifier)."""
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    cfg = PEagleSpeculatorConfig(transformer_layer_config=_layer("llama", vocab, hidden), draft_vocab_size=vocab,
                                 eagle_aux_hidden_state_layer_ids=TAPS[: target.config.num_hidden_layers],
                                 norm_before_residual=True, mask_token_id=vocab - 1,
                                 speculators_config=_speculators_config("peagle", depths))
    torch.manual_seed(seed)
    model = PEagleDraftModel(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head.weight * head_scale)
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return model


def _started(drafter, target, text, processing=None):
    """``drafter`` started on text[:-1] (the target's tapped states of it), then told text[-1]."""
    prompt = text[:-1]
    with torch.no_grad():
        states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    hidden = torch.stack([states[i][0] for i in drafter.hidden_layers], 1)
    drafter.start(DraftContext([prompt], processing or LogitsProcessing(SamplingParams()), None, torch.device("cpu"),
                               target.config.vocab_size, max_tokens=256, prompt_hidden=[hidden]))
    drafter.update([[text[-1]]], [0])
    return drafter


def _capture(module):
    """The outputs of ``module`` from now on."""
    seen = []
    module.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    return seen


@pytest.mark.usefixtures("float32_drafts")
def test_peagle_drafts_speculators_parallel_groups_logits(tmp_path, monkeypatch):
    """speculators' P-EAGLE forward over a text (every position at depth 0) with one rollout of
    depths 1..3 from position a: its logits there are the ones our single forward drafts from after
    the text up to a + 1."""
    import speculators.models.peagle.core as core

    target = tiny_llama(0, layers=3)
    theirs = peagle_model(target)
    theirs.save_pretrained(tmp_path / "peagle")
    text = [5, 9, 14, 3, 27, 8, 40, 12, 6]
    n, K = len(text) - 1, 4
    a = n - K  # the rollout's anchor: speculators reads the text's tokens at a + depth (ignored there)
    anchors = torch.cat([torch.arange(n), torch.full((K - 1,), a)])
    depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, K)])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **kw: (anchors, depth))
    with torch.no_grad():
        states = target(torch.tensor([text]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in TAPS], -1)
    seen = _capture(theirs.lm_head)
    with torch.no_grad():  # speculators' shift: row j holds the target's states at j and token j+1
        theirs(hidden_states=aux[None, :-1], input_ids=torch.tensor([text[1:]]), document_ids=torch.zeros(1, n, dtype=torch.long),
               verifier_last_hidden_states=states[-1][:, :-1], loss_config=EAGER_KL)
    want = seen[0][0, [a] + list(range(n, n + K - 1))]
    drafter = _started(make_drafter(f"peagle:{tmp_path / 'peagle'}", LoadedModel(target, None, "tiny")), target,
                       text[: a + 2])
    got = _capture(drafter.net.lm_head)
    prop = drafter.propose(K)
    torch.testing.assert_close(got[0][0], want, atol=1e-4, rtol=1e-4)
    assert prop.tokens[0].tolist() == want.argmax(-1).tolist()


def test_peagle_greedy_text_is_hf_generates_and_sampling_keeps_the_distribution(tmp_path):
    target = tiny_llama(0, layers=3)
    peagle_model(target).save_pretrained(tmp_path / "p")
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    for gamma in (1, 4, "auto"):
        out = speculant.generate(target, [prompt, prompt[:3]], drafter=f"trained:{tmp_path / 'p'}", gamma=gamma,
                                 max_new_tokens=20)
        for p, o in zip([prompt, prompt[:3]], out):
            assert o.token_ids == hf_greedy(target, p, 20), mismatch_report(target, p, hf_greedy(target, p, 20), o.token_ids)
    small = peaked(0)
    peagle_model(small, depths=3, head_scale=0.05).save_pretrained(tmp_path / "small")  # q flatter than p
    drafter = make_drafter(f"peagle:{tmp_path / 'small'}", LoadedModel(small, None, "tiny"))
    counts, alpha = sample_counts(small, drafter, PARAMS["t=0.8,top_k=3,rep=1.3"], seed=3)
    pvalue = fit_pvalue(counts, exact_distribution(small, PARAMS["t=0.8,top_k=3,rep=1.3"]))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.05 < alpha < 0.95, alpha


def test_kinds_speculant_does_not_train_are_refused_in_one_line(tmp_path):
    from speculant.tools.train import TrainSettings, check_settings

    for kind in ("peagle", "dflash2", "dspark", "xpress"):
        with pytest.raises(SpeculantError, match=f"speculant train does not train {kind}"):
            check_settings(TrainSettings(kind=kind, out=str(tmp_path / "x")))


# ---- the DFlash variants --------------------------------------------------------------------------

def dflash_variant(kind: str, target, block=4, seed=0, scale=1.0, **extra):
    """speculators' own DFlash2 / DSpark / XPress network for ``target`` (its embeddings and LM head
    copied in), with every added module given random weights that matter (speculators starts its
    convolutions and refiner as identities)."""
    import importlib

    module = importlib.import_module(f"speculators.models.{kind}")
    name = {"dflash2": "DFlash2", "dspark": "DSpark", "xpress": "XPress"}[kind]
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    cfg = getattr(module, f"{name}SpeculatorConfig")(
        transformer_layer_config=_layer("qwen3", vocab, hidden), draft_vocab_size=vocab, block_size=block,
        aux_hidden_state_layer_ids=[0, 1], mask_token_id=vocab - 1, speculators_config=_speculators_config(kind, block),
        **({"selector_rank": 16, "selector_top_k": 4, "conv_group_size": 16} if kind == "dflash2" else {}),
        **({"markov_rank": 16} if kind == "dspark" else {}), **({"xpress_rank": 16} if kind == "xpress" else {}),
        **extra)
    torch.manual_seed(seed)
    model = getattr(module, f"{name}DraftModel")(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head.weight)
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        for n, p in model.named_parameters():
            if any(k in n for k in ("conv", "candidate_selector", "markov", "refiner", "confidence")):
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "conv" in n else 1.0) * scale)
    return model


def _backbone(theirs, target, text):
    """speculators' backbone over the block [text[-1], MASK, ...] after the context text[:-1], run
    through its own layers as its training forward runs them: the normed states [1, K, H]."""
    C, K = len(text) - 1, theirs.block_size
    with torch.no_grad():
        states = target(torch.tensor([text[:-1]]), output_hidden_states=True).hidden_states
        ctx = theirs.hidden_norm(theirs.fc(torch.cat([states[i] for i in (0, 1)], -1)))
        pos = torch.arange(C + K)[None]
        pe = theirs.rotary_emb(ctx, pos)
        h = theirs.embed_tokens(torch.tensor([[text[-1]] + [theirs.mask_token_id] * (K - 1)]))
        for layer in theirs.layers:
            h = layer(hidden_states=h, target_hidden=ctx, attention_mask=torch.ones(1, 1, K, C + K, dtype=torch.bool),
                      position_ids=pos, position_embeddings=pe)
        return theirs.norm(h)


def _their_drafts(kind, theirs, hidden, text):
    """The block's greedy drafts by speculators' own modules (target ids)."""
    anchor, base = torch.tensor([text[-1]]), theirs.lm_head(hidden)
    K = theirs.block_size
    if kind == "dflash2":  # the selector's greedy path: each slot given the draft before it
        prev, out = anchor, []
        for k in range(1, K):
            ids, scores = theirs.candidate_selector.select(base[:, k : k + 1], hidden[:, k : k + 1], prev[:, None])
            prev = ids[0, 0, scores[0, 0].argmax()][None]
            out.append(int(prev))
        return out
    if kind == "dspark":  # slot k (the anchor's too) biased by the token before it
        prev = [text[-1]]
        for k in range(K):
            ids = torch.tensor([prev + [text[-1]] * (K - len(prev))])
            bias = theirs.markov_head.block_bias(prev_token_ids=ids, hidden_states=hidden)
            prev.append(int((base[0, k] + bias[0, k]).argmax()))
        return prev[1:]
    cache = theirs.refiner_head.hidden_cache(hidden)  # xpress: Jacobi passes over the block
    pred = base.argmax(-1)
    for _ in range(theirs.config.num_jacobi_passes):
        pred[:, 0] = anchor
        prev = torch.cat([torch.tensor([[text[-2]]]), pred[:, :-1]], 1)
        pred = (base + theirs.refiner_head.block_bias(prev, hcache=cache)).argmax(-1)
    return pred[0, 1:].tolist()


VARIANTS = [("dflash2", {}), ("dspark", {}), ("dspark", {"markov_head_type": "gated"}),
            ("dspark", {"markov_head_type": "rnn"}), ("xpress", {})]


@pytest.mark.usefixtures("float32_drafts")
@pytest.mark.parametrize("kind,extra", VARIANTS, ids=[k + "-" + "-".join(e.values()) for k, e in VARIANTS])
def test_dflash_variants_draft_what_speculators_modules_choose(kind, extra, tmp_path):
    target = tiny_llama(0, layers=2)
    theirs = dflash_variant(kind, target, **extra)
    theirs.save_pretrained(tmp_path / kind)
    text = [5, 9, 14, 3, 27, 8, 40, 12, 6]
    with torch.no_grad():
        hidden = _backbone(theirs, target, text)
        want = _their_drafts(kind, theirs, hidden, text)
    drafter = _started(make_drafter(f"{kind}:{tmp_path / kind}", LoadedModel(target, None, "tiny")), target, text)
    got = drafter.propose(len(want)).tokens[0].tolist()
    torch.testing.assert_close(drafter._block_hidden(), hidden, atol=1e-4, rtol=1e-4)
    assert got == want


@pytest.mark.parametrize("kind", ["dflash2", "dspark", "xpress"])
def test_dflash_variants_keep_the_target_distribution_under_sampling(kind, tmp_path):
    """dspark draws each slot from its q given the drafts before it; dflash2 and xpress draft
    deterministically (one-hot q): either way the samples follow the target (chi-square)."""
    small = peaked(0)
    dflash_variant(kind, small, block=3, scale=0.1).save_pretrained(tmp_path / kind)
    drafter = make_drafter(f"{kind}:{tmp_path / kind}", LoadedModel(small, None, "tiny"))
    counts, alpha = sample_counts(small, drafter, PARAMS["t=0.8,top_k=3,rep=1.3"], seed=11)
    pvalue = fit_pvalue(counts, exact_distribution(small, PARAMS["t=0.8,top_k=3,rep=1.3"]))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.02 < alpha < 0.98, alpha


def test_export_maps_what_vllm_runs_and_refuses_the_rest(tmp_path):
    from speculant.export import vllm_config

    target = tiny_llama(0, layers=2)
    for kind in ("dflash2", "dspark", "xpress"):
        dflash_variant(kind, target).save_pretrained(tmp_path / kind)
    assert vllm_config(f"dspark:{tmp_path / 'dspark'}") == {"method": "dspark", "model": str((tmp_path / "dspark").resolve()),
                                                            "num_speculative_tokens": 4}
    for kind in ("dflash2", "xpress"):
        with pytest.raises(SpeculantError, match=f"vLLM has no {kind} method"):
            vllm_config(f"trained:{tmp_path / kind}")
    peagle_model(tiny_llama(0, layers=3)).save_pretrained(tmp_path / "p")
    assert vllm_config(f"peagle:{tmp_path / 'p'}", 2)["method"] == "eagle3"
