"""Tree acceptance (verify.tree_*): exact enumeration for small vocabularies (deterministic trees,
i.i.d. sampled siblings, siblings sampled without replacement), the batched sampler against it by
chi-square, greedy on trees, and a wrong formula shown to fail."""
import itertools
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import speculant.verify as verify
from speculant.tree import block_layout, depths, tree_depth
from speculant.verify import chain_parents, greedy_verify, tree_greedy_verify, tree_sample_verify

V = 3
K = 3  # compare the first K output tokens (a pass of depth <= 2, then plain decoding)


def _target(seed):
    g = torch.Generator().manual_seed(seed)

    @lru_cache(maxsize=None)
    def p(prefix: tuple) -> torch.Tensor:
        d = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
        if len(prefix) == 1 and prefix[0] == 2:
            d[1] = 0.0  # a zero of p where q has mass
        return d / d.sum()

    return p


def _fit(outs: dict, exact: dict, B: int):
    """(how many samples fall where the exact law puts no mass, chi-square p-value over its support)."""
    keys = sorted(k for k in exact if exact[k] > 0)
    outside = sum(c for k, c in outs.items() if k not in keys)
    if outside:
        return outside, 0.0
    return 0, chisquare([outs.get(k, 0) for k in keys], [exact[k] * B for k in keys]).pvalue


def _one_hot(x):
    return torch.nn.functional.one_hot(torch.tensor(x), V).double()


def _pass_distribution(p, nodes, prefix=(), at=-1, r=None):
    """Exact P(output of one tree pass) as {tokens: prob}, by recursion with the library's own
    step (verify.sibling_step). nodes: list of (token, parent, q)."""
    r = p(prefix) if r is None else r
    out, remaining = {}, 1.0
    for i, (x, parent, q) in enumerate(nodes):
        if parent != at:
            continue
        a, rejected = verify.sibling_step(r[None], torch.tensor([x]), q[None])
        a = float(a[0])
        for seq, w in _pass_distribution(p, nodes, prefix + (x,), i).items():
            out[(x,) + seq] = out.get((x,) + seq, 0.0) + remaining * a * w
        remaining *= 1 - a
        r = rejected[0]
    for y in range(V):
        out[(y,)] = out.get((y,), 0.0) + remaining * float(r[y])
    return out


def _first_k(p, outputs):
    """Extend each pass output to K tokens with plain target decoding: P(y_1..y_K)."""
    dist = torch.zeros((V,) * K, dtype=torch.float64)
    for seq, w in outputs.items():
        for rest in itertools.product(range(V), repeat=K - len(seq)):
            full, prob = seq + rest, w
            for j in range(len(seq), K):
                prob *= float(p(full[:j])[full[j]])
            dist[full] += prob
    return dist


def _target_first_k(p):
    dist = torch.zeros((V,) * K, dtype=torch.float64)
    for full in itertools.product(range(V), repeat=K):
        dist[full] = float(torch.prod(torch.stack([p(full[:j])[full[j]] for j in range(K)])))
    return dist


def _q(g):
    d = torch.rand(V, generator=g, dtype=torch.float64) + 0.02
    d[0] = 0.0 if torch.rand(1, generator=g) < 0.3 else d[0]  # a zero of q where p has mass
    return d / d.sum()


def _sampled_trees(g, without_replacement: bool, siblings=2):
    """Every draw of a 2-level tree (``siblings`` root children, one child each) with its probability:
    [(prob, nodes)]. Children of a node are drawn i.i.d. from the drafter's q, or without replacement."""
    q_root = _q(g)
    q_child = {x: _q(g) for x in range(V)}
    trees = []
    for xs in itertools.product(range(V), repeat=siblings):
        prob, nodes, qs = 1.0, [], []
        q = q_root.clone()
        for x in xs:
            prob *= float(q[x])
            qs.append(q.clone())
            if without_replacement:  # the next sibling is drawn from q without the ones before
                q = q.clone()
                q[x] = 0.0
                if q.sum() == 0:
                    break
                q = q / q.sum()
        if prob == 0 or len(qs) < siblings:
            continue
        for x, qx in zip(xs, qs):
            nodes.append((x, -1, qx))
        # one child per sibling, drawn from q_child[x]
        for ys in itertools.product(range(V), repeat=siblings):
            w = prob * float(torch.prod(torch.tensor([q_child[x][y] for x, y in zip(xs, ys)])))
            if w:
                trees.append((w, nodes + [(y, i, q_child[x]) for i, (x, y) in enumerate(zip(xs, ys))]))
    return trees


@pytest.mark.parametrize("seed", range(3))
def test_deterministic_trees_reproduce_the_target_exactly(seed):
    p = _target(seed)
    oh = _one_hot
    trees = [
        [(0, -1, oh(0)), (1, -1, oh(1)), (2, 0, oh(2)), (0, 0, oh(0)), (1, 1, oh(1))],  # two branches
        [(2, -1, oh(2)), (1, 0, oh(1)), (2, 0, oh(2))],  # p(.|2) is zero where a child sits
        [(0, -1, oh(0)), (0, -1, oh(0))],  # duplicate siblings
        [(1, -1, oh(1)), (1, 0, oh(1))],  # a chain
    ]
    want = _target_first_k(p)
    for nodes in trees:
        got = _first_k(p, _pass_distribution(p, nodes))
        assert torch.allclose(got, want, atol=1e-12), (nodes, (got - want).abs().max())


@pytest.mark.parametrize("without_replacement", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_sampled_trees_reproduce_the_target_exactly(seed, without_replacement):
    p = _target(seed)
    g = torch.Generator().manual_seed(100 + seed)
    got = torch.zeros((V,) * K, dtype=torch.float64)
    for w, nodes in _sampled_trees(g, without_replacement):
        got += w * _first_k(p, _pass_distribution(p, nodes))
    want = _target_first_k(p)
    assert torch.allclose(got, want, atol=1e-12), (got - want).abs().max()


def test_a_wrong_sibling_rule_is_caught(monkeypatch):
    """Judging every sibling against p itself (no residual after a rejection) is not exact."""
    real = verify.sibling_step
    monkeypatch.setattr(verify, "sibling_step", lambda r, x, q: (real(r, x, q)[0], r))
    p = _target(0)
    nodes = [(0, -1, _one_hot(0)), (1, -1, _one_hot(1))]
    got = _first_k(p, _pass_distribution(p, nodes))
    assert (got - _target_first_k(p)).abs().max() > 1e-3


def test_tree_sampler_matches_the_exact_distribution_by_chi_square():
    """The batched sampler itself (sibling order, residual updates, descent, final draw) on a
    deterministic 2-level tree: its outputs (path + final token) follow the exact distribution."""
    p = _target(1)
    nodes = [(0, -1, _one_hot(0)), (1, -1, _one_hot(1)), (2, 0, _one_hot(2)), (0, 0, _one_hot(0)), (1, 1, _one_hot(1))]
    exact = _pass_distribution(p, nodes)
    B = 120_000
    tokens = torch.tensor([[x for x, _, _ in nodes]]).expand(B, -1)
    parents = torch.tensor([[par for _, par, _ in nodes]]).expand(B, -1)
    prefixes = [()] + [None] * len(nodes)
    for i, (x, par, _) in enumerate(nodes):
        prefixes[i + 1] = prefixes[par + 1] + (x,)
    probs = torch.stack([p(pre) for pre in prefixes])[None].expand(B, -1, -1)
    g = torch.Generator().manual_seed(0)
    n, nxt, path = tree_sample_verify(probs, tokens, parents, torch.full((B,), len(nodes)), None, g)
    outs = {}
    for b in range(B):
        seq = tuple(nodes[i][0] for i in path[b].tolist() if i >= 0) + (int(nxt[b]),)
        outs[seq] = outs.get(seq, 0) + 1
    outside, pvalue = _fit(outs, exact, B)
    assert outside == 0 and pvalue > 1e-3, (outside, pvalue)
    assert (n == (path >= 0).sum(1)).all()


def test_tree_sampler_with_a_wrong_rule_fails_the_chi_square(monkeypatch):
    real = verify.sibling_step
    monkeypatch.setattr(verify, "sibling_step", lambda r, x, q: (real(r, x, q)[0], r))
    p = _target(1)
    nodes = [(0, -1, _one_hot(0)), (1, -1, _one_hot(1))]
    monkeypatch.undo()
    exact = _pass_distribution(p, nodes)
    monkeypatch.setattr(verify, "sibling_step", lambda r, x, q: (real(r, x, q)[0], r))
    B = 60_000
    probs = torch.stack([p(()), p((0,)), p((1,))])[None].expand(B, -1, -1)
    _, nxt, path = tree_sample_verify(probs, torch.tensor([[0, 1]]).expand(B, -1),
                                      torch.tensor([[-1, -1]]).expand(B, -1), torch.full((B,), 2), None,
                                      torch.Generator().manual_seed(1))
    outs = {}
    for b in range(B):
        seq = tuple([0, 1][i] for i in path[b].tolist() if i >= 0) + (int(nxt[b]),)
        outs[seq] = outs.get(seq, 0) + 1
    outside, pvalue = _fit(outs, exact, B)
    assert outside > 0 or pvalue < 1e-6, (outside, pvalue)


def test_greedy_on_a_tree_follows_the_argmax_through_matching_children():
    # nodes: 0:a(root) 1:b(root) 2:c(under 0) 3:d(under 1) 4:e(under 3)
    tokens = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
    parents = torch.tensor([[-1, -1, 0, 1, 3], [-1, -1, 0, 1, 3]])
    # block positions: 0 root, i+1 node i
    choice = torch.tensor([[6, 0, 8, 0, 9, 4],    # root->6 (node 1) -> 8 (node 3) -> 9 (node 4) -> bonus 4
                           [5, 1, 0, 0, 0, 0]])   # root->5 (node 0) -> 1: no child carries it
    n, nxt, path = tree_greedy_verify(choice, tokens, parents, torch.tensor([5, 5]))
    assert n.tolist() == [3, 1] and nxt.tolist() == [4, 1]
    assert path[0, :3].tolist() == [1, 3, 4] and path[1, :1].tolist() == [0] and path[1, 1] == -1
    # padding nodes (beyond the row's length) are never accepted
    n, nxt, _ = tree_greedy_verify(choice, tokens, parents, torch.tensor([3, 5]))
    assert n[0] == 1 and nxt[0] == 8


def test_chains_give_the_same_answer_on_both_routes():
    g = torch.Generator().manual_seed(0)
    B, G = 64, 5
    draft = torch.randint(0, 4, (B, G), generator=g)
    choice = torch.randint(0, 4, (B, G + 1), generator=g)
    lengths = torch.randint(0, G + 1, (B,), generator=g)
    n1, t1 = greedy_verify(choice, draft, lengths)
    n2, t2, path = tree_greedy_verify(choice, draft, chain_parents(B, G), lengths)
    assert torch.equal(n1, n2) and torch.equal(t1, t2)
    for b in range(B):
        assert path[b, : n1[b]].tolist() == list(range(int(n1[b])))


# ---- the tree walks (tree.py, tree_greedy_verify) against a plain node-by-node reference -------


@st.composite
def _trees(draw):
    """A batch of best-first trees as drafters give them: row b's first lengths[b] nodes each under
    an earlier node or the root, padding after them under the root; tokens from a small vocabulary
    (so siblings share tokens), and a target choice per block position."""
    B, N = draw(st.integers(1, 4)), draw(st.integers(0, 9))
    lengths = [draw(st.integers(0, N)) for _ in range(B)]
    parents = [[draw(st.integers(-1, i - 1)) if i < n else -1 for i in range(N)] for n in lengths]
    tokens = [[draw(st.integers(0, 2)) for _ in range(N)] for _ in range(B)]
    choice = [[draw(st.integers(0, 2)) for _ in range(N + 1)] for _ in range(B)]
    return parents, lengths, tokens, choice


@settings(max_examples=300, deadline=None)
@given(_trees())
def test_tree_walks_equal_a_node_by_node_reference(tree):
    parents, lengths, tokens, choice = tree
    B, N = len(parents), len(parents[0])

    def lineage(row, i):  # node i, then its ancestors up to the root's child
        return [i] + (lineage(row, row[i]) if row[i] >= 0 else [])

    want_depth = [[len(lineage(row, i)) for i in range(N)] for row in parents]
    want_anc = [[[j in lineage(row, i) for j in range(N)] for i in range(N)] for row in parents]
    P = torch.tensor(parents, dtype=torch.long).view(B, N)
    L = torch.tensor(lengths)
    assert depths(P).tolist() == want_depth
    assert tree_depth(P, L).tolist() == [max(d[:n], default=0) for d, n in zip(want_depth, lengths)]
    offsets, vis = block_layout(P)
    assert offsets.tolist() == [[0] + d for d in want_depth]
    assert vis.tolist() == [[[True] + [False] * N] + [[True] + a for a in anc] for anc in want_anc]
    n, nxt, path = tree_greedy_verify(torch.tensor(choice).view(B, N + 1), torch.tensor(tokens).view(B, N), P, L)
    for b in range(B):  # from the root, the first real child carrying the target's choice, while one exists
        node, walk = -1, []
        while (child := next((c for c in range(lengths[b]) if parents[b][c] == node
                              and tokens[b][c] == choice[b][node + 1]), None)) is not None:
            node = child
            walk.append(child)
        assert path[b].tolist() == walk + [-1] * (N - len(walk))
        assert (int(n[b]), int(nxt[b])) == (len(walk), choice[b][node + 1])


# ---- greedy acceptance in one kernel call (verify.greedy_accept) against argmax + the walks ---------


@pytest.fixture(scope="module")
def accept_kernel():
    from speculant.models import quantized

    module = quantized.kernels()
    if module is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    return module.greedy_accept


@settings(max_examples=300, deadline=None)
@given(_trees(), st.integers(0, 2**31 - 1), st.booleans())
def test_greedy_accept_is_the_argmax_then_the_walk(accept_kernel, tree, seed, chain):
    """The kernel's one call gives what the argmax and ``greedy_verify`` / ``tree_greedy_verify``
    give, on trees and on chains (parents None), with ties among the scores (the first wins) and
    rows shorter than the block; without the kernel, ``greedy_accept`` is those very calls."""
    parents, lengths, tokens, _ = tree
    B, N = len(parents), len(parents[0])
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-2, 2, (B, N + 1, 3), generator=g).float()  # V = 3, many ties
    P = None if chain else torch.tensor(parents, dtype=torch.long).view(B, N)
    T, L = torch.tensor(tokens, dtype=torch.long).view(B, N), torch.tensor(lengths)
    choice = scores.max(-1).indices
    want = (*greedy_verify(choice, T, L), None) if chain else tree_greedy_verify(choice, T, P, L)
    got = accept_kernel(scores, T, torch.empty(0, dtype=torch.long) if chain else P, L)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if not chain:
        assert torch.equal(got[2], want[2])
    saved = verify._compiled_greedy_accept
    try:
        for fn in (accept_kernel, None):  # through verify.greedy_accept: the kernel's, then the fallback
            verify._compiled_greedy_accept = fn
            out = verify.greedy_accept(scores, T, P, L)
            assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
            assert out[2] is None if chain else torch.equal(out[2], want[2])
    finally:
        verify._compiled_greedy_accept = saved


def test_greedy_accept_on_a_vocabulary_with_nan(accept_kernel):
    """Real widths: a 49k vocabulary, a NaN (the first NaN is the argmax, as PyTorch's), a batch of 3."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 4, 49152, generator=g)
    scores[1, 2, 777] = float("nan")
    choice = scores.max(-1).indices
    tokens = choice[:, :3].clone()
    tokens[0, 1] += 1  # row 0 rejects its second draft; row 1 accepts all three, row 2 both of its two
    L = torch.tensor([3, 3, 2])
    n, nxt, path = accept_kernel(scores, tokens, torch.empty(0, dtype=torch.long), L)
    assert n.tolist() == [1, 3, 2] and nxt.tolist() == [choice[0, 1], choice[1, 3], choice[2, 2]]
    assert path.tolist() == [[0, -1, -1], [0, 1, 2], [0, 1, -1]] and choice[1, 2] == 777
