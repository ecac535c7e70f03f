"""CUDA-graph capture of the fast path's forward: one graph per (cache, batch, block width).

Eager decoding of a small model on a GPU is bound by kernel launches and Python, not by memory;
replaying a captured graph launches the whole forward at once. The static KV cache makes every
step's shapes and addresses fixed, which is what capture needs: the inputs are copied into static
buffers, the graph replays, and the output buffer is returned (valid until the next replay).
"""
from __future__ import annotations

import torch


class GraphedForward:
    def __init__(self, forward, warmup: int = 2, max_width: int = 32):
        self.forward = forward
        self.warmup = warmup
        self.max_width = max_width  # wider blocks (prefill) are compute-bound: run them eagerly
        self.graphs: dict[tuple, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, key, tokens, positions, write_at, keys, values, last_only):
        static = [tokens.clone(), positions.clone(), write_at.clone()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm-up runs write real K/V of this very step, which the replay below rewrites identically
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.forward(*static, keys, values, last_only)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(*static, keys, values, last_only)
        self.graphs[key] = (graph, static, out)
        return self.graphs[key]

    def __call__(self, tokens, positions, write_at, keys, values, last_only=False):
        if tokens.shape[1] > self.max_width:
            return self.forward(tokens, positions, write_at, keys, values, last_only)
        key = (tuple(t.data_ptr() for t in keys + values), tuple(tokens.shape), last_only)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, tokens, positions, write_at, keys, values, last_only)
        graph, static, out = entry
        static[0].copy_(tokens)
        static[1].copy_(positions)
        static[2].copy_(write_at)
        graph.replay()
        return out

    def forget(self, keys, values) -> None:
        """Drop the graphs bound to a cache that is being freed."""
        ptrs = tuple(t.data_ptr() for t in keys + values)
        self.graphs = {k: v for k, v in self.graphs.items() if k[0] != ptrs}
