"""Width-invariant kernels: a row of the forward gets the same bits however many rows share the call.

Plain decoding computes one token a pass; speculative decoding verifies a block of γ+1 tokens or a
token tree in one pass, and a server computes many requests' rows together. The text is the model's
own only if each row's logits have the same bits in all three, which floating point does not give
for free: a matmul kernel may sum a dot product in another order for 16 rows than for 1 (oneDNN's
bf16 GEMM on an AVX512-BF16 EPYC does for 1,536 inputs: one row differs from two or more), and an
attention kernel may split its keys or lanes by the number of queries or keys. Near-ties then flip.

What this module gives, each checked once per machine and shape on random data (the results kept
in ``checks_file()``):

- ``Rows(lo, hi)``: a matmul is called with ``lo``..``hi`` (at most 64) rows only, fewer padded with
  zero rows, more cut into calls of ``hi``: a window in which the check found every row's bits equal
  to a one-row call's, whatever the width and the row's place in the call. ``Rows(1, 1)`` (a call a
  row) is exact by construction: the fallback where no window holds.
- ``Attention``: softmax attention over each query's visible keys in *text order* (a tree node's
  keys gathered to prefix + its path: ``KeyLayout``), so every sum over keys meets a node's keys as
  its path decoded token by token does. On a CPU the compiled kernel (``cpu_attention``) computes
  each query alone, exact by construction; else, in PyTorch ops, HF's eager formula in one matmul
  (``batched``) or in 64-key blocks summed in order (``tiled``), each query's row padded to at least
  a block so that no reduction takes another route for a short row, whichever the check finds
  invariant for chains and for trees; failing all, each query alone (``per-query``).

One-token steps run these very functions with one row, so plain decoding is their reference; the
general path (``hf_forward``) puts them under a Hugging Face model's own forward.
"""
from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_attention
from .cpu_kernels import machine_key
from .loading import cache_dir

CHECKS_VERSION = 10  # bump when a check or a kernel it judges changes: cached results are then redone
KEY_BLOCK = 64  # key columns are padded to a multiple of this (at least one block)
# row counts each matmul is checked at: every one to 17, then around the blocks of 8/16/32 kernels
# tile by, and past 64 (cut into calls)
WIDTHS = tuple(range(1, 18)) + (20, 24, 31, 32, 33, 40, 47, 48, 49, 56, 63, 64, 80, 130)
WINDOW_LOWS = (1, 2, 4, 8, 16, 32, 64)  # candidate lower bounds, cheapest first
WINDOW_HIGH = 64


@dataclass(frozen=True)
class Rows:
    """Calls of ``lo``..``hi`` rows: fewer are padded with zero rows, more cut into calls of ``hi``."""

    lo: int = 1
    hi: int = 64

    def __call__(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn`` over ``x`` [..., M, K] (rows on the second-last axis), in calls of lo..hi rows."""
        m = x.shape[-2]
        if self.lo <= m <= self.hi:
            return fn(x)
        if m < self.lo:
            return fn(F.pad(x, (0, 0, 0, self.lo - m)))[..., :m, :]
        return torch.cat([self(fn, x[..., i : i + self.hi, :]) for i in range(0, m, self.hi)], -2)

    def describe(self) -> str:
        if self.lo == self.hi:
            return f"{self.lo} row{'s' if self.lo > 1 else ''} a call"
        return f"{self.lo}-{self.hi} rows a call"


WIDE = Rows(1, WINDOW_HIGH)  # any width up to 64 rows a call (the widths the checks cover)


class FLinear:
    """``F.linear`` over a weight, with its shape at hand (like cpu_kernels.PackedLinear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowLinear:
    """A linear layer's kernel (``F.linear`` or a packed one) called within its ``Rows`` window."""

    def __init__(self, fn, rows: Rows = WIDE):
        self.fn, self.rows = fn, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.rows(self.fn, x.reshape(-1, x.shape[-1])).view(*lead, -1)


def _cancelling_inputs(rows: int, in_features: int, out_features: int, dtype, device, seed: int = 0):
    """Inputs whose dot products are small differences of large partial sums: x = [a, a], w = [v, -v']
    with v' within 1% of v. A kernel that sums in another order then changes the rounded result
    in most outputs (with plain random data a bf16 rounding hides most reorderings)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    half = in_features // 2
    a = torch.randn(rows, half, generator=g)
    v = torch.randn(out_features, half, generator=g)
    v2 = -(v * (1 + 0.01 * torch.randn(out_features, half, generator=g)))
    rest = in_features - 2 * half
    x = torch.cat([a, a, torch.randn(rows, rest, generator=g)], 1)
    w = torch.cat([v, v2, torch.randn(out_features, rest, generator=g)], 1)
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def rows_hold(fn, x: torch.Tensor, rows: Rows, widths=WIDTHS) -> bool:
    """Whether ``fn`` within ``rows`` gives every row of every width the bits of a one-row call.
    Narrowest width first, each row's one-row call made when a width first needs it: a window that
    fails does so within a few rows, and its one-row calls of 130 rows were most of a first run's
    checks (a 262k-token LM head: ~85 s of Gemma 3 270M's first request on a 2-core Zen 4). Rows are
    compared where they lie (joining the one-row results at every width copied ~1 GB for that head)."""
    alone: list[torch.Tensor] = []
    for m in sorted(w for w in widths if w <= x.shape[0]):
        alone += [rows(fn, x[i : i + 1]) for i in range(len(alone), m)]
        block = rows(fn, x[:m])
        if not all(torch.equal(block[i : i + 1], alone[i]) for i in range(m)):
            return False
    return True


WINDOWS = tuple(Rows(lo, WINDOW_HIGH) for lo in WINDOW_LOWS)  # candidates, cheapest first


def choose_rows(fn, x: torch.Tensor, widths=WIDTHS) -> Rows:
    """The cheapest window in which ``fn`` is width-invariant on ``x`` (rows of sensitive data):
    calls of lo..64 rows for the smallest lo that holds, else a call a row."""
    for rows in WINDOWS:
        if rows_hold(fn, x, rows, widths):
            return rows
    return Rows(1, 1)


def _device_key(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}|torch {torch.__version__}|cuda {torch.version.cuda}"
    return machine_key()


def checks_file():
    return cache_dir() / "width-checks.json"


def _checked(key: tuple, device: str, run, encode, decode):
    """A check's result, from this machine's entry in ``checks_file()`` or run now and stored there
    (the checks take a second or two for a model's shapes; delete the file to check again)."""
    name, machine = "|".join(map(str, (CHECKS_VERSION, *key))), _device_key(device)
    try:
        entry = json.loads(checks_file().read_text()).get(machine, {}).get(name)
        if entry is not None:
            return decode(entry)
    except (OSError, ValueError, TypeError, KeyError):
        pass
    result = run()
    try:
        data = json.loads(checks_file().read_text()) if checks_file().exists() else {}
        data.setdefault(machine, {})[name] = encode(result)
        checks_file().parent.mkdir(parents=True, exist_ok=True)
        tmp = checks_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(checks_file())
    except (OSError, ValueError):
        pass  # an unwritable cache: check again next time
    return result


_WINDOWS: dict[tuple, Rows] = {}


def describe_windows(windows: dict) -> str:
    """{(..., in, out, bias): Rows} as the most common window and the shapes that need another."""
    common = max(set(windows.values()), key=list(windows.values()).count)
    others = [f"{k[-3]}->{k[-2]} {r.describe()}" for k, r in sorted(windows.items(), key=str) if r != common]
    return common.describe() + (f" ({'; '.join(others)})" if others else "")


def linear_rows(kind: str, make, dtype: torch.dtype, in_features: int, out_features: int, bias: bool,
                device: str = "cpu") -> Rows:
    """The ``Rows`` window of a linear kernel on this machine, checked once per kernel and shape.
    ``make(weight, bias)`` builds the kernel (``kind`` names it for the cache); the data cancel so
    that any change of summation order shows."""
    key = ("linear", kind, dtype, in_features, out_features, bias, device)

    def run():
        x, w = _cancelling_inputs(max(WIDTHS), in_features, out_features, dtype, device)
        b = torch.randn(out_features, generator=torch.Generator().manual_seed(1)) if bias else None
        return choose_rows(make(w, None if b is None else b.to(device=device, dtype=dtype)), x)

    if key not in _WINDOWS:
        _WINDOWS[key] = _checked(key, device, run, lambda r: [r.lo, r.hi], lambda e: Rows(*e))
    return _WINDOWS[key]


# ---------------------------------------------------------------------------------------------------
# attention


@dataclass
class KeyLayout:
    """Which keys each query sees, in text order: shared by every layer of a pass.

    ``span``: the leading cache slots the pass reads (at least KEY_BLOCK); ``width``: softmax columns, a multiple of
    KEY_BLOCK covering them; ``mask``: additive [B, 1, 1, T, width] of ``dtype``, 0 for each query's first
    ``count`` columns, the dtype's lowest value after; ``order``: [B, T, width] the cache slot of each column (a
    permutation of 0..width-1), or None where column j is slot j (a chain in a static cache)."""

    span: int
    width: int
    count: torch.Tensor  # [B, T] visible keys per query
    dtype: torch.dtype
    order: torch.Tensor | None = None
    static: bool = False  # span fixed by the caller (the whole cache: CUDA graphs' static shapes)
    shared_blocks: int = 0  # with an order: leading key blocks that are the same slots for every query

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """Made where an attention in PyTorch ops asks (the compiled kernel reads ``count``: a pass
        over it makes none)."""
        cols = torch.arange(self.width, device=self.count.device)
        mask = torch.zeros(*self.count.shape, self.width, dtype=self.dtype, device=self.count.device)
        # the dtype's lowest value, as HF's eager mask: a query that sees nothing (a padding column) gets
        # a uniform softmax instead of NaNs, which would reach other rows through the cache's values
        return mask.masked_fill(cols >= self.count[..., None], torch.finfo(self.dtype).min)[:, None, None]

    def row(self, b: int, t: int, order: bool = True) -> "KeyLayout":
        """Query (b, t)'s own layout (with a static span)."""
        o = self.order[b : b + 1, t : t + 1] if order and self.order is not None else None
        return KeyLayout(self.span, self.width, self.count[b : b + 1, t : t + 1], self.dtype, o, self.static,
                         self.shared_blocks)


def key_layout(count: torch.Tensor, dtype: torch.dtype, visible: torch.Tensor | None = None,
               span: int | None = None, most: int | None = None) -> KeyLayout:
    """The layout for queries that see ``count`` [B, T] keys: slots 0..count-1 (``visible`` None), or
    the slots where ``visible`` [B, T, span] is True, taken in slot order (a tree node's ancestors
    come before it, so slot order is text order). ``span``: the slots to read (default: as few as
    hold every visible key; a static one keeps CUDA graphs' shapes). ``most``: ``count``'s largest
    entry where the caller knows it (a pass's, read once)."""
    static = span is not None
    if span is None:  # at least a block: a matmul over a few keys may take another route
        if most is None:
            most = int(count.max()) if count.numel() else 1
        span = max(most, KEY_BLOCK)
        if visible is not None:
            span = max(span, visible.shape[-1])
    width = key_width(span)
    order, shared = None, 0
    if visible is not None:
        visible = F.pad(visible, (0, width - visible.shape[-1]))
        # visible slots first in slot order, then the rest: a permutation, so the scatter back is exact
        order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
        if not static:  # the leading blocks where column j is slot j for every query (a tree's prefix)
            moved = order != torch.arange(width, device=count.device)
            first = torch.where(moved.any(-1), moved.to(torch.int8).argmax(-1), width)
            shared = int(first.min()) // KEY_BLOCK
    return KeyLayout(span, width, count, dtype, order, static, shared)


def key_width(span: int) -> int:
    """Softmax columns for ``span`` slots: a multiple of KEY_BLOCK."""
    return -(-span // KEY_BLOCK) * KEY_BLOCK


def tree_key_layout(start: torch.Tensor, tree: torch.Tensor, slots: int, dtype: torch.dtype, static: bool = False,
                    kernels=None) -> KeyLayout:
    """``key_layout`` for a token tree's block of w nodes written from slot ``start`` [B]: query t sees
    every slot before the block and the block slots s where ``tree`` [B, w, w] says so; ``slots``: the
    cache slots the pass reads (``static``: all of them, as ``key_layout``'s span). With ``kernels``
    (the CPU kernels, not static) their ``tree_layout`` makes the same order and counts in one call,
    where the visibility's gather and the sort below took ~0.3 ms of a tree pass; the leading blocks
    every query shares are then counted up to the block's start only."""
    if kernels is not None and not static:
        span = max(slots, KEY_BLOCK)
        width = key_width(span)
        order, count = kernels.tree_layout(start, tree, width)
        return KeyLayout(span, width, count, dtype, order, False, int(start.min()) // KEY_BLOCK)
    B, w = tree.shape[:2]
    rel = torch.arange(slots, device=tree.device)[None, None, :] - start[:, None, None]  # slot - block start
    visible = (rel < 0) | (tree.gather(2, rel.clamp(0, w - 1).expand(B, w, slots)) & (rel < w))
    return key_layout(visible.sum(-1), dtype, visible, span=slots if static else None)


def _scores(q, keys, layout: KeyLayout, scaling: float, rows: Rows):
    """Scaled, masked scores [B, Hkv, g, T, width] in text order: the g query heads of a kv head and
    the T queries as the rows of one matmul against the ``span`` slots (no repeated K)."""
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    g = H // Hkv
    k = keys[:, :, : layout.span]
    if k.shape[2] < layout.span:  # a cache shorter than a block (the general path's): masked zeros
        k = F.pad(k, (0, 0, 0, layout.span - k.shape[2]))
    kt = k.transpose(-1, -2)
    s = rows(lambda x: x @ kt, q.reshape(B, Hkv, g * T, D)).view(B, Hkv, g, T, layout.span)
    if layout.width > layout.span:
        s = F.pad(s, (0, layout.width - layout.span), value=float("-inf"))
    if layout.order is not None:  # only the columns past the blocks every query shares move
        c = layout.shared_blocks * KEY_BLOCK
        order = layout.order[:, None, None, :, c:] - c
        s = torch.cat([s[..., :c], s[..., c:].gather(-1, order.expand(B, Hkv, g, T, layout.width - c))], -1)
    return torch.add(layout.mask, s, alpha=scaling)  # scaled and masked in one op


def _attend(q, keys, values, layout: KeyLayout, scaling: float, rows: Rows = WIDE, tiles: bool = False):
    """q [B, H, T, D]; keys/values [B, Hkv, S, D]. Softmax attention over each query's keys in text
    order (the softmax in the activation dtype, float32 inside, as HF's eager attention rounds it),
    every matmul within ``rows``. The probabilities meet the values in one matmul over the span
    (``tiles`` False: a tree's probabilities scattered back to their slots) or block by block
    (``tiles``: KEY_BLOCK keys a matmul, a tree's blocks from where its keys begin gathered into text
    order for each query, the partial outputs summed in order in float32), so that every sum has
    the same shape for a query whatever else the pass holds."""
    B, H, T, D = q.shape
    Hkv, K = keys.shape[1], KEY_BLOCK
    g, W, nb = H // Hkv, layout.width, layout.width // KEY_BLOCK
    p = torch.softmax(_scores(q, keys, layout, scaling, rows), dim=-1)  # [B, Hkv, g, T, W]
    if not tiles:
        if layout.order is not None:
            p = torch.zeros_like(p).scatter_(-1, layout.order[:, None, None].expand(B, Hkv, g, T, W), p)
        v = values[:, :, : layout.span]
        if v.shape[2] < layout.span:
            v = F.pad(v, (0, 0, 0, layout.span - v.shape[2]))
        x = p[..., : layout.span].reshape(B, Hkv, g * T, layout.span)
        return rows(lambda t: t @ v, x).reshape(B, H, T, D)
    v = values[:, :, :W]
    if v.shape[2] < W:
        v = F.pad(v, (0, 0, 0, W - v.shape[2]))
    c0 = nb if layout.order is None else layout.shared_blocks  # blocks whose slots are every query's
    p, parts = p.view(B, Hkv, g, T, nb, K), []
    if c0:  # shared blocks: every (head, query) row against each block
        vb = v[:, :, : c0 * K].reshape(B, Hkv, c0, K, D)
        x = p[:, :, :, :, :c0].permute(0, 1, 4, 2, 3, 5).reshape(B, Hkv, c0, g * T, K)
        parts.append(rows(lambda t: t @ vb, x).view(B, Hkv, c0, g, T, D))
    if c0 < nb:  # a query's own blocks: its values gathered into text order
        n = nb - c0
        src = values if values.shape[2] >= W else v  # rows of the whole cache (a view of it would be copied)
        first = (torch.arange(B * Hkv, device=v.device) * src.shape[2]).view(B, Hkv, 1, 1)  # (b, head)'s slot 0
        vq = src.reshape(-1, D)[first + layout.order[:, None, :, c0 * K :]].view(B, Hkv, T, n, K, D)
        x = p[:, :, :, :, c0:].permute(0, 1, 3, 4, 2, 5)  # [B, Hkv, T, n, g, K]
        parts.append(rows(lambda t: t @ vq, x).permute(0, 1, 3, 4, 2, 5))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
    if nb > 1:  # block after block in float32 (a sum over this axis adds in order; zero blocks add nothing)
        out = out.float().sum(2).to(q.dtype)
    return out.reshape(B, H, T, D)


def _attend_tiled(q, keys, values, layout: KeyLayout, scaling: float, rows: Rows = WIDE):
    return _attend(q, keys, values, layout, scaling, rows, tiles=True)


def _attend_per_query(q, keys, values, layout: KeyLayout, scaling: float, rows: Rows = WIDE, alone=None):
    """Each query alone over its own keys gathered into text order: the one-token step itself (over
    exactly its n keys, or with a static span over the span, visible keys first), computed by
    ``alone`` (the chain attention, which one-token steps run; default ``_attend``)."""
    alone = alone or _attend
    B, H, T, D = q.shape
    out = q.new_empty(B, H, T, D)
    counts = None if layout.static else layout.count.tolist()
    for b in range(B):
        for t in range(T):
            n = layout.span if counts is None else counts[b][t]
            if layout.order is None:
                k, v = keys[b : b + 1, :, :n], values[b : b + 1, :, :n]
            else:
                slots = layout.order[b, t, :n]
                k, v = keys[b : b + 1, :, slots], values[b : b + 1, :, slots]
            one = layout.row(b, t, order=False) if counts is None else key_layout(layout.count.new_full((1, 1), n),
                                                                                  layout.dtype)
            out[b : b + 1, :, t : t + 1] = alone(q[b : b + 1, :, t : t + 1], k, v, one, scaling, rows)
    return out


@dataclass(frozen=True)
class Attention:
    """How a pass attends, for chains (each query sees the slots up to its own) and for token trees
    (keys gathered into text order): all queries at once (``batched``) or each alone
    (``per-query``), the matmuls within ``rows``."""

    chain: tuple[str, Rows] = ("batched", WIDE)
    tree: tuple[str, Rows] = ("batched", WIDE)

    def __call__(self, q, keys, values, layout: KeyLayout, scaling: float):
        how, rows = self.chain if layout.order is None else self.tree
        if how == "per-query":  # each query as the one-token step (a chain of one) computes it
            how, rows = self.chain if self.chain[0] != "per-query" else ("batched", rows)
            return _attend_per_query(q, keys, values, layout, scaling, rows, MODES[how])
        return MODES[how](q, keys, values, layout, scaling, rows)

    def describe(self) -> str:
        def one(how, rows):
            return "compiled per-query kernel" if how == "kernel" else f"{how} ({rows.describe()})"

        if self.chain == self.tree:
            return one(*self.chain)
        return f"chains {one(*self.chain)}; trees {one(*self.tree)}"


def _cpu_kernel():
    return cpu_attention.kernel()


def _attend_kernel(q, keys, values, layout: KeyLayout, scaling: float, rows: Rows = WIDE):
    """The compiled CPU kernel (cpu_attention): each query alone by construction."""
    return cpu_attention.attend(q, keys, values, layout.order, layout.count, scaling)


MODES = {"kernel": _attend_kernel, "batched": _attend, "tiled": _attend_tiled, "per-query": _attend_per_query}


def _random_tree(depth_of: list[int]) -> list[int]:
    """Parents (-1: the block's first token) for nodes whose depths are given, ancestors first."""
    parents, last_at = [], {0: -1}
    for i, d in enumerate(depth_of):
        parents.append(last_at[d - 1] if d - 1 in last_at else -1)
        last_at[d] = i
    return parents


# (prefix, block width) of the check's batches: short and long contexts (a kernel may block its sums
# by the number of keys), blocks up to the widest a CPU verifies and past 32 queries
CONTEXTS = ((3, 2), (3, 16), (40, 2), (40, 5), (40, 16), (40, 33), (70, 5), (70, 33), (200, 16), (200, 33),
            (600, 5), (1500, 5), (1500, 16))


def attention_holds(fn, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: str = "cpu",
                    kinds=("chain", "tree")) -> bool:
    """Whether attention ``fn`` (an ``Attention``) gives every query of chain blocks and token trees,
    beside rows of other lengths, the bits of that query decoded alone over exactly its own keys.
    On a GPU the blocks read the whole (static) cache, as CUDA graphs do there."""
    span = None if device == "cpu" else -1
    g = torch.Generator().manual_seed(2)
    scale = head_dim ** -0.5

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device=device, dtype=dtype)

    def same_alone(got, q, k, v, n):
        one = key_layout(torch.full((1, 1), n, device=device), dtype)
        return torch.equal(got, fn(q, k[:, :, :n], v[:, :, :n], one, scale))

    for prefix, w in CONTEXTS:
        B, S = 3, -(-(prefix + w + 10) // KEY_BLOCK) * KEY_BLOCK
        q, k, v = rand(B, heads, w, head_dim, s=3.0), rand(B, kv_heads, S, head_dim), rand(B, kv_heads, S, head_dim)
        starts = [prefix, prefix + 7, max(prefix - 2, 0)]
        if "chain" in kinds:  # row b's block at slots starts[b].., each query sees the slots up to its own
            count = torch.tensor(starts, device=device)[:, None] + 1 + torch.arange(w, device=device)[None]
            got = fn(q, k, v, key_layout(count, dtype, span=span and S), scale)
            if not all(same_alone(got[b : b + 1, :, t : t + 1], q[b : b + 1, :, t : t + 1], k[b : b + 1],
                                  v[b : b + 1], int(count[b, t])) for b in range(B) for t in range(w)):
                return False
        if "tree" in kinds:  # node t sees the prefix, the root and its ancestors (slots in order)
            depths = sorted(1 + int(x) for x in torch.randint(0, 4, (w - 1,), generator=g))
            parents = _random_tree(depths)
            vis = torch.zeros(B, w, S, dtype=torch.bool, device=device)
            for b, L in enumerate(starts):
                vis[b, :, : L + 1] = True
                for t in range(1, w):
                    node = t - 1
                    while node >= 0:
                        vis[b, t, L + 1 + node] = True
                        node = parents[node]
            got = fn(q, k, v, key_layout(vis.sum(-1), dtype, vis, span=span and S), scale)
            for b in range(B):
                for t in range(w):
                    slots = vis[b, t].nonzero().squeeze(1)
                    if not same_alone(got[b : b + 1, :, t : t + 1], q[b : b + 1, :, t : t + 1],
                                      k[b : b + 1, :, slots], v[b : b + 1, :, slots], len(slots)):
                        return False
    return True


@functools.cache
def attention_choice(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: str = "cpu") -> Attention:
    """The cheapest attention this machine's kernels keep width-invariant for this shape, for chains
    and for trees: all queries at once (the matmuls within the first rows window that holds), in
    fixed-shape tiles, else each query alone (exact by construction)."""
    compiled = device == "cpu" and _cpu_kernel() is not None  # a choice made with the kernel needs it
    return _checked(("attention", dtype, heads, kv_heads, head_dim, device, compiled), device,
                    lambda: _choose_attention(dtype, heads, kv_heads, head_dim, device),
                    lambda a: [[a.chain[0], a.chain[1].lo, a.chain[1].hi], [a.tree[0], a.tree[1].lo, a.tree[1].hi]],
                    lambda e: Attention((e[0][0], Rows(*e[0][1:])), (e[1][0], Rows(*e[1][1:]))))


def _choose_attention(dtype, heads, kv_heads, head_dim, device) -> Attention:
    """Chains first (one-token steps are chains of one: every mode is judged against them), then trees."""
    candidates = [("tiled", rows) for rows in WINDOWS] + [("batched", rows) for rows in WINDOWS]
    if device == "cpu" and head_dim <= 256 and _cpu_kernel() is not None:
        candidates.insert(0, ("kernel", WIDE))  # exact by construction; the check runs all the same

    def holds(chain, tree, kind):
        try:
            return attention_holds(Attention(chain, tree), dtype, heads, kv_heads, head_dim, device, (kind,))
        except RuntimeError:  # a kernel that refuses this shape
            return False

    first = None
    for chain in (m for m in candidates if holds(m, m, "chain")):
        first = first or chain
        # the cheapest chain mode under which trees need not run a query at a time
        tree = next((m for m in candidates if holds(chain, m, "tree")), None)
        if tree is not None:
            return Attention(chain, tree)
    return Attention(first or ("per-query", Rows(1, 1)), ("per-query", Rows(1, 1)))


# ---------------------------------------------------------------------------------------------------
# the general path: a Hugging Face model's own forward, with these kernels swapped in


HF_ATTENTION = "speculant_invariant"
QUERY_CHUNK = 256  # queries a call attends at once (a long prompt's scores stay small)


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: the invariant attention over the keys HF's mask shows.
    query [B, H, T, D], key/value [B, Hkv, S, D]; the mask bool [B, 1, T, S] (True: attend) or None
    (causal, aligned to the end)."""
    B, H, T, D = query.shape
    S = key.shape[2]
    cols = torch.arange(S, device=query.device)
    if attention_mask is None:
        visible = (cols[None, None] <= (S - T + torch.arange(T, device=query.device))[None, :, None]).expand(B, T, S)
    else:
        m = attention_mask[:, 0].expand(B, T, S)
        visible = m if m.dtype == torch.bool else m == 0
    count = visible.sum(-1)
    prefix = bool((visible == (cols < count[..., None])).all())  # keys at slots 0..count-1: no gather
    scale = D ** -0.5 if scaling is None else scaling
    Dv = value.shape[-1]
    query, key, value = one_width(query, key, value)
    attend = attention_choice(query.dtype, H, key.shape[1], query.shape[-1], query.device.type)
    outs = []
    for t in range(0, T, QUERY_CHUNK):
        part = slice(t, t + QUERY_CHUNK)
        layout = key_layout(count[:, part], query.dtype, None if prefix else visible[:, part])
        outs.append(attend(query[:, :, part], key, value, layout, scale))
    return torch.cat(outs, 2)[..., :Dv].transpose(1, 2).contiguous(), None


def one_width(query, key, value):
    """Queries, keys and values padded with zero columns to one head width, for attention whose value
    heads are narrower or wider than its query/key heads (MLA: DeepSeek-V2/V3, Kimi K2, MiniCPM3).
    Every mode (and the compiled kernel) takes one width; zero columns change no score (q·k gains
    only zero terms) and give output columns of zeros, sliced off after, so the real columns are
    what the same attention gives at its own widths."""
    D, Dv = query.shape[-1], value.shape[-1]
    if D < Dv:
        query, key = F.pad(query, (0, Dv - D)), F.pad(key, (0, Dv - D))
    elif Dv < D:
        value = F.pad(value, (0, D - Dv))
    return query, key, value


class _RowLinears(torch.overrides.TorchFunctionMode):
    """Every ``F.linear`` within its rows window (checked once per shape, as the fast path's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = linear_rows("F.linear", FLinear, weight.dtype, weight.shape[1], weight.shape[0], bias is not None,
                               weight.device.type)
            return RowLinear(FLinear(weight, bias), rows)(x)
        return func(*args, **kwargs)


def supports_hf(model) -> bool:
    """Whether a Hugging Face model's forward can run on these kernels: attention through the
    attention interface, without logit soft-capping (which this attention does not apply)."""
    cfg = model.config
    return hasattr(cfg, "_attn_implementation") and not getattr(cfg, "attn_logit_softcapping", None)


@contextlib.contextmanager
def hf_forward(model):
    """Within: ``model``'s forward runs every matmul within its rows window and attends with the
    invariant attention (transformers' attention and mask interfaces), so each row of a call gets
    the bits it gets alone. The model's own attention setting comes back after."""
    # transformers: a second or more to import; a model of it is loaded by now
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, sdpa_mask)
    configs = [c for c in {id(c): c for c in _configs(model)}.values()]
    before = [c._attn_implementation for c in configs]
    # mixture-of-experts layers (DeepSeek, Qwen-MoE, ...): the eager experts, one F.linear per expert
    # over its tokens (within its rows window) added up in expert order; a grouped matmul sums each
    # expert's rows by how many tokens it got
    experts = [c for c in configs if getattr(c, "_experts_implementation", None) not in (None, "eager")]
    experts_before = [c._experts_implementation for c in experts]
    try:
        for c in configs:
            c._attn_implementation = HF_ATTENTION
        for c in experts:
            c._experts_implementation = "eager"
        with _RowLinears():
            yield
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation = b
        for c, b in zip(experts, experts_before):
            c._experts_implementation = b


def _configs(model):
    """The config of the model and of every submodule that keeps its own (multimodal wrappers)."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            yield cfg
