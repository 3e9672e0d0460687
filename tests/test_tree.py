"""DraftTree, the engine's one token-tree type, checked against brute-force references (hypothesis, CPU, fast).

The references work from the definition only: a node's root path is found by following ``parents`` up to -1, and
everything else (depths, positions, the ancestor mask, the accepted branch, merging) is computed over the set of
root paths, never with the tree's own indexes.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.spec.drafter import Draft
from leapdecode.spec.tree import EMPTY, DraftTree

VOCAB = 4            # a tiny vocabulary, so that shared prefixes and duplicate siblings are common
settings.register_profile("tree", max_examples=150, deadline=None, derandomize=True)
settings.load_profile("tree")


# -- strategies ----------------------------------------------------------------------------------------------------
@st.composite
def raw_trees(draw, max_nodes: int = 10, chain: bool | None = None):
    """(tokens, parents) in topological order; parents None for a chain when ``chain`` (None: either)."""
    n = draw(st.integers(0, max_nodes))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    if chain is None:
        chain = draw(st.booleans())
    if chain:
        return tokens, None
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    return tokens, parents


@st.composite
def trees(draw, max_nodes: int = 10, chain: bool | None = None) -> DraftTree:
    return DraftTree.of(*draw(raw_trees(max_nodes, chain)))


@st.composite
def distinct_sibling_trees(draw, max_nodes: int = 10) -> DraftTree:
    """Trees whose siblings carry distinct tokens (what every drafter emits): each root path is stored once."""
    tokens, parents = draw(raw_trees(max_nodes, chain=False))
    keep_tokens, keep_parents, new_index, seen = [], [], {}, set()
    for i, (tok, p) in enumerate(zip(tokens, parents)):
        if (p >= 0 and p not in new_index) or (p, tok) in seen:
            continue                                  # a duplicate sibling, or under one: drop it
        seen.add((p, tok))
        keep_parents.append(new_index[p] if p >= 0 else -1)
        keep_tokens.append(tok)
        new_index[i] = len(keep_tokens) - 1
    return DraftTree.of(keep_tokens, keep_parents)


# -- brute-force references ----------------------------------------------------------------------------------------
def parent_list(tree: DraftTree) -> list[int]:
    return list(range(-1, len(tree) - 1)) if tree.parents is None else list(tree.parents)


def ancestors(tree: DraftTree, i: int) -> list[int]:
    """Node i and its ancestors, root first (a plain walk up the parent pointers)."""
    parents, out = parent_list(tree), []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def root_path(tree: DraftTree, i: int) -> tuple[int, ...]:
    return tuple(tree.tokens[j] for j in ancestors(tree, i))


def reachable(tree: DraftTree, i: int) -> bool:
    """Every node on i's root path is the first of its siblings with its token (duplicates after it are never
    followed: the verifier would otherwise pick among identical contexts by their later draws)."""
    parents = parent_list(tree)
    for j in ancestors(tree, i):
        if any(parents[s] == parents[j] and tree.tokens[s] == tree.tokens[j] for s in range(j)):
            return False
    return True


def brute_walk(tree: DraftTree, sampled: list[int]) -> tuple[list[int], int]:
    """Sample-then-match over all root paths: the longest reachable path whose every node's token is the draw at
    its parent's row (row 0: the last committed token, row 1 + i: node i); the bonus is the draw after it."""
    best: list[int] = []
    for i in range(len(tree)):
        path = ancestors(tree, i)
        rows = [0] + [j + 1 for j in path[:-1]]
        if reachable(tree, i) and all(tree.tokens[j] == sampled[r] for j, r in zip(path, rows)):
            if len(path) > len(best):
                best = path
    return best, sampled[best[-1] + 1 if best else 0]


def brute_accepted(tree: DraftTree, truth: list[int], only_reachable: bool = True) -> int:
    return max((len(ancestors(tree, i)) for i in range(len(tree))
                if (not only_reachable or reachable(tree, i))
                and list(root_path(tree, i)) == truth[:len(ancestors(tree, i))]), default=0)


def brute_merge(path_lists: list[list[tuple[int, ...]]], max_nodes: int) -> list[tuple[int, ...]]:
    """Root paths in priority order: a path is added when new, its parent path is in, and there is room."""
    out: list[tuple[int, ...]] = []
    for paths in path_lists:
        for path in paths:
            if path not in out and (len(path) == 1 or path[:-1] in out) and len(out) < max_nodes:
                out.append(path)
    return out


def all_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [root_path(tree, i) for i in range(len(tree))]


def assert_valid(tree: DraftTree) -> None:
    assert isinstance(tree.tokens, tuple) and all(type(t) is int for t in tree.tokens)
    if tree.parents is not None:
        assert isinstance(tree.parents, tuple) and len(tree.parents) == len(tree.tokens)
        assert all(-1 <= p < i for i, p in enumerate(tree.parents))          # topological
        assert any(p != i - 1 for i, p in enumerate(tree.parents))           # a chain would be parents None
    assert DraftTree.of(tree.tokens, tree.parents) == tree


# -- construction --------------------------------------------------------------------------------------------------
@given(raw_trees())
def test_of_normalises(raw):
    tokens, parents = raw
    tree = DraftTree.of(np.array(tokens, dtype=np.int64), parents)
    assert_valid(tree)
    assert list(tree.tokens) == tokens and len(tree) == len(tokens) and bool(tree) == bool(tokens)
    assert parent_list(tree) == (parents if parents is not None else list(range(-1, len(tokens) - 1)))
    assert tree.is_chain == all(p == i - 1 for i, p in enumerate(parent_list(tree)))
    assert [tree.parent(i) for i in range(len(tree))] == parent_list(tree)


def test_of_turns_chain_parents_into_none_and_rejects_bad_parents():
    assert DraftTree.of([5, 6, 7], [-1, 0, 1]) == DraftTree((5, 6, 7)) == DraftTree.of((5, 6, 7))
    assert DraftTree.of([5, 6, 7], [-1, 0, 1]).is_chain
    assert DraftTree.of([], []) == EMPTY and not EMPTY and EMPTY.is_chain and EMPTY.depth == 0
    assert not DraftTree.of([5, 6], [-1, -1]).is_chain
    bad = [([5], [0]), ([5, 6], [-1, 1]), ([5, 6, 7], [-1, 2, 0]), ([5], [-2]), ([5, 6, 7], [-1, 0, -3]),
           ([5, 6], [-1]), ([5, 6], [-1, 0, 1])]
    for tokens, parents in bad:
        with pytest.raises(ValueError):
            DraftTree.of(tokens, parents)


@given(st.integers(0, 8), st.data())
def test_of_rejects_any_non_topological_parent(n, data):
    parents = [data.draw(st.integers(-1, i - 1)) for i in range(n + 1)]
    bad = data.draw(st.integers(0, n))
    parents[bad] = data.draw(st.one_of(st.integers(bad, bad + 5), st.integers(-10, -2)))
    with pytest.raises(ValueError):
        DraftTree.of([0] * (n + 1), parents)


# -- shape ---------------------------------------------------------------------------------------------------------
@given(trees())
def test_shape_queries_equal_ancestor_walk(tree):
    depths = [len(ancestors(tree, i)) for i in range(len(tree))]
    assert tree.depths() == depths
    assert tree.depth == max(depths, default=0)
    assert tree.node_paths() == all_paths(tree)
    expected_children: dict[int, dict[int, int]] = {}
    for i in range(len(tree)):
        p = parent_list(tree)[i]
        if tree.tokens[i] not in expected_children.get(p, {}):
            expected_children.setdefault(p, {})[tree.tokens[i]] = i          # the first of duplicate siblings
    assert tree.children() == expected_children


@given(trees(), st.integers(-3, 1000))
def test_positions_and_ancestor_mask_equal_ancestor_walk(tree, last):
    assert tree.positions(last) == [last + len(ancestors(tree, i)) for i in range(len(tree))]
    mask = tree.ancestor_mask()
    assert [[j in ancestors(tree, i) for j in range(len(tree))] for i in range(len(tree))] == mask
    rows = {id(row) for row in mask}
    assert len(rows) == len(mask)                     # rows are independent lists, safe to modify


@given(trees(), st.integers(-2, 12))
def test_prefix_is_a_topological_prefix(tree, k):
    cut = tree.prefix(k)
    assert_valid(cut)
    kk = min(max(k, 0), len(tree))
    assert cut.tokens == tree.tokens[:kk]
    assert cut.node_paths() == tree.node_paths()[:kk]
    assert cut == DraftTree.of(tree.tokens[:kk], None if tree.parents is None else tree.parents[:kk])
    if tree.is_chain:
        assert cut.is_chain


@given(trees())
def test_first_chain_follows_first_children(tree):
    expected, node = [], -1
    while True:
        kids = [i for i in range(len(tree)) if parent_list(tree)[i] == node]
        if not kids:
            break
        node = kids[0]
        expected.append(tree.tokens[node])
    chain = tree.first_chain()
    assert chain.is_chain and list(chain.tokens) == expected
    assert tuple(expected) in set(all_paths(tree)) | {()}
    if tree.is_chain:
        assert chain == tree


# -- verification --------------------------------------------------------------------------------------------------
@given(trees(), st.data())
def test_walk_equals_brute_force_sample_then_match(tree, data):
    # draws biased towards the tree's own tokens, so long accepted branches are common
    sampled = data.draw(st.lists(st.integers(0, VOCAB), min_size=len(tree) + 1, max_size=len(tree) + 1))
    path, bonus = tree.walk(sampled)
    assert (path, bonus) == brute_walk(tree, sampled)
    assert type(bonus) is int
    assert tree.walk(np.array(sampled)) == (path, bonus)         # numpy rows (as the verifier passes them)


@given(trees(), st.lists(st.integers(0, VOCAB - 1), max_size=12))
def test_accepted_length_equals_brute_force(tree, truth):
    n = tree.accepted_length(truth)
    assert n == brute_accepted(tree, truth)
    assert tree.accepted_length(np.array(truth, dtype=np.int64)) == n
    # what the verifier accepts when the target's draw at every row is the truth at that depth
    padded = truth + [VOCAB] * (tree.depth + 1)                  # VOCAB: never a draft token
    rows = [padded[0]] + [padded[d] for d in tree.depths()]
    assert len(tree.walk(rows)[0]) == n


@given(distinct_sibling_trees(), st.lists(st.integers(0, VOCAB - 1), max_size=12))
def test_accepted_length_is_the_longest_matching_root_path(tree, truth):
    assert len(set(all_paths(tree))) == len(tree)
    assert tree.accepted_length(truth) == brute_accepted(tree, truth, only_reachable=False)


# -- building ------------------------------------------------------------------------------------------------------
@given(st.lists(trees(max_nodes=7), max_size=4), st.integers(0, 16))
def test_merge_equals_brute_force(inputs, max_nodes):
    merged = DraftTree.merge(inputs, max_nodes)
    assert_valid(merged)
    assert len(merged) <= max(max_nodes, 0)
    paths = merged.node_paths()
    assert paths == brute_merge([all_paths(t) for t in inputs], max_nodes)       # priority order, exactly
    assert len(set(paths)) == len(paths)                                          # each path stored once
    everything = [p for t in inputs for p in all_paths(t)]
    assert set(paths) <= set(everything)
    if inputs and len(set(all_paths(inputs[0]))) <= max_nodes:
        assert set(all_paths(inputs[0])) <= set(paths)                            # the first is kept whole
    if len(set(everything)) <= max_nodes:
        assert set(paths) == set(everything)                                      # everything that fits
    if len(set(paths)) == merged.depth:
        assert merged.is_chain


@given(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=6), max_size=5), st.integers(0, 16))
def test_from_paths_equals_brute_force(paths, max_nodes):
    tree = DraftTree.from_paths(paths, max_nodes)
    assert_valid(tree)
    prefixes = [[tuple(p[:d]) for d in range(1, len(p) + 1)] for p in paths]
    assert tree.node_paths() == brute_merge(prefixes, max_nodes)
    assert tree == DraftTree.merge([DraftTree.of(p) for p in paths], max_nodes)
    if paths and len(paths[0]) <= max_nodes:
        assert tuple(paths[0]) in set(tree.node_paths()) | {()}


def test_merge_examples():
    a = DraftTree.of([1, 2, 3])
    b = DraftTree.of([1, 2, 4, 5])
    merged = DraftTree.merge([a, b], 10)
    assert merged == DraftTree((1, 2, 3, 4, 5), (-1, 0, 1, 1, 3))
    assert DraftTree.merge([a, b], 3) == a                       # no room for b's branch: a chain again
    assert DraftTree.merge([a, a], 10) == a
    assert DraftTree.merge([], 5) == EMPTY
    assert DraftTree.from_paths([[7, 8], [7, 9], [6]], 4) == DraftTree((7, 8, 9, 6), (-1, 0, 0, -1))


# -- Draft ---------------------------------------------------------------------------------------------------------
@given(raw_trees())
def test_draft_tree_property(raw):
    tokens, parents = raw
    draft = Draft(tokens=list(tokens), parents=parents, score=0.5)
    assert draft.tree == DraftTree.of(tokens, parents)
    assert draft.is_tree == (not draft.tree.is_chain)
    assert len(draft) == len(tokens)
    again = Draft.from_tree(draft.tree, score=0.5)
    assert again.tree == draft.tree and again.score == 0.5
    assert again.parents is None if draft.tree.is_chain else again.parents == list(draft.tree.parents)
    assert type(again.tokens) is list
