"""Per-row state, declared once: a batch's components (KV states, drafters, sampling, the γ
control) name the attributes they keep one entry of per row, and ``PerRow.select`` / ``join`` keep
or append the rows of all of them. Rows leave a batch as they finish and another batch's rows join
it between passes (continuous batching); this is the one place both happen."""
from __future__ import annotations

import torch


class PerRow:
    """A component with per-row data. ``row_fields``: attributes holding one entry per row: a
    tensor (rows on dim 0), a list, a nested PerRow (its own rows), or None. ``layer_fields``:
    attributes holding a list (one per layer or step) of such values. A subclass with logic no field
    expresses (a cache moved in place) adds it in ``_select_more`` / ``_join_more``."""

    row_fields: tuple[str, ...] = ()
    layer_fields: tuple[str, ...] = ()
    # rows of another batch's component of the same kind can join this one's
    joins: bool = True

    def select(self, rows: list[int]) -> None:
        """Only these rows go on, in this order (the others finished)."""
        rows = list(rows)
        for name in self.row_fields:
            setattr(self, name, take(getattr(self, name), rows))
        for name in self.layer_fields:
            value = getattr(self, name)
            setattr(self, name, None if value is None else [take(v, rows) for v in value])
        self._select_more(rows)

    def join(self, other: "PerRow") -> None:
        """Append ``other``'s rows (the same kind of component, started on them) after this one's."""
        if not self.joins:
            raise NotImplementedError(f"{type(self).__name__} cannot take rows of another batch")
        for name in self.row_fields:
            setattr(self, name, concat(getattr(self, name), getattr(other, name)))
        for name in self.layer_fields:  # a layer at a time: each old one goes as its new one is made
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None:
                continue
            mine, theirs = list(mine), list(theirs)  # never lists another owner holds
            setattr(self, name, mine)
            setattr(other, name, None)
            for i in range(len(mine)):
                mine[i] = concat(mine[i], theirs[i])
                theirs[i] = None
        self._join_more(other)

    def _select_more(self, rows: list[int]) -> None:
        """What ``select`` does beyond the declared fields."""

    def _join_more(self, other: "PerRow") -> None:
        """What ``join`` does beyond the declared fields (after them)."""


def take(value, rows: list[int]):
    """``value``'s entries for ``rows``, in that order."""
    if value is None:
        return None
    if isinstance(value, PerRow):
        value.select(rows)
        return value
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(rows, dtype=torch.long, device=value.device)]
    return [value[r] for r in rows]


def concat(a, b):
    """``a``'s rows, then ``b``'s."""
    if a is None:
        return None
    if isinstance(a, PerRow):
        a.join(b)
        return a
    if isinstance(a, torch.Tensor):
        return cat_padded(a, b.to(a.device))
    return list(a) + list(b)


def cat_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` then ``b``; where their other dims differ (caches of different sizes), both
    are zero-padded at the end to the larger."""
    if a.shape[1:] == b.shape[1:]:
        return torch.cat([a, b])
    size = [max(x, y) for x, y in zip(a.shape[1:], b.shape[1:])]
    out = a.new_zeros(a.shape[0] + b.shape[0], *size)
    out[(slice(0, a.shape[0]), *(slice(0, n) for n in a.shape[1:]))] = a
    out[(slice(a.shape[0], None), *(slice(0, n) for n in b.shape[1:]))] = b
    return out
