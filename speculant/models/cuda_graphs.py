"""CUDA-graph capture of the fast path's forward: one graph per (cache, batch, block width, chain or tree).

Eager decoding of a small model on a GPU is bound by kernel launches and Python, not by memory;
replaying a captured graph launches the whole forward at once. The static KV cache makes every
step's shapes and addresses fixed, which is what capture needs: the inputs are copied into static
buffers, the graph replays, and the output buffer is returned (valid until the next replay).
"""
from __future__ import annotations

import torch


# draft columns a verify block is padded up to: one captured graph per block width (columns + 1)
WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 31)


def bucketed_width(width: int, room: int, max_block: int) -> int:
    """The draft columns to verify for ``width`` used ones: the next bucket, within ``room`` (the
    columns the cache and max_new_tokens allow) and ``max_block`` (wider blocks are not graphed),
    else ``width`` itself. Columns past every row's length are verified and ignored, like a
    batch's shorter rows."""
    if width == 0 or width + 1 > max_block:
        return width
    return max(width, min(next(b for b in WIDTH_BUCKETS if b >= width), room, max_block - 1))


class GraphedForward:
    def __init__(self, forward, warmup: int = 2, max_width: int = 32):
        self.forward = forward
        self.warmup = warmup
        self.max_width = max_width  # wider blocks (prefill) are compute-bound: run them eagerly
        self.graphs: dict[tuple, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, key, inputs, keys, values, last_only, taps):
        static = [t.clone() for t in inputs]  # tokens, positions, write_at (, tree visibility)

        def run():
            return self.forward(*static[:3], keys, values, last_only, tree=static[3] if len(static) > 3 else None,
                                taps=taps)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm-up runs write real K/V of this very step, which the replay below rewrites identically
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        self.graphs[key] = (graph, static, out)
        return self.graphs[key]

    def __call__(self, tokens, positions, write_at, keys, values, last_only=False, tree=None, taps=()):
        if tokens.shape[1] > self.max_width:
            return self.forward(tokens, positions, write_at, keys, values, last_only, tree=tree, taps=taps)
        inputs = [tokens, positions, write_at] + ([tree] if tree is not None else [])
        key = (tuple(t.data_ptr() for t in keys + values), tuple(tokens.shape), last_only, tree is not None, taps)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, inputs, keys, values, last_only, taps)
        graph, static, out = entry
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        return out

    def block_width(self, width: int, room: int) -> int:
        """A capture costs several forwards, so a controller moving among tree sizes would capture
        dozens of graphs: verify blocks are padded to a few widths (``bucketed_width``)."""
        return bucketed_width(width, room, self.max_width)

    def forget(self, keys, values) -> None:
        """Drop the graphs bound to a cache that is being freed."""
        ptrs = tuple(t.data_ptr() for t in keys + values)
        self.graphs = {k: v for k, v in self.graphs.items() if k[0] != ptrs}
