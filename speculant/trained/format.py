"""Trained drafters on disk: the speculators folder format (``config.json`` + ``model.safetensors``),
which vLLM serves unchanged (``vllm serve T --speculative-config '{"model": DIR, ...}'``).

speculant adds one key speculators ignores, ``speculant_target``: the target's shape and a checksum
of its embedding matrix, so a drafter trained for another model is refused in one line instead of
drafting garbage (a folder without it is checked on shapes only).

What is kind-specific (which ``speculators_model_type`` a folder may hold, and what each kind must
name) is the drafter registry's: ``drafters/registry.py``, ``read_trained``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .. import files
from ..models import quantized
from ..errors import SpeculantError

SPECULATORS_VERSION = "0.9.0"


def target_fingerprint(model: torch.nn.Module) -> dict:
    """The target's shape and a checksum of its embedding matrix (summed |values| of a few rows),
    the same whatever dtype the target was loaded in (see ``same_target``)."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    rows = emb[torch.linspace(0, emb.shape[0] - 1, 8).long()].detach().float().cpu()
    return {"hidden_size": int(cfg.hidden_size), "num_hidden_layers": int(cfg.num_hidden_layers),
            "vocab_size": int(emb.shape[0]), "embed_checksum": [float(f"{float(x):.7g}") for x in rows.abs().sum(1)]}


def target_differences(want: dict, have: dict) -> list[str]:
    """What differs between two fingerprints. Checksums must agree within 0.1% (plus 0.001 for folders
    that recorded them to 3 decimals): the default target's differ by at most 0.008% between float32
    and bfloat16. A fine-tune of the same base (same shapes) passes only if its embeddings moved
    less; output stays exact either way, only the drafter's acceptance may suffer."""
    problems = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if want.get(k) != have[k]]
    sums = want.get("embed_checksum")
    if not problems and (not isinstance(sums, list) or len(sums) != len(have["embed_checksum"]) or any(
            abs(a - b) > 1e-3 * max(abs(a), abs(b)) + 1e-3 for a, b in zip(sums, have["embed_checksum"]))):
        problems.append("embedding weights")
    return problems


def read_config(folder: str | Path, check: Callable[[dict], None] | None = None) -> dict:
    """A speculators folder's ``config.json`` (an object of settings) with ``model.safetensors`` beside
    it; ``check(config)`` judges its settings before the weights are looked for (the registry's
    ``read_trained``: a kind speculant runs, naming its tapped layers)."""
    path = Path(folder)
    if not files.is_regular(path / "config.json", "drafter folder"):
        raise SpeculantError(f"'{folder}' is not a drafter folder: it has no config.json (train one with "
                             "`speculant train` or give a speculators-format folder)")
    cfg = files.read_json_object(path / "config.json", "drafter config",
                                 "give a folder `speculant train` or speculators wrote")
    if check is not None:
        check(cfg)
    if not files.is_regular(path / "model.safetensors", "drafter weights"):
        raise SpeculantError(f"'{folder}' has no model.safetensors")
    return cfg


def tapped_layers(cfg: dict) -> list[int]:
    """The target layers a drafter reads (EAGLE-3 names them ``eagle_aux_hidden_state_layer_ids``)."""
    return list(cfg.get("aux_hidden_state_layer_ids") or cfg.get("eagle_aux_hidden_state_layer_ids") or [])


def default_taps(num_layers: int) -> list[int]:
    """Low, middle and high layers (EAGLE-3's choice, as vLLM taps them: the input of each layer)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)})


def check_target(cfg: dict, folder, target: torch.nn.Module, target_name: str) -> None:
    """Refuse a drafter trained for another target, naming both."""
    have = target_fingerprint(target)
    want = cfg.get("speculant_target")
    tl = cfg["transformer_layer_config"]
    trained_for = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path") or "another model"
    problems = []
    if want:
        problems = target_differences(want, have)
    else:
        if int(tl["vocab_size"]) != have["vocab_size"]:
            problems.append("vocab_size")
        if int(cfg.get("target_hidden_size") or tl["hidden_size"]) != have["hidden_size"]:
            problems.append("hidden_size")
    if max(tapped_layers(cfg) or [0]) > have["num_hidden_layers"]:
        problems.append("tapped layers")
    if problems:
        raise SpeculantError(f"drafter '{folder}' was trained for {trained_for}, not for {target_name} "
                             f"({', '.join(problems)} differ): train one for this target with `speculant train`")


def shipped_drafters() -> list[Path]:
    """Drafter folders that ship inside the package (speculant/data/drafters/*)."""
    root = Path(__file__).resolve().parent.parent / "data" / "drafters"
    return sorted(p for p in root.glob("*") if (p / "config.json").is_file()) if root.is_dir() else []


def load_network(folder, target: torch.nn.Module, target_name: str, build, what: str, dtype=None,
                 ignore: tuple[str, ...] = ()) -> torch.nn.Module:
    """A trained drafter's network from its folder (``build(config)`` makes it), checked against
    the target it runs with, on the target's device and in its dtype (or ``dtype``); beside a
    quantized CPU target in float32 with its linears on the CPU kernels (``quantized.kernel_linears``);
    tensors whose names start with one of ``ignore`` are not read (the target's own, saved beside by
    speculators)."""
    cfg = read_config(folder)
    with _malformed(folder, what):
        check_target(cfg, folder, target, target_name)
        net = build(cfg)
        state = {k: v for k, v in load_state(folder).items() if not k.startswith(ignore)} if ignore else load_state(folder)
        missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "inv_freq"]  # a buffer rebuilt from the config
    if missing or unexpected:
        raise SpeculantError(f"drafter '{folder}' does not match {what}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    return placed(net, target, dtype)


def placed(net: torch.nn.Module, target: torch.nn.Module, dtype=None) -> torch.nn.Module:
    """A drafter's network on the target's device in its dtype (or ``dtype``), for inference; beside
    a target on the CPU kernels in float32 with its linears on them (``quantized.kernel_linears``)."""
    p = next(target.parameters())
    if quantized.drafts_on_kernels(target):  # its linears on the CPU kernels, as the target's
        return quantized.kernel_linears(net.to(device=p.device, dtype=torch.float32).eval())
    return net.to(device=p.device, dtype=dtype or p.dtype).eval()


@contextlib.contextmanager
def _malformed(folder, what: str):
    """A config missing or mistyping a setting, or a damaged weights file: one line naming the folder."""
    try:
        yield
    except SpeculantError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError, SafetensorError) as e:
        raise SpeculantError(f"drafter '{folder}' is not a usable folder of {what}: its config.json or "
                             f"model.safetensors is malformed ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                             ) from None


def tensor_names(folder: str | Path, what: str) -> set[str]:
    """The names of the tensors in a drafter folder's weights file."""
    with _malformed(folder, what), safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        return set(f.keys())


def load_state(folder: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "model.safetensors"))


def save_folder(folder: str | Path, cfg: dict, state: dict[str, torch.Tensor]) -> None:
    """Write config.json and model.safetensors (atomically: a half-written folder never appears)."""
    out = Path(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    floats = [v.dtype for v in state.values() if v.is_floating_point()]
    cfg = {**cfg, "dtype": str(floats[0]).removeprefix("torch.") if floats else "float32"}
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / "model.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def layer_config(target: torch.nn.Module, layers: int, model_type: str) -> dict:
    """The drafter's transformer_layer_config: decoder layers of the target's width and rope, in
    the architecture speculators builds for the kind (qwen3: DFlash; llama: EAGLE-3)."""
    c = target.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    if "rope_theta" not in rope:  # per layer type (Gemma 3): the global layers' base
        rope = rope.get("full_attention") or next(iter(rope.values()), {})
    theta = rope.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0
    return {
        "model_type": model_type, "architectures": [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]],
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": int(target.get_output_embeddings().weight.shape[0]),
        "rope_parameters": {"rope_theta": float(theta), "rope_type": "default"},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "layer_types": ["full_attention"] * layers,
    }


def speculators_config(algorithm: str, tokens: int, target: torch.nn.Module, target_name: str) -> dict:
    """The ``speculators_config`` block: greedy proposals of ``tokens`` tokens, the verifier."""
    archs = list(getattr(target.config, "architectures", None) or [])
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": target_name, "architectures": archs}}
