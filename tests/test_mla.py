"""MLA targets (DeepSeek-V2/V3: value heads narrower than query/key heads) on the width-invariant
general path: HF ``generate``'s text, and speculative text equal to plain decoding's bit for bit under
every attention mode, in float32 and bfloat16; targets with recurrent layers are refused in one line."""
import pytest
import torch
import torch.nn.functional as F

import speculant
from speculant.errors import SpeculantError
from speculant.models import invariant
from speculant.models.invariant import Attention
from speculant.models.kv import KVState
from helpers import assert_same_or_bf16_near_tie, hf_greedy, mismatch_report, tiny_deepseek
from test_invariance import _modes

BF16 = torch.bfloat16


def _prompts():
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, 17)]
    out[0] = out[0] * 4  # repeats: prompt lookup drafts get accepted
    return out


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("version", [2, 3])
def test_an_mla_target_decodes_as_hf_generate(version, dtype):
    target = tiny_deepseek(version).to(dtype)
    outs = speculant.generate(target, _prompts(), drafter="none", max_new_tokens=16, path="general")
    for p, out in zip(_prompts(), outs):
        ref = hf_greedy(target, p, 16)
        if dtype == torch.float32:
            assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
        else:
            assert_same_or_bf16_near_tie(target, p, ref, out.token_ids)
        assert out.stats["exact"] == "bitwise"


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mode", _modes(), ids=[m[0] for m in _modes()])
def test_mla_speculative_text_is_plain_decodings_in_every_attention_mode(mode, dtype, monkeypatch):
    """Chains and token trees, a batch of two: each attention mode pads the values to the query
    width and keeps every row's bits (the kernel takes one head width for keys and values)."""
    monkeypatch.setattr(invariant, "attention_choice", lambda *a, **k: Attention(mode, mode))
    target = tiny_deepseek(3).to(dtype)
    plain = [o.token_ids for o in speculant.generate(target, _prompts(), drafter="none", max_new_tokens=16,
                                                       path="general")]
    accepted = 0
    for drafter in ("ngram", "ngram:tree"):
        outs = speculant.generate(target, _prompts(), drafter=drafter, gamma=4, max_new_tokens=16, path="general")
        assert [o.token_ids for o in outs] == plain, drafter
        assert all(o.stats["exact"] == "bitwise" for o in outs)
        accepted += sum(o.stats["accepted_draft_tokens"] for o in outs)
    assert accepted > 0


@pytest.mark.parametrize("widths", [(16, 8), (8, 16)], ids=["narrow values", "wide values"])
def test_one_width_attention_is_the_attention_at_its_own_widths(widths):
    """Zero columns pad queries/keys or values to one width; the output's real columns are HF's
    eager attention at the heads' own widths (to rounding)."""
    d, dv = widths
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, d, generator=g), torch.randn(1, 4, 9, d, generator=g), torch.randn(1, 4, 9, dv, generator=g)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None]
    out, _ = invariant._hf_attention(None, q, k, v, mask, scaling=d ** -0.5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_compacting_an_mla_cache_keeps_what_the_next_pass_reads():
    """MLA caches latents (keys and values of different widths): squeezing a batch's holes out
    gathers each by its own shape."""
    target = tiny_deepseek(3)
    tokens = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    valid = torch.tensor([[False, False, True, True, True], [True] * 5])
    block = torch.tensor([[8, 9], [10, 11]])
    plain = KVState(target, 2)
    plain.append(tokens, valid)
    compacted = KVState(target, 2)
    compacted.append(tokens, valid)
    compacted.rollback(torch.tensor([2, 5]))  # row 0 loses a token: a hole
    plain.rollback(torch.tensor([2, 5]))
    compacted.compact()
    torch.testing.assert_close(compacted.append(block), plain.append(block))


def test_a_target_with_linear_attention_layers_is_refused_in_one_line():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, num_experts=2, num_experts_per_tok=1,
                          linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
                          linear_value_head_dim=16, max_position_embeddings=128)
    with pytest.raises(SpeculantError, match="linear_attention layers.*cannot roll a rejected draft back"):
        speculant.generate(Qwen3NextForCausalLM(cfg).eval(), [1, 2, 3], drafter="none", max_new_tokens=2)
