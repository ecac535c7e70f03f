"""Roll a KVState back by counting *valid* slots (KVState.keep counts columns, which is only right
when the rolled-back columns hold no holes; drafters that feed ragged, left-padded blocks need this)."""
from __future__ import annotations

import torch

from ..models.kv import KVState


def keep_valid_slots(state: KVState, start: int, counts: torch.Tensor | list[int]) -> None:
    """Of the columns from ``start`` on, row b keeps only its first ``counts[b]`` valid slots."""
    counts = torch.as_tensor(counts, device=state.valid.device)
    tail = state.valid[:, start:]
    rank = tail.to(torch.int64).cumsum(1)  # 1-based rank of each valid slot in the tail
    state.valid = torch.cat([state.valid[:, :start], tail & (rank <= counts[:, None])], dim=1)
    state._trim()
    state._maybe_compact()
