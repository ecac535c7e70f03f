"""The suffix structure behind --drafter suffix: counts equal brute-force substring counts after
inserts and removals, matching, best-first drafts, and the process-wide cache's eviction bound."""
import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from speculant.drafters.suffix import SharedOutputs
from speculant.drafters.suffix_trie import SuffixTrie

DEPTH = 5


def _path_count(trie, path):
    node = 0
    for tok in path:
        node = trie.child(node, tok)
        if node < 0:
            return 0
    return trie.count[node]


def _brute(seqs):
    counts = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + DEPTH) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def _check(trie, seqs):
    want = _brute(seqs)
    for path, n in want.items():
        assert _path_count(trie, path) == n, (path, n)
    # and nothing else is stored: the nodes are exactly the distinct substrings (plus the root)
    assert trie.nodes == len(want) + 1
    assert trie.tokens == sum(len(s) for s in seqs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=5), st.data())
def test_counts_are_substring_counts_through_inserts_and_removals(seqs, data):
    trie = SuffixTrie(DEPTH)
    for i, s in enumerate(seqs):  # inserted in pieces, as tokens arrive
        cut = data.draw(st.integers(0, len(s)))
        trie.extend(i, s[:cut])
        trie.extend(i, s[cut:])
    _check(trie, seqs)
    gone = data.draw(st.sets(st.integers(0, len(seqs) - 1)))
    for i in gone:
        trie.remove(i)
    _check(trie, [s for i, s in enumerate(seqs) if i not in gone])
    trie.extend("new", [1, 2, 3])  # freed nodes are reused soundly
    _check(trie, [s for i, s in enumerate(seqs) if i not in gone] + [[1, 2, 3]])


def test_match_and_own_matches_find_the_context_suffixes():
    trie = SuffixTrie(DEPTH)
    trie.extend("a", [1, 2, 3, 1, 2, 4])
    nodes = trie.match([9, 1, 2])
    assert len(nodes) == 2  # "2" and "1 2" occur, "9 1 2" does not
    assert [trie.count[n] for n in nodes] == [2, 2]
    own = trie.own_matches("a")
    assert [trie.count[n] for n in own] == [1, 1, 1, 1, 1]  # "4", "2 4", ... end only here


def test_drafts_are_best_first_and_follow_the_continuation_frequencies():
    trie = SuffixTrie(8)
    trie.extend("a", [1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 4, 8])
    node = trie.match([1, 2])[-1]
    d = trie.draft(node, 2, 10, 0.0)
    # after "1 2": "3" twice, "4" once; "3" was always followed by "7": its chance carries on
    assert d.tokens[:2] == [3, 7] and d.parents[:2] == [-1, 0]
    assert abs(d.probs[0] - 2 / 3) < 1e-9 and abs(d.probs[1] - 2 / 3) < 1e-9
    four = d.tokens.index(4)
    assert d.parents[four] == -1 and abs(d.probs[four] - 1 / 3) < 1e-9
    assert all(p < i for i, p in enumerate(d.parents))  # parents first: every prefix is a tree
    assert all(a >= b for a, b in zip(d.probs, d.probs[1:]))  # best first
    assert abs(d.score - sum(d.probs)) < 1e-12
    assert len(trie.draft(node, 2, 3, 0.0).tokens) == 3 and 4 not in trie.draft(node, 2, 10, 0.5).tokens


def test_the_shared_cache_stays_within_its_bound_and_evicts_the_least_recently_written():
    cache = SharedOutputs(max_depth=6, max_tokens=200)
    rng = random.Random(0)
    for i in range(40):
        cache.extend(("seq", i), [rng.randrange(50) for _ in range(30)], prompt_key=i % 3)
        assert cache.trie.tokens <= 200 or len(cache.order) == 1
    assert ("seq", 39) in cache.order and ("seq", 0) not in cache.order
    cache.extend(("seq", 35), [1, 2, 3])  # written again: now the most recent
    assert list(cache.order)[-1] == ("seq", 35)
    cache.forget_prompt(0)
    assert all(key != 0 for key in cache.order.values())
    total = sum(len(cache.trie.seqs[s]) for s in cache.order)
    assert cache.trie.tokens == total


def test_memory_per_token_is_small():
    import tracemalloc

    rng = random.Random(1)
    text = [rng.randrange(3000) for _ in range(4000)]
    tracemalloc.start()
    trie = SuffixTrie(32)
    trie.extend("a", text)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert used / len(text) < 2000, f"{used / len(text):.0f} bytes per token"
