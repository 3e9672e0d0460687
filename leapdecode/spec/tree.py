"""The token tree: one type for every draft, used by drafters, the scheduler, the runner and the verifier.

A draft is a tree of candidate tokens hanging off a sequence's last committed token. Nodes are stored in
topological order: ``parents[i]`` is the index of node i's parent, or -1 for a child of the last committed token.
A chain (each node the child of the one before) is stored with ``parents=None``, so the common case costs nothing.

Everything that needs to know the tree's shape asks it here: positions and the attention mask for the forward
pass (a node sits at ``last position + depth`` and sees the committed tokens, its ancestors and itself), the rows
that verification samples (one per node, plus one for the last committed token), the accepted branch
(``walk``: sample-then-match), cutting (``prefix``, ``first_chain``) and merging trees (``merge``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node of a tree given by topological ``parents`` (-1: a child of the last committed token)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] | None = None      # None: a chain

    @staticmethod
    def of(tokens: Sequence[int], parents: Sequence[int] | None = None) -> "DraftTree":
        """Normalise: tuples, and ``parents=None`` whenever the tree is in fact a chain."""
        tokens = tuple(int(t) for t in tokens)
        if parents is not None:
            parents = tuple(int(p) for p in parents)
            if len(parents) != len(tokens):
                raise ValueError(f"a draft tree needs one parent per token ({len(tokens)} tokens, "
                                 f"{len(parents)} parents)")
            if any(not -1 <= p < i for i, p in enumerate(parents)):
                raise ValueError("draft tree parents must point to an earlier node or -1")
            if all(p == i - 1 for i, p in enumerate(parents)):
                parents = None
        return DraftTree(tokens, parents)

    def __len__(self) -> int:
        return len(self.tokens)

    def __bool__(self) -> bool:
        return bool(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def parent(self, i: int) -> int:
        return i - 1 if self.parents is None else self.parents[i]

    def depths(self) -> list[int]:
        """Depth of each node: 1 for a child of the last committed token."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        return node_depths(self.parents)

    @property
    def depth(self) -> int:
        """Tokens on the longest root path."""
        return max(self.depths(), default=0)

    def children(self) -> dict[int, dict[int, int]]:
        """node -> {token: child node}; node -1 is the last committed token. Duplicate siblings: the first wins."""
        out: dict[int, dict[int, int]] = {}
        for i, tok in enumerate(self.tokens):
            out.setdefault(self.parent(i), {}).setdefault(tok, i)
        return out

    def node_paths(self) -> list[tuple[int, ...]]:
        """For each node, the draft tokens from the root down to it (inclusive)."""
        paths: list[tuple[int, ...]] = []
        for i, tok in enumerate(self.tokens):
            p = self.parent(i)
            paths.append((paths[p] if p >= 0 else ()) + (tok,))
        return paths

    def prefix(self, k: int) -> "DraftTree":
        """The first ``k`` nodes: a topological prefix of a tree is still a tree."""
        if k >= len(self.tokens):
            return self
        return DraftTree.of(self.tokens[:max(k, 0)], None if self.parents is None else self.parents[:max(k, 0)])

    def first_chain(self) -> "DraftTree":
        """The root-to-leaf chain that follows each node's first child."""
        if self.parents is None:
            return self
        chain, node = [], -1
        for i, p in enumerate(self.parents):
            if p == node:
                chain.append(self.tokens[i])
                node = i
        return DraftTree(tuple(chain))

    # -- verification ------------------------------------------------------------------------------------------
    def walk(self, sampled: Sequence[int]) -> tuple[list[int], int]:
        """Sample-then-match. ``sampled[r]`` is the target's draw at row r (row 0: after the last committed token,
        row 1 + i: after node i). Returns (accepted node indices, root first, and the bonus token)."""
        if self.parents is None:                   # a chain: the accepted prefix is where draft and draw agree
            n = 0
            while n < len(self.tokens) and sampled[n] == self.tokens[n]:
                n += 1
            return list(range(n)), int(sampled[n])
        children = self.children()
        path: list[int] = []
        node = -1
        while True:
            y = int(sampled[node + 1])
            child = children.get(node, {}).get(y)
            if child is None:
                return path, y
            path.append(child)
            node = child

    def accepted_length(self, truth: Sequence[int]) -> int:
        """Tokens a greedy verifier would accept if the target's tokens were ``truth``: the length of the longest
        root path that is a prefix of ``truth`` (of duplicate siblings only the first is followed, as in ``walk``)."""
        children = self.children()
        node, n = -1, 0
        while n < len(truth):
            node = children.get(node, {}).get(int(truth[n]), -2)
            if node == -2:
                break
            n += 1
        return n

    # -- the forward pass --------------------------------------------------------------------------------------
    def positions(self, last_position: int) -> list[int]:
        """Position of each node: the last committed token's position plus the node's depth."""
        return [last_position + d for d in self.depths()]

    def ancestor_mask(self) -> list[list[bool]]:
        """[n][n]: node i may see node j iff j is i or one of its ancestors (the draft part of the tree mask)."""
        n = len(self.tokens)
        mask = [[False] * n for _ in range(n)]
        for i in range(n):
            p = self.parent(i)
            if p >= 0:
                mask[i][:] = mask[p]
            mask[i][i] = True
        return mask

    # -- building ----------------------------------------------------------------------------------------------
    @staticmethod
    def merge(trees: Iterable["DraftTree"], max_nodes: int) -> "DraftTree":
        """One tree holding ``trees`` in priority order (a path shared by several is stored once), cut at
        ``max_nodes``. Nodes whose parent did not fit are dropped with their subtrees."""
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, int], int] = {}          # (parent node, token) -> node
        for tree in trees:
            mapped: list[int] = []                         # this tree's node -> merged node, -2 when dropped
            for i, tok in enumerate(tree.tokens):
                p = tree.parent(i)
                parent = mapped[p] if p >= 0 else -1
                node = -2 if parent == -2 else node_of.get((parent, tok), -2)
                if node == -2 and parent != -2 and len(tokens) < max_nodes:
                    tokens.append(tok)
                    parents.append(parent)
                    node = node_of[(parent, tok)] = len(tokens) - 1
                mapped.append(node)
        return DraftTree.of(tokens, parents)

    @staticmethod
    def from_paths(paths: Iterable[Sequence[int]], max_nodes: int) -> "DraftTree":
        """A prefix-shared tree from token paths, in priority order, cut at ``max_nodes``."""
        return DraftTree.merge((DraftTree.of(p) for p in paths), max_nodes)


EMPTY = DraftTree()
