"""Constrained output through the logits-processor hook (``SamplingParams.logits_processors``).

A processor is ``fn(token_ids, logits) -> logits`` where ``token_ids`` is the full context (prompt,
output so far, and -- while drafting or verifying -- the draft tokens before this position). The
engine applies the same processors to the target's p and the drafter's q, each on its own context,
so masking stays lossless and drafts that obey the constraint keep being accepted.

JSON schema constraints use lm-format-enforcer (``pip install lm-format-enforcer``): its token
enforcer is keyed by the token prefix, so it answers for any draft prefix, not only for the one
sequence plain decoding would walk.
"""
from __future__ import annotations

from typing import Callable

import torch

from .errors import SpeculantError


def allowed_tokens_processor(allowed: Callable[[list[int]], list[int]]):
    """A processor that keeps only ``allowed(token_ids)`` (sets every other logit to -inf)."""

    def process(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = torch.tensor(allowed(token_ids), dtype=torch.long, device=logits.device)
        keep = keep[keep < logits.shape[-1]]
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        return masked

    return process


_TOKENIZER_DATA: dict = {}  # (id(tokenizer), eos) -> (tokenizer, data): building it decodes the whole vocabulary


def _tokenizer_data(tokenizer, eos_token_ids):
    """lm-format-enforcer's view of a tokenizer (its own transformers integration imports a module
    transformers 5 removed, so this is that function, rebuilt on the public tokenizer API)."""
    key = (id(tokenizer), tuple(sorted(eos_token_ids or ())))
    if key not in _TOKENIZER_DATA:
        _TOKENIZER_DATA[key] = (tokenizer, _build_tokenizer_data(tokenizer, eos_token_ids))
    return _TOKENIZER_DATA[key][1]


def _build_tokenizer_data(tokenizer, eos_token_ids):
    from lmformatenforcer import TokenEnforcerTokenizerData  # the structured extra, installed apart

    special = set(tokenizer.all_special_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular = []
    for tok in range(len(tokenizer)):
        if tok in special:
            continue
        # decode after "0" and drop it: keeps a word-start token's leading space
        after_zero = tokenizer.decode([zero, tok])[1:]
        regular.append((tok, after_zero, len(after_zero) > len(tokenizer.decode([tok]))))
    eos = sorted(eos_token_ids) if eos_token_ids else tokenizer.eos_token_id
    return TokenEnforcerTokenizerData(regular, lambda ids: tokenizer.decode(ids).rstrip("\ufffd"), eos, False, len(tokenizer))


def json_schema_processor(tokenizer, schema: dict | None = None, eos_token_ids=None):
    """A processor that forces the output to be JSON matching ``schema`` (any JSON object if None).
    ``eos_token_ids``: the tokens that may end the output once the JSON is complete."""
    try:
        from lmformatenforcer import JsonSchemaParser, TokenEnforcer  # the structured extra, installed apart
    except ImportError:
        raise SpeculantError("JSON-schema output needs lm-format-enforcer: pip install lm-format-enforcer") from None
    if tokenizer is None:
        raise SpeculantError("JSON-schema output needs the model's tokenizer")
    if schema is not None and not isinstance(schema, dict):
        raise SpeculantError(f"unusable JSON schema: it must be a JSON object, got {type(schema).__name__}")
    try:
        enforcer = TokenEnforcer(_tokenizer_data(tokenizer, eos_token_ids), JsonSchemaParser(schema))
    except Exception as e:
        # its own words where it refuses a schema on purpose ("Unsupported type objectx": a plain
        # Exception or ValueError, one line); anything else is its internals, not the user's business
        said = str(e)
        why = f": {said}" if type(e) in (Exception, ValueError) and said and "\n" not in said and len(said) < 200 else ""
        raise SpeculantError(f"unusable JSON schema{why}: give a JSON Schema object of the types object, array, "
                             "string, number, integer, boolean or null") from None
    return allowed_tokens_processor(lambda ids: enforcer.get_allowed_tokens(ids).allowed_tokens)
