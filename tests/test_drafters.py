"""Model-free drafters checked against brute-force references (CPU, deterministic, fast)."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from leapdecode.spec.auto import AutoDrafter
from leapdecode.spec.drafter import Draft, DraftRequest
from leapdecode.spec.index import SENTINEL, NgramIndex, continuation
from leapdecode.spec.ngram import NgramDrafter
from leapdecode.spec.recycling import DEFAULT_RANK_PROBS, RecyclingDrafter, static_tree
from leapdecode.spec.registry import METHODS, MODEL_METHODS, make_drafter
from leapdecode.spec.suffix import SuffixDrafter, expand_continuations
from leapdecode.spec.compiled import CompiledIndex, core

needs_compiled = pytest.mark.skipif(core() is None, reason="the compiled suffix index does not build here")
INDEXES = [NgramIndex, pytest.param(CompiledIndex, marks=needs_compiled)]
COMPILED = [False, pytest.param(True, marks=needs_compiled)]


class CountingCore:
    """The compiled module with a count of calls per function, to assert that a compiled path actually ran (a
    test comparing it with the Python code would pass as well with it switched off)."""

    def __init__(self) -> None:
        self.real, self.calls = core(), Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.real, name)
        if name == "Index":
            return attr

        def call(*args):
            self.calls[name] += 1
            return attr(*args)
        return call


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def assert_well_formed(draft: Draft, max_draft: int) -> None:
    assert len(draft.tokens) <= max_draft
    assert all(isinstance(t, int) and t >= 0 for t in draft.tokens)
    assert 0.0 <= draft.score <= 1.0
    assert draft.probs is None            # model-free drafts are point masses
    if draft.parents is not None:
        assert len(draft.parents) == len(draft.tokens)
        assert all(-1 <= p < i for i, p in enumerate(draft.parents)), draft.parents
        # siblings carry distinct tokens, or the verifier would see two identical paths
        children = Counter((p, t) for p, t in zip(draft.parents, draft.tokens))
        assert max(children.values(), default=1) == 1


# -- brute-force references ----------------------------------------------------------------------------------------
def naive_continuation(tokens: list[int], f: int, k: int) -> list[int]:
    """k tokens from position f, the text assumed to repeat with period len(tokens) - f past its end."""
    text = list(tokens)
    while len(text) < f + k:
        text.append(text[len(text) - (len(tokens) - f)])
    return text[f:f + k]


def naive_prompt_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """O(n^2): the longest suffix (n_max..n_min) with an earlier occurrence; copy after the most recent one."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return naive_continuation(tokens, s + n, k)
    return []


def naive_pattern(tokens: list[int], max_match: int) -> tuple[int, list[int]]:
    """Longest suffix (<= max_match) that occurred earlier with a follower, and its occurrences' follower positions."""
    for n in range(min(max_match, len(tokens) - 1), 0, -1):
        suffix = tokens[len(tokens) - n:]
        followers = [s + n for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if followers:
            return n, followers
    return 0, []


def naive_tree(rows: list[list[int]]) -> dict[tuple[int, ...], float]:
    """Every distinct continuation prefix with its empirical probability (rows having it / all rows)."""
    counts = Counter(tuple(row[:d]) for row in rows for d in range(1, len(row) + 1))
    return {path: c / len(rows) for path, c in counts.items()}


def tree_paths(tokens: list[int], parents: list[int] | None) -> list[tuple[int, ...]]:
    parents = parents if parents is not None else list(range(-1, len(tokens) - 1))
    paths: list[tuple[int, ...]] = []
    for tok, p in zip(tokens, parents):
        paths.append((paths[p] if p >= 0 else ()) + (tok,))
    return paths


def simulate(drafter, prompt: list[int], output: list[int], k: int, seq_id: int = 0) -> float:
    """Greedy replay: mean tokens emitted per step (accepted path + bonus)."""
    ctx, t, steps = list(prompt), 0, 0
    while t < len(output):
        draft = drafter.propose([DraftRequest(seq_id, ctx, len(prompt), k)])[0]
        assert_well_formed(draft, k)
        emitted = min(draft.tree.accepted_length(output[t:]) + 1, len(output) - t)
        ctx += output[t:t + emitted]
        t += emitted
        steps += 1
        drafter.observe(seq_id, ctx, emitted - 1, None)
    drafter.finish(seq_id, ctx, len(prompt))
    return len(output) / steps


# -- NgramIndex ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index_type", INDEXES)
def test_ngram_index_matches_brute_force_under_appends_breaks_and_eviction(index_type):
    rng = random.Random(0)
    index = index_type((1, 2, 4))
    for step in range(60):
        if step % 17 == 16:
            index.break_sequence()
        index.extend(random_tokens(rng, rng.randrange(0, 9), 5))
        if step % 23 == 22:
            index.evict_before(index.base + len(index) // 2)
        toks, base = index.tokens, index.base
        for n in index.sizes:
            expected: dict[tuple[int, ...], list[int]] = {}
            for s in range(len(toks) - n):
                key = tuple(toks[s:s + n])
                if SENTINEL not in key and toks[s + n] != SENTINEL:
                    expected.setdefault(key, []).append(base + s + n)
            got = {key: list(index.occurrences(key)) for key in index.grams(n)}
            assert got == expected, (step, n)
            for key, positions in expected.items():
                for limit in (0, 1, 3):
                    assert index.occurrences(key, limit) == positions[max(0, len(positions) - limit):], (step, n, limit)
            assert index.occurrences((SENTINEL,) * n) == []
        assert index.last == (toks[-1] if toks else None)
        if index_type is NgramIndex:
            assert list(index.array) == toks


# -- NgramDrafter --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("n_min,n_max", [(1, 4), (2, 3), (1, 1)])
def test_ngram_equals_naive_search_incrementally(n_min, n_max, compiled):
    rng = random.Random(n_min * 10 + n_max)
    drafter = NgramDrafter(n_min=n_min, n_max=n_max, compiled=compiled)
    assert drafter._index_type is (CompiledIndex if compiled else NgramIndex)
    tokens = random_tokens(rng, 5, 6)
    for _ in range(150):
        k = rng.randrange(0, 7)
        draft = drafter.propose([DraftRequest(3, list(tokens), 5, k)])[0]
        assert_well_formed(draft, k)
        assert draft.tokens == (naive_prompt_lookup(tokens, n_min, n_max, k) if k else [])
        tokens += random_tokens(rng, rng.randrange(1, 4), 6)


def test_continuation_repeats_past_the_end():
    rng = random.Random(12)
    for _ in range(100):
        tokens = random_tokens(rng, rng.randrange(1, 8), 4)
        f, k = rng.randrange(0, len(tokens)), rng.randrange(0, 12)
        assert continuation(tokens, f, k) == naive_continuation(tokens, f, k)
    assert continuation([7, 3, 3], 1, 5) == [3, 3, 3, 3, 3]


@needs_compiled
@pytest.mark.parametrize("options", [{}, {"num_branches": 3, "branch_len": 2}, {"n_min": 2, "n_max": 3,
                                                                              "scan_occurrences": 2}])
def test_compiled_ngram_drafts_equal_the_python_drafts(options, monkeypatch):
    """Prompt lookup's compiled match (spec/compiled.py) gives the Python code's drafts, trees and scores."""
    from leapdecode.spec import ngram as ngram_module
    counting = CountingCore()
    monkeypatch.setattr(ngram_module, "core", lambda: counting)
    rng = random.Random(len(str(options)))
    python, compiled = NgramDrafter(compiled=False, **options), NgramDrafter(compiled=True, **options)
    phrases = [random_tokens(rng, rng.randrange(2, 9), 30) for _ in range(8)]
    drafted = trees = 0
    for seq in range(6):
        tokens = [t for _ in range(3) for t in rng.choice(phrases)]
        for _ in range(40):
            req = DraftRequest(seq, tokens, 3, rng.choice([1, 4, 8]))
            want, got = python.propose([req])[0], compiled.propose([req])[0]
            assert (got.tokens, got.parents, got.score) == (want.tokens, want.parents, want.score)
            drafted, trees = drafted + bool(want.tokens), trees + (want.parents is not None)
            tokens = tokens + (rng.choice(phrases)[:3] if rng.random() < 0.7 else random_tokens(rng, 1, 30))
    assert isinstance(compiled._indexes[5], CompiledIndex) and drafted > 120
    assert trees > 20 if "num_branches" in options else trees == 0
    assert counting.calls["ngram_match"] >= drafted


def test_ngram_tree_contains_primary_and_alternatives():
    drafter = NgramDrafter(num_branches=3, branch_len=2)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 7, 8, 1, 2, 3]
    draft = drafter.propose([DraftRequest(0, tokens, 5, 6)])[0]
    assert_well_formed(draft, 6)
    paths = tree_paths(draft.tokens, draft.parents)
    assert (7, 7, 8, 1) in paths              # most recent copy leads (trimmed to make room)
    assert (4, 5) in paths                    # older copy as a side branch


def test_ngram_rebuilds_when_sequence_changes_and_frees_state():
    drafter = NgramDrafter()
    drafter.propose([DraftRequest(1, [1, 2, 3, 1, 2], 2, 4)])
    assert drafter.propose([DraftRequest(1, [5, 6, 5], 2, 4)])[0].tokens == [6, 5, 6, 5]   # repeats with period 2
    drafter.finish(1, [5, 6, 5], 2)
    assert drafter._indexes == {}


# -- SuffixDrafter -------------------------------------------------------------------------------------------------
def test_expand_continuations_equals_brute_force_counts():
    rng = random.Random(1)
    for _ in range(30):
        rows = [random_tokens(rng, rng.randrange(0, 6), 3) for _ in range(rng.randrange(1, 12))]
        tree = expand_continuations(rows, max_nodes=10_000, min_prob=0.0, tree=True)
        paths = tree_paths(tree.tokens, tree.parents)
        assert dict(zip(paths, tree.probs)) == pytest.approx(naive_tree(rows))
        assert all(-1 <= p < i for i, p in enumerate(tree.parents))
        # best-first: a node is never more probable than its parent
        assert all(p < 0 or tree.probs[i] <= tree.probs[p] + 1e-12 for i, p in enumerate(tree.parents))
        chain = expand_continuations(rows, max_nodes=4, min_prob=0.0, tree=False)
        assert chain.parents == list(range(-1, len(chain.tokens) - 1)) and len(chain.tokens) <= 4


def test_suffix_local_tree_equals_brute_force():
    rng = random.Random(2)
    drafter = SuffixDrafter(max_match=6, max_spec_factor=100.0, min_token_prob=0.0, max_patterns=1,
                            max_occurrences=10_000, global_max_tokens=0)
    tokens = random_tokens(rng, 3, 4)
    for _ in range(120):
        draft = drafter.propose([DraftRequest(7, list(tokens), 3, 10_000)])[0]
        length, followers = naive_pattern(tokens, max_match=6)
        limit = int(100.0 * length)                        # max_spec_factor * match length
        expected = naive_tree([naive_continuation(tokens, f, limit) for f in followers]) if followers else {}
        assert_well_formed(draft, 10_000)
        index = drafter._local[7]
        tree = drafter.speculate(index, index, 10_000)
        assert tree.match_length == length
        got = dict(zip(tree_paths(tree.tokens, tree.parents), tree.probs))
        assert set(tree_paths(draft.tokens, draft.parents)) == set(got)
        # the draft is the `limit` most probable continuation prefixes (all of them when they fit)
        assert len(got) == min(limit, len(expected))
        assert got == pytest.approx({path: expected[path] for path in got})
        left_out = [p for path, p in expected.items() if path not in got]
        assert max(left_out, default=0.0) <= min(got.values(), default=1.0) + 1e-12
        tokens += random_tokens(rng, rng.randrange(1, 3), 4)


def test_suffix_match_lengths_vectorised_equals_loop():
    rng = random.Random(3)
    drafter = SuffixDrafter(max_match=9)
    index = NgramIndex((2,))
    index.extend(random_tokens(rng, 400, 3))
    toks = index.tokens
    followers = list(index.occurrences(tuple(toks[-2:])))
    assert len(followers) > 8
    got = drafter.match_lengths(index, followers, 2, index)               # vectorised (many occurrences)
    assert drafter.match_lengths(index, followers[:5], 2, index) == got[:5]   # loop (few occurrences)
    for f, m in zip(followers, got):
        n = 0
        while n < 9 and f - 1 - n >= 0 and toks[f - 1 - n] == toks[len(toks) - 1 - n]:
            n += 1
        assert m == n


def test_suffix_adaptive_length_and_threshold():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]          # pattern "1 2" (length 2) followed by 3 4 5 ...
    draft = SuffixDrafter(max_spec_factor=1.0).propose([DraftRequest(0, tokens, 0, 8)])[0]
    assert draft.tokens == [3, 4]                          # at most factor * match length
    draft = SuffixDrafter(max_spec_factor=4.0).propose([DraftRequest(0, tokens, 0, 8)])[0]
    assert draft.tokens == [3, 4, 5, 6, 7, 8, 9, 1]
    # two equally likely continuations: a threshold above 0.5 drafts nothing
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert SuffixDrafter(min_token_prob=0.6).propose([DraftRequest(0, tokens, 0, 4)])[0].tokens == []
    draft = SuffixDrafter(min_token_prob=0.4).propose([DraftRequest(0, tokens, 0, 4)])[0]
    assert draft.tokens and draft.score == pytest.approx(0.5)
    # "1 2" was followed by 5, 5, 6: the tree holds both first tokens (2/3 + 1/3) before deeper, rarer nodes
    tokens = [1, 2, 5, 7, 1, 2, 5, 8, 1, 2, 6, 9, 1, 2]
    draft = SuffixDrafter(min_token_prob=0.3).propose([DraftRequest(0, tokens, 0, 3)])[0]
    paths = tree_paths(draft.tokens, draft.parents)
    assert paths[0] == (5,) and (6,) in paths and draft.score == pytest.approx(1.0)


def test_suffix_global_cache_learns_outputs_and_evicts_oldest():
    rng = random.Random(4)
    drafter = SuffixDrafter(global_max_tokens=200, max_spec_factor=4.0)
    outputs = []
    for seq in range(12):
        prompt = random_tokens(rng, 5, 1000)
        output = random_tokens(rng, 40, 1000)
        outputs.append(output)
        drafter.finish(seq, prompt + output, len(prompt))
        assert drafter.memory_tokens()["global"] <= 200 + 1
    assert drafter.memory_tokens()["local"] == 0
    recent, old = outputs[-1], outputs[0]
    draft = drafter.propose([DraftRequest(100, [999_999] + recent[:10], 1, 8)])[0]
    assert draft.tokens == recent[10:18]                   # copied from the cached output of another request
    assert drafter.propose([DraftRequest(101, [999_999] + old[:10], 1, 8)])[0].tokens == []   # evicted
    index = drafter._global
    for n in index.sizes:                                  # no stale positions survive eviction
        for key in index.grams(n):
            assert all(index.base <= f < index.end for f in index.occurrences(key))


@needs_compiled
@pytest.mark.parametrize("options", [{}, {"tree": False}, {"max_spec_factor": 1.0, "min_token_prob": 0.0},
                                     {"max_patterns": 1, "max_occurrences": 3, "max_spec_offset": 1.5},
                                     {"max_match": 3, "min_token_prob": 0.3, "global_max_tokens": 300}])
def test_compiled_suffix_drafts_equal_the_python_drafts(options, monkeypatch):
    """The compiled index and speculation (spec/compiled.py) give the Python code's drafts and offers, node for
    node, probability for probability, over requests that copy from their prompt, from themselves (periodic) and
    from earlier outputs (the global cache, evicting), and a sequence id reused with other tokens."""
    from leapdecode.spec import suffix as suffix_module
    counting = CountingCore()
    monkeypatch.setattr(suffix_module, "core", lambda: counting)
    rng = random.Random(len(str(options)))
    python, compiled = SuffixDrafter(compiled=False, **options), SuffixDrafter(compiled=True, **options)
    assert isinstance(compiled._global, CompiledIndex) and isinstance(python._global, NgramIndex)
    phrases = [random_tokens(rng, rng.randrange(3, 12), 40) for _ in range(12)]
    steps = drafted = 0
    for seq in range(16):
        prompt = [t for _ in range(rng.randrange(2, 8)) for t in rng.choice(phrases)]
        tokens = list(prompt)
        for _ in range(30):
            req = DraftRequest(seq % 13, tokens, len(prompt), rng.choice([1, 3, 8, 16]))
            want, got = python.propose([req])[0], compiled.propose([req])[0]
            assert (got.tokens, got.parents, got.score) == (want.tokens, want.parents, want.score)
            assert [vars(o) for o in compiled.offers(req)] == [vars(o) for o in python.offers(req)]
            steps, drafted = steps + 1, drafted + bool(want.tokens)
            tokens += rng.choice(phrases)[:rng.randrange(1, 6)] if rng.random() < 0.7 else random_tokens(rng, 2, 40)
        if seq % 3:
            python.finish(seq % 13, tokens, len(prompt))
            compiled.finish(seq % 13, tokens, len(prompt))
        assert compiled.memory_tokens() == python.memory_tokens()
    assert drafted > steps // 2
    assert counting.calls["draft"] == steps and counting.calls["speculate"] >= steps      # (offers: speculate)


@pytest.mark.parametrize("cap", [1, 2, 7])
def test_suffix_global_cache_never_exceeds_a_tiny_budget(cap):
    drafter = SuffixDrafter(global_max_tokens=cap)
    for seq in range(5):
        drafter.finish(seq, list(range(seq, seq + 20)), 3)
        assert drafter.memory_tokens()["global"] <= cap


def test_suffix_prefers_longer_context_match():
    # "a b X" occurred twice with different continuations; the longer context picks the right one
    tokens = [9, 1, 2, 3, 50, 51, 8, 1, 2, 3, 60, 61, 4, 4, 9, 1, 2, 3]
    draft = SuffixDrafter(tree=False).propose([DraftRequest(0, tokens, 0, 2)])[0]
    assert draft.tokens == [50, 51]


# -- RecyclingDrafter ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 4, 10, 33, 80])
def test_static_tree_shape(n):
    shape = static_tree(n, DEFAULT_RANK_PROBS)
    assert len(shape) == n
    depth: list[int] = []
    paths: list[tuple[int, ...]] = []
    for i, (parent, rank) in enumerate(shape):
        assert -1 <= parent < i and 0 <= rank < len(DEFAULT_RANK_PROBS)
        depth.append(1 if parent < 0 else depth[parent] + 1)
        paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
    assert depth == sorted(depth)                          # breadth-first
    assert len(set(paths)) == n                            # no duplicate nodes
    for path in paths:                                      # prefix-closed with contiguous sibling ranks
        assert path[-1] == 0 or path[:-1] + (path[-1] - 1,) in paths
    if n >= 10:
        assert depth.count(1) >= depth.count(max(depth))   # wider near the root


def test_recycling_topk_rows_overwrite_adjacency():
    drafter = RecyclingDrafter(vocab_size=50, num_successors=4)
    tokens = [1, 2, 3, 4, 5, 6]                            # step accepted 2 drafts (4, 5) plus bonus 6
    drafter.observe(0, tokens, 2, topk=[[4, 9, 8, 7, 6], [5, 1], [6, 10, 11, 12]])
    assert drafter.adjacency[3].tolist() == [4, 9, 8, 7]   # row 0: successors of the last committed token (3)
    assert drafter.adjacency[4].tolist() == [5, 1, -1, -1]
    assert drafter.adjacency[5].tolist() == [6, 10, 11, 12]
    assert drafter.adjacency[1].tolist() == [-1] * 4       # with top-k rows, committed tokens do not touch the matrix


@pytest.mark.parametrize("compiled", COMPILED)
def test_recycling_learns_from_committed_tokens_without_topk(compiled):
    drafter = RecyclingDrafter(vocab_size=20, num_successors=3, use_trigrams=False, compiled=compiled)
    drafter.observe(0, [1, 2, 1, 3, 1, 2, 1, 4], 0, None)
    assert drafter.adjacency[1].tolist() == [4, 2, 3]      # most recent successor first (move to front)
    draft = drafter.propose([DraftRequest(0, [1, 2, 1, 4, 1], 0, 1)])[0]
    assert draft.tokens == [4]


@pytest.mark.parametrize("compiled", COMPILED)
def test_recycling_trigram_counts_equal_brute_force(compiled):
    rng = random.Random(5)
    drafter = RecyclingDrafter(vocab_size=8, trigram_slots=1 << 12, trigram_width=8, compiled=compiled)
    tokens = random_tokens(rng, 300, 4)
    drafter.observe(0, tokens, 0, None)
    counts = Counter(zip(tokens, tokens[1:], tokens[2:]))
    for a in range(4):
        for b in range(4):
            expected = sorted(((c, n) for (x, y, c), n in counts.items() if (x, y) == (a, b)), key=lambda t: -t[1])
            got = drafter.trigram_successors(a, b)
            assert sorted(got) == sorted(expected)
            assert [n for _, n in got] == sorted([n for _, n in got], reverse=True)


@needs_compiled
@pytest.mark.parametrize("with_topk,extra", [(False, {}), (True, {}), (False, {"trigram_min_count": 2}),
                                             (True, {"use_trigrams": False})])
def test_compiled_recycling_learns_what_the_python_code_learns(with_topk, extra):
    """Token Recycling's learning and drafting in C++ (spec/compiled.py) leave the Python code's tables, bit for
    bit: move to front, tri-gram buckets that collide (a small table) and fill (space-saving), a count at its
    maximum halving its bucket, a matrix that grows for tokens beyond ``vocab_size``, a sequence id reused; and
    give its drafts and offers (successors ranked by tri-gram counts, then the matrix row)."""
    rng = random.Random(11 + with_topk + len(extra))
    options = dict(vocab_size=16, num_successors=4, trigram_slots=1 << 6, trigram_width=3, **extra)
    python, compiled = RecyclingDrafter(compiled=False, **options), RecyclingDrafter(compiled=True, **options)
    assert compiled._compiled is not None and python._compiled is None
    compiled._compiled = counting = CountingCore()
    saturating = [1, 2, 3] * 70_000 + [1, 2, 5]               # (1, 2) -> 3 counted past 65,535, then a newcomer
    for drafter in (python, compiled):
        drafter.observe(99, saturating, 0, None)
    assert compiled._tri_count == python._tri_count
    assert 30_000 < max(python._tri_count) < 40_000 if python.use_trigrams else max(python._tri_count) == 0  # halved
    trees = 0
    for seq in range(12):
        tokens = random_tokens(rng, rng.randrange(1, 30), 40)
        for _ in range(25):
            tokens = tokens + random_tokens(rng, rng.randrange(1, 4), 40)
            topk = [random_tokens(rng, 4, 40) for _ in range(2)] if with_topk and rng.random() < 0.5 else None
            for drafter in (python, compiled):
                drafter.observe(seq % 5, tokens, 1, topk)
            req = DraftRequest(seq % 5, tokens, 1, rng.choice([1, 8, 12]))
            want, got = python.propose([req])[0], compiled.propose([req])[0]
            assert (got.tokens, got.parents, got.score) == (want.tokens, want.parents, want.score)
            assert [vars(o) for o in compiled.offers(req)] == [vars(o) for o in python.offers(req)]
            trees += want.parents is not None
        for table in ("_adj", "_tri_key", "_tri_next", "_tri_count"):
            assert getattr(compiled, table) == getattr(python, table), (seq, table)
    assert len(python._adj) > 16 * 4 and trees > 50                             # grown; trees drafted
    assert counting.calls["recycling_learn"] > 100 and counting.calls["recycling_fill"] > 100


@pytest.mark.parametrize("compiled", COMPILED)
def test_lazy_recycling_drafts_what_eager_recycling_drafts(compiled):
    """``lazy`` (auto in order sets it): a request's committed tokens are learned when it is next asked to draft,
    and at its end, instead of in every observe. Requests one after another get the eager drafter's drafts and,
    at each request's end, its tables; in between the lazy tables have not moved."""
    rng = random.Random(21)
    eager = RecyclingDrafter(vocab_size=64, trigram_slots=1 << 8, compiled=compiled)
    lazy = RecyclingDrafter(vocab_size=64, trigram_slots=1 << 8, compiled=compiled)
    lazy.lazy = True
    deferred = 0
    for seq in range(6):
        tokens = random_tokens(rng, 20, 64)
        for step in range(30):
            tokens = tokens + random_tokens(rng, rng.randrange(1, 3), 64)
            before = bytes(lazy._tri_count)
            for drafter in (eager, lazy):
                drafter.observe(seq, tokens, 0, None)
            deferred += bytes(lazy._tri_count) == before and bytes(eager._tri_count) != before
            if step % 3 == 0:
                want = eager.propose([DraftRequest(seq, tokens, 20, 6)])[0]
                got = lazy.propose([DraftRequest(seq, tokens, 20, 6)])[0]
                assert (got.tokens, got.parents, got.score) == (want.tokens, want.parents, want.score)
        for drafter in (eager, lazy):
            drafter.finish(seq, tokens, 20)
        assert (lazy._adj, lazy._tri_key, lazy._tri_next, lazy._tri_count) == \
            (eager._adj, eager._tri_key, eager._tri_next, eager._tri_count)
    assert deferred > 50


def test_auto_in_order_makes_its_later_members_learn_lazily():
    auto = make_drafter("auto", vocab_size=64, fallback=True)
    assert auto.drafters["recycling"].lazy
    assert not make_drafter("auto", vocab_size=64).drafters["recycling"].lazy


@needs_compiled
@pytest.mark.parametrize("min_count", [1, 2])
def test_compiled_recycling_fill_ranks_successors_as_the_python_code(min_count):
    """The compiled fill ranks a pair's successors as ``RecyclingDrafter.ranked`` does: tri-grams seen at least
    ``trigram_min_count`` times, most counted first (ties in bucket order), then the matrix row, then the rarer
    tri-grams, no repeats; over a tiny vocabulary (counts vary, short rows leave room for the rare ones)."""
    rng = random.Random(31 + min_count)
    options = dict(vocab_size=6, num_successors=2, trigram_slots=1 << 8, trigram_width=4, trigram_min_count=min_count,
                   rank_probs=(0.5, 0.3))
    python, compiled = RecyclingDrafter(compiled=False, **options), RecyclingDrafter(compiled=True, **options)
    compiled._compiled = counting = CountingCore()
    tokens = [rng.randrange(6) for _ in range(400)]
    for drafter in (python, compiled):
        drafter.observe(0, tokens, 0, None)
    for b in range(0, 6, 2):                  # a short row (as a top-k row may be) leaves room for the rare ones
        row = [rng.randrange(6)]
        python._set_row(b, row)
        compiled._set_row(b, row)
    rare = confident = 0
    for a in range(-1, 6):
        for b in range(6):
            ranked = python.ranked(a, b)
            rare += any(0 < c < min_count for _, c in ranked)
            confident += len([c for _, c in ranked if c >= min_count]) > 1
            for n in (1, 4, 16):
                assert compiled._fill(a, b, n) == tuple(python._fill(a, b, n)), (a, b, n)
    assert confident > 10 and (rare > 5 if min_count > 1 else True)
    assert counting.calls["recycling_fill"] == 7 * 6 * 3


def test_recycling_draft_follows_successors_and_memory_is_bounded():
    rng = random.Random(6)
    drafter = RecyclingDrafter(vocab_size=64, num_successors=8, trigram_slots=1 << 10, trigram_width=4)
    expected_bytes = 64 * 8 * 4 + (1 << 10) * (8 + 4 * (4 + 2))
    assert drafter.memory_bytes() == expected_bytes
    tokens = random_tokens(rng, 5, 64)
    for _ in range(200):
        tokens += random_tokens(rng, 2, 64)
        topk = [random_tokens(rng, 8, 64) for _ in range(2)]
        drafter.observe(0, tokens, 1, topk)
        draft = drafter.propose([DraftRequest(0, tokens, 5, 12)])[0]
        assert_well_formed(draft, 12)
        parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
        for tok, p in zip(draft.tokens, parents):
            prev = draft.tokens[p] if p >= 0 else tokens[-1]
            before = (draft.tokens[parents[p]] if parents[p] >= 0 else tokens[-1]) if p >= 0 else tokens[-2]
            assert tok in drafter.successors(before, prev)
    assert drafter.memory_bytes() == expected_bytes
    drafter.finish(0, tokens, 5)
    assert drafter._learned == {}


def test_recycling_chain_mode_is_a_chain():
    drafter = RecyclingDrafter(vocab_size=16, tree=False)
    drafter.observe(0, [1, 2, 3, 1, 2, 3, 1], 0, None)
    draft = drafter.propose([DraftRequest(0, [1, 2, 3, 1], 0, 5)])[0]
    assert draft.parents is None and draft.tokens == [2, 3, 1, 2, 3]


# -- all drafters --------------------------------------------------------------------------------------------------
def all_drafters():
    return {
        "ngram": NgramDrafter(),
        "ngram_tree": NgramDrafter(num_branches=3),
        "suffix": SuffixDrafter(),
        "suffix_chain": SuffixDrafter(tree=False),
        "recycling": RecyclingDrafter(vocab_size=100),
        "auto": make_drafter("auto", vocab_size=100, methods=("ngram", "suffix", "recycling")),
    }


@pytest.mark.parametrize("name", list(all_drafters()))
def test_every_drafter_respects_budget_handles_short_contexts_and_frees_state(name):
    drafter = all_drafters()[name]
    rng = random.Random(7)
    assert drafter.propose([]) == []
    for tokens in ([], [5], [5, 5], [5, 6, 5]):
        for k in (0, 1, 3):
            (draft,) = drafter.propose([DraftRequest(1, tokens, len(tokens), k)])
            assert_well_formed(draft, k)
            drafter.finish(1, tokens, len(tokens))
    # a batch of requests with repetitive contexts and varied budgets
    contexts = {seq: random_tokens(rng, 30, 6) * 3 for seq in range(4)}
    for step in range(20):
        reqs = [DraftRequest(seq, ctx, 30, (seq + step) % 6) for seq, ctx in contexts.items()]
        drafts = drafter.propose(reqs)
        assert len(drafts) == len(reqs)
        for req, draft in zip(reqs, drafts):
            assert_well_formed(draft, req.max_draft)
            new = random_tokens(rng, 1 + len(draft.tokens) % 3, 6)
            contexts[req.seq_id] = req.token_ids + new
            drafter.observe(req.seq_id, contexts[req.seq_id], len(new) - 1, None)
    for seq, ctx in contexts.items():
        drafter.finish(seq, ctx, 30)
    inner = drafter.drafters.values() if isinstance(drafter, AutoDrafter) else [drafter]
    if isinstance(drafter, AutoDrafter):
        assert drafter._stats == {} and drafter._last == {}
    for d in inner:
        for attr in ("_indexes", "_local", "_learned"):
            assert getattr(d, attr, {}) == {}, (name, attr)


def test_drafters_accept_numpy_and_tuple_contexts():
    for drafter in all_drafters().values():
        a = drafter.propose([DraftRequest(0, np.array([1, 2, 3, 1, 2], dtype=np.int64), 2, 3)])[0]
        b = drafter.propose([DraftRequest(1, (1, 2, 3, 1, 2), 2, 3)])[0]
        assert a.tokens == b.tokens and all(type(t) is int for t in a.tokens)


@pytest.mark.parametrize("name", ["ngram", "ngram_tree", "suffix", "suffix_chain", "auto"])
def test_copy_heavy_sequences_accept_more_than_two_tokens_per_step(name):
    """A prompt holds a passage; the output re-copies it with a few edits between fresh text (an edit task)."""
    rng = random.Random(8)
    passage = random_tokens(rng, 300, 1000)
    prompt = random_tokens(rng, 20, 1000) + passage + random_tokens(rng, 10, 1000)
    edited = list(passage)
    for i in range(25, len(edited), 60):
        edited[i] = rng.randrange(1000)                     # a few edits
    output = random_tokens(rng, 5, 1000) + edited + random_tokens(rng, 5, 1000)
    tokens_per_step = simulate(all_drafters()[name], prompt, output, k=8)
    assert tokens_per_step > 2.0, tokens_per_step


# accepted_length, the draft's depth and merging (the auto drafter's tree operations): tests/test_tree.py


def test_auto_drafter_prefers_the_drafter_that_gets_accepted():
    rng = random.Random(10)
    passage = random_tokens(rng, 200, 500)
    prompt = passage
    output = passage[:150]
    auto = make_drafter("auto", vocab_size=500)
    simulate(auto, prompt, output, k=8)
    assert auto.chosen["suffix"] > auto.chosen["recycling"]


def test_auto_in_order_takes_the_first_members_own_draft_and_asks_the_next_only_where_it_has_none():
    """``fallback`` (what the speculator builds under the controller): a request gets the suffix drafter's own
    draft where suffix has one (no calibrated merge: its tree, its score, no confidences); recycling is asked only
    for the requests suffix had nothing for, and its draft's score is its measured first-token hit rate (its own
    score is a prior the controller's score table would mix with suffix's)."""
    rng = random.Random(3)
    passage = random_tokens(rng, 120, 400)
    copying = DraftRequest(1, passage + passage[:30], 150, 4)            # suffix finds the passage again
    text = [t for t in random_tokens(rng, 60, 400) if t != passage[5]] + [passage[5]]
    fresh = DraftRequest(2, text, len(text), 4)                          # its last token never came before in it
    auto = make_drafter("auto", vocab_size=400, fallback=True)
    suffix = make_drafter("suffix")
    for t in range(40):                                   # recycling learns some successors (when the request
        auto.observe(9, passage[:t + 2], 0)               # ends: in order it learns lazily)
    auto.finish(9, passage[:41], 0)
    asked = []
    recycling = auto.drafters["recycling"]
    real = recycling.propose
    recycling.propose = lambda reqs: asked.append([r.seq_id for r in reqs]) or real(reqs)
    got = auto.propose([copying, fresh])
    want = suffix.propose([copying])[0]
    assert want.tokens and got[0].tokens == want.tokens and got[0].parents == want.parents
    assert got[0].score == want.score and not got[0].confidence
    assert not suffix.propose([fresh])[0].tokens and got[1].tokens        # recycling's draft, for the fresh one
    assert asked == [[2]]
    assert got[1].score == auto._prior["recycling"].first_hit == 0.5      # (no record yet: its prior)
    assert auto.chosen == {"suffix": 1, "recycling": 1}
    auto.observe(2, fresh.token_ids + [got[1].tokens[0] + 1], 0)          # its first token failed
    assert auto._prior["recycling"].first_hit < 0.5


def test_the_speculator_builds_auto_in_order_under_the_controller():
    from leapdecode.config import SpeculativeConfig
    from leapdecode.spec.speculator import Speculator
    on = Speculator(SpeculativeConfig(method="auto", num_speculative_tokens=4), 400).drafter
    off = Speculator(SpeculativeConfig(method="auto", num_speculative_tokens=4, adaptive=False), 400).drafter
    mine = Speculator(SpeculativeConfig(method="auto", num_speculative_tokens=4, options={"fallback": False}),
                      400).drafter
    assert on.fallback and not off.fallback and not mine.fallback and mine.min_accept_prob == 0.02
    assert not on.wants_topk and off.wants_topk and mine.wants_topk      # in order: no top-k rows from the engine
    for options in ({"calibrate": False}, {"min_accept_prob": 0.1}, {"fill": False}):   # another mode asked for
        d = Speculator(SpeculativeConfig(method="auto", num_speculative_tokens=4, options=options), 400).drafter
        assert not d.fallback and all(getattr(d, k) == v for k, v in options.items())


def test_registry():
    assert set(METHODS) - set(MODEL_METHODS) == {"ngram", "suffix", "recycling", "auto"}   # model drafters: issue 13
    assert isinstance(make_drafter("ngram", n_max=3, vocab_size=10), NgramDrafter)
    assert isinstance(make_drafter("recycling", vocab_size=10), RecyclingDrafter)
    with pytest.raises(ValueError):
        make_drafter("medusa")
    with pytest.raises(ValueError):
        make_drafter("suffix", no_such_option=1)
    with pytest.raises(ValueError):
        make_drafter("ngram", n_min=3, n_max=2)
    with pytest.raises(ValueError):
        make_drafter("auto", methods=("suffix", "eagle"))


# -- no pauses: a long prompt's first indexing ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_first_propose_of_a_long_prompt_sets_off_no_collection(method):
    """Indexing an 8,000-token prompt creates ~32,000 key tuples: with the collector running that is ~40 young and
    a few older collections inside the engine step (each older one scans everything promoted so far). The index
    pauses the collector for a long append and runs one young collection after it (which untracks the tuples)."""
    import gc
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(8000)]
    drafter = make_drafter(method, vocab_size=49152) if method == "auto" else make_drafter(method)
    seen = []

    def callback(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(callback)
    try:
        drafter.propose([DraftRequest(1, prompt, len(prompt), 8)])
    finally:
        gc.callbacks.remove(callback)
    assert max(seen, default=0) == 0 and len(seen) <= 2, seen


@pytest.mark.parametrize("method", ["ngram", "suffix", "recycling", "auto"])
def test_prepare_indexes_a_prompt_chunk_by_chunk(method, monkeypatch):
    """Issue 19 ("no pauses"): `prepare` (called by the engine while a prompt is prefilled) lets the drafter catch
    up chunk by chunk, so its first `propose` only indexes the last chunk; and the drafts are those of a drafter
    that saw the whole prompt at once."""
    from leapdecode.spec import index as index_module
    rng = random.Random(3)
    prompt = [rng.randrange(500) for _ in range(3000)] * 2      # copies: the drafts are not empty
    chunk = 256

    def fresh():
        return make_drafter(method, vocab_size=512) if method in ("auto", "recycling") else make_drafter(method)

    whole = fresh().propose([DraftRequest(1, prompt, len(prompt), 8)])[0]
    drafter = fresh()
    for end in range(chunk, len(prompt), chunk):
        drafter.prepare(1, prompt[:end])
    sizes = []
    for index_type in (index_module.NgramIndex, CompiledIndex):
        monkeypatch.setattr(index_type, "_extend", lambda self, new, original=index_type._extend:
                            (sizes.append(len(new)), original(self, new)))
    learned = []
    if method in ("recycling", "auto"):
        from leapdecode.spec.recycling import RecyclingDrafter
        original_learn = RecyclingDrafter._learn
        def spy(self, seq_id, token_ids):
            learned.append(len(token_ids) - self._learned.get(seq_id, 0))
            return original_learn(self, seq_id, token_ids)
        monkeypatch.setattr(RecyclingDrafter, "_learn", spy)
    first = drafter.propose([DraftRequest(1, prompt, len(prompt), 8)])[0]
    assert max(sizes + learned, default=0) <= chunk, (sizes, learned)
    assert (first.tokens, first.parents) == (whole.tokens, whole.parents)
