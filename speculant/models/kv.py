"""A batch's KV cache in which rows may accept different numbers of tokens.

Each row owns a set of *valid* cache slots; the attention mask hides the others. Rolling back a
rejected draft only marks its slots invalid (no copy), then trims the columns no row uses. With
batch 1 there are never holes: rollback is a plain crop. In a batch, holes left by rows that
accepted fewer tokens are squeezed out by ``compact`` once they waste too much attention work.

Positions come from each row's count of valid slots, so a row's tokens see exactly the positions
and the keys/values a fresh prefill of its accepted text would give.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from ..rows import PerRow
from . import invariant


@functools.cache
def cache_keyword(forward) -> str:
    """The keyword a forward takes its KV cache by: ``cache`` since transformers 5.2x renamed it
    (``past_key_values`` there warns, and is to go), ``past_key_values`` before (5.17 and older)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class KVState(PerRow):
    def __init__(self, model: torch.nn.Module, batch_size: int):
        from transformers import DynamicCache  # a second or more to import; a model of it is loaded by now

        self.model = model
        # every pass, the prefill too, on the width-invariant kernels: a row's bits do not depend on the
        # block width or the rows beside it (a model whose attention they cannot run keeps its own)
        self.invariant = invariant.supports_hf(model)
        self.cache = DynamicCache()
        device = next(model.parameters()).device
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)

    def block_width(self, width: int, room: int) -> int:
        """Draft columns to verify for ``width`` used ones (see StaticKVState): no padding here."""
        return width

    @property
    def length(self) -> int:
        """Number of cache columns (valid or not)."""
        return self.valid.shape[1]

    def lengths(self) -> torch.Tensor:
        """Valid tokens per row: the position the next token of each row will take."""
        return self.valid.sum(1)

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False,
               tree: tuple | None = None, taps: tuple = ()):
        """Run the model on ``tokens`` [B, w] after the cached context; returns logits [B, w or 1, V].
        ``tree``: (position offsets [B, w], visibility [B, w, w]) of a token-tree block (tree.py),
        given to the model as a 4-D mask over the cached columns and the block.
        ``taps``: also return those layers' hidden states, (logits, [B, w, len(taps), H]), as
        FastLlama.forward does (HF's output_hidden_states[L])."""
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        positions = self.lengths()[:, None] + (valid.cumsum(1) - 1).clamp_min(0)
        mask = torch.cat([self.valid, valid], dim=1)
        attention = mask.to(torch.long)
        if tree is not None:
            offsets, vis = tree
            positions = self.lengths()[:, None] + offsets
            B, w = tokens.shape
            sees = torch.cat([self.valid[:, None].expand(B, w, self.length), vis], dim=2)[:, None]
            dtype = next(self.model.parameters()).dtype
            attention = torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill(~sees, torch.finfo(dtype).min)
        # the last position as an index, not the int 1: HF then gathers a contiguous [B, 1, H] copy.
        # Its strided slice would make torch's matmul (aten should_fold) multiply a frozen LM head
        # as a bmm over B expanded copies of the weight: 21 GB and minutes for Gemma 3 at batch 64.
        kwargs = {"logits_to_keep": torch.tensor([tokens.shape[1] - 1], device=tokens.device)} if last_only else {}
        if taps:
            kwargs["output_hidden_states"] = True
        with invariant.hf_forward(self.model) if self.invariant else contextlib.nullcontext():
            out = self.model(
                input_ids=tokens,
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                **{cache_keyword(type(self.model).forward): self.cache},
                **kwargs,
            )
        self.block_start = self.length  # where this block's columns begin (keep_path)
        self.valid = mask
        dev = tokens.device  # a model split across devices (device_map) ends on another one
        if taps:
            return out.logits.to(dev), torch.stack([out.hidden_states[i].to(dev) for i in taps], 2)
        return out.logits.to(dev)

    def rollback(self, lengths: torch.Tensor) -> None:
        """Roll back: row b keeps only its first ``lengths[b]`` valid tokens."""
        self.valid = self.valid & (self.valid.cumsum(1) <= lengths[:, None].to(self.valid.device))
        self._trim()
        self._maybe_compact()

    def keep_path(self, start: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> None:
        """After a tree pass: of the block's columns keep the root and the accepted nodes 1 + path[:n]
        (their K/V were computed at the right positions; the others become holes)."""
        B, w = self.valid.shape[0], self.length - self.block_start
        steps = torch.arange(path.shape[1], device=path.device)[None]
        keep = torch.zeros(B, w, dtype=torch.bool, device=self.valid.device)
        keep[:, 0] = True
        rows = torch.arange(B, device=path.device)[:, None].expand_as(path)
        accepted = steps < n[:, None]
        keep[rows[accepted], (path + 1)[accepted]] = True
        self.valid[:, self.block_start :] &= keep
        self._trim()
        self._maybe_compact()

    # the cache's rows move with the valid slots' (PerRow: a join pads both in front, see below)
    def _select_more(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.cache.batch_select_indices(idx)
        self.valid = self.valid[idx]
        self._trim()

    @property
    def joins(self) -> bool:
        """Rows of another state can join when every layer keeps its whole cache (not a sliding window)."""
        return all(type(layer).__name__ == "DynamicLayer" for layer in self.cache.layers)

    def _join_more(self, other: "KVState") -> None:
        """Append ``other``'s rows: both padded to the same columns with invalid (hidden) slots in
        front; positions come from each row's valid count, so they are unchanged."""
        width = max(self.length, other.length)

        def front(t, n):  # n zero (hidden) columns in front of t's column axis (-2; -1 for the mask)
            if not n:
                return t
            axis = -1 if t.dim() == 2 else -2
            shape = list(t.shape)
            shape[axis] = n
            return torch.cat([t.new_zeros(shape), t], dim=axis)

        def rows(t, n):  # n rows of zero (hidden) columns, shaped as t's
            return t.new_zeros(n, *t.shape[1:-2], width, t.shape[-1])

        a, b = width - self.length, width - other.length
        mine, theirs = self._layers(), other._layers()
        if theirs and not mine:  # this state has not run yet (a lazy drafter's): the other's layers, rows in front
            self.cache = other.cache
            for layer in theirs:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    setattr(layer, name, torch.cat([rows(t, len(self.valid)), front(t, b)]))
        for m, t in zip(mine, theirs or [None] * len(mine)):  # (the other has not run yet: zero rows for it)
            for name in ("keys", "values"):
                x = getattr(m, name)
                y = rows(x, len(other.valid)) if t is None else front(getattr(t, name).to(x.device), b)
                setattr(m, name, torch.cat([front(x, a), y]))
        self.valid = torch.cat([front(self.valid, a), front(other.valid, b)])

    def _layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None]

    def _trim(self) -> None:
        used = self.valid.any(0).nonzero()
        new_len = int(used[-1]) + 1 if used.numel() else 0
        if new_len < self.length:
            self.valid = self.valid[:, :new_len]
            for layer in self._layers():
                layer.keys = layer.keys[..., :new_len, :]
                layer.values = layer.values[..., :new_len, :]

    def _maybe_compact(self) -> None:
        longest = int(self.lengths().max()) if self.valid.numel() else 0
        if self.length > longest * 5 // 4 + 32:
            self.compact()

    def compact(self) -> None:
        """Right-align every row's valid slots, dropping the holes (one gather per layer)."""
        longest = int(self.lengths().max())
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, -longest:]
        self.valid = self.valid.gather(1, order)
        for layer in self._layers():  # keys and values may differ in shape (MLA caches its latents)
            layer.keys = layer.keys.gather(2, _slot_index(order, layer.keys))
            layer.values = layer.values.gather(2, _slot_index(order, layer.values))

    def valid_kv(self, row: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one row's valid slots [H, n, D] (for tests of the rollback invariant)."""
        lay = self.cache.layers[layer]
        m = self.valid[row]
        return lay.keys[row][:, m], lay.values[row][:, m]


def _slot_index(order: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``order`` [B, n] (slots to keep, per row) as a gather index over t's slot axis [B, H, S, D]."""
    return order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]).to(t.device)
