"""Tiny random checkpoints with MTP layers in the layouts models ship (for tests/test_mtp.py), written
the way those models store them: a model with one more decoder layer than its config names is saved
by transformers itself (experts per expert, as checkpoints hold them), that last layer renamed to
where the layout keeps its MTP layer, and the layout's own tensors added beside it.

``target_scale`` shrinks the target's attention and MLP outputs (its next token then depends mostly
on the current one) and ``block_scale`` the MTP layer's, whose projection reads mostly the token
embedding: so the MTP layer guesses the target's token after next often, and drafts get accepted.""" 
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_deepseek, tiny_tokenizer

H = 64


def _qwen(kind: str, layers: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=H, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()


def _glm(layers: int, seed: int):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Glm4MoeConfig(vocab_size=96, hidden_size=H, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                        first_k_dense_replace=1, max_position_embeddings=512, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Glm4MoeForCausalLM(cfg).eval()


ARCH = {"deepseek_v3": lambda n, s: tiny_deepseek(3, seed=s, layers=n), "glm4_moe": _glm,
        "mimo": lambda n, s: _qwen("qwen2", n, s), "qwen3_next": lambda n, s: _qwen("qwen3", n, s)}
LAYOUT_OF = {"deepseek_v3": "deepseek", "glm4_moe": "deepseek", "mimo": "mimo", "qwen3_next": "qwen3_next"}


@torch.no_grad()
def _scale_outputs(layer: torch.nn.Module, scale: float) -> None:
    """Shrink what a decoder layer adds to the residual stream (its attention and MLP output projections)."""
    for name, p in layer.named_parameters():
        if "o_proj" in name or "down_proj" in name:
            p.mul_(scale)


def save_with_mtp(folder, arch: str, layers: int = 2, mtp_layers: int = 1, seed: int = 0, target_scale: float = 0.2,
                  block_scale: float = 0.1, shards: int = 1):
    """A model folder whose checkpoint holds ``mtp_layers`` MTP layers in ``arch``'s layout, and the
    model it was cut from (its layers from ``layers`` on are the MTP layers' decoder blocks)."""
    folder = Path(folder)
    big = ARCH[arch](layers + mtp_layers, seed)
    for i, layer in enumerate(big.model.layers):
        _scale_outputs(layer, target_scale if i < layers else block_scale)
    big.generation_config.eos_token_id, big.generation_config.pad_token_id = 1, 0  # the tokenizer's </s>
    big.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    g = torch.Generator().manual_seed(seed + 7)
    # the projection reads mostly the token's embedding, some of the hidden state
    eye, zero = torch.eye(H), 0.3 * torch.randn(H, H, generator=g) / H ** 0.5

    def near_one():
        return 1 + 0.05 * torch.randn(H, generator=g)

    layout = LAYOUT_OF[arch]
    for j in range(mtp_layers):
        src = f"model.layers.{layers + j}."
        block = {k[len(src):]: state.pop(k) for k in list(state) if k.startswith(src)}
        if layout == "deepseek":  # vLLM's deepseek_mtp: [enorm(embedding), hnorm(hidden)]
            extra = {"enorm.weight": near_one(), "hnorm.weight": near_one(), "eh_proj.weight": torch.cat([eye, zero], 1),
                     "shared_head.norm.weight": state["model.norm.weight"].clone(),
                     "shared_head.head.weight": state["lm_head.weight"].clone(),
                     "embed_tokens.weight": state["model.embed_tokens.weight"].clone()}
            state.update({src + k: v for k, v in (block | extra).items()})
        elif layout == "mimo":  # vLLM's mimo_mtp: [hidden_layernorm(hidden), token_layernorm(embedding)]
            extra = {"token_layernorm.weight": near_one(), "hidden_layernorm.weight": near_one(),
                     "input_proj.weight": torch.cat([zero, eye], 1),
                     "final_layernorm.weight": state["model.norm.weight"].clone()}
            state.update({f"model.mtp_layers.{j}.{k}": v for k, v in (block | extra).items()})
        else:  # Qwen3-Next: mtp.layers.j and the fc and norms its layers share
            state.update({f"mtp.layers.{j}.{k}": v for k, v in block.items()})
            state.update({"mtp.fc.weight": torch.cat([eye, zero], 1), "mtp.pre_fc_norm_hidden.weight": near_one(),
                          "mtp.pre_fc_norm_embedding.weight": near_one(),
                          "mtp.norm.weight": state["model.norm.weight"].clone()})
    names = sorted(state)
    parts = [names[i::shards] for i in range(shards)]
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": part for i, part in enumerate(parts)}
        for name, part in files.items():
            save_file({k: state[k] for k in part}, str(folder / name), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: name for name, part in files.items() for k in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    cfg["num_nextn_predict_layers"] = mtp_layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, big
