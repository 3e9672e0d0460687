"""Lossless verification of drafts (chains and token trees).

Point-mass drafts (every model-free drafter) are verified by *sample, then match*: at each verified position draw
the target's token y exactly as plain decoding would (same processing, same sampler); if y is one of the draft's
children there, that child is accepted and we descend, otherwise y itself is the bonus token and we stop. For one
child x this accepts with probability p(x) and, on rejection, y is distributed as p with x removed and
renormalised: the standard speculative-sampling rule, and it stays exact with several children (a tree), since y
is always a true sample from p. Greedy is the special case y = argmax p. With no draft it is plain decoding.
The walk itself is ``DraftTree.walk`` (spec/tree.py); the batched driver is ``sampling/verifier.py``.

Drafts that carry their own distributions q (draft models, layer skipping: a chain whose token j was drawn from
q_j) use the classic rule instead (Leviathan et al. 2023, Chen et al. 2023): accept x_j with probability
min(1, p_j(x_j)/q_j(x_j)); at the first rejection draw the next token from normalize(max(p_j - q_j, 0)); when every
node is accepted the bonus token is the ordinary draw from p_k. Each emitted token is then distributed exactly as
p, and a draft token is accepted with probability sum_x min(p, q), not the sum_x p q of matching two independent
draws. :func:`speculative_chains` does it for a whole batch with one host synchronisation; the acceptance
uniforms of a seeded request are keyed like its sampling uniforms (seed, sample index, position) under their own
salt, so a seeded request is reproducible whenever it sees the same drafts.
"""
from __future__ import annotations

import torch

ACCEPT_SALT = 0x5DEECE66D          # seeded acceptance uniforms: seeded_uniform(seed ^ ACCEPT_SALT, index, position)
DRAFT_SALT = 0x2545F4914F6CDD1D    # seeded draft draws (drafters): seeded_uniform(seed ^ DRAFT_SALT, ...)


def verify_with_draft_probs(p: torch.Tensor, q: torch.Tensor, draft: list[int], generator: torch.Generator | None
                            ) -> tuple[int, int]:
    """Chain drafts with draft distributions. p: [k + 1, V] target, q: [k, V] draft -> (num accepted, next token).
    The one-sequence reference of :func:`speculative_chains` (kept for tests and replay tools)."""
    k = len(draft)
    idx = torch.arange(k, device=p.device)
    x = torch.tensor(draft, device=p.device)
    ratio = (p[idx, x] / q[idx, x].clamp_min(1e-20)).clamp(max=1.0)
    u = torch.rand(k, device=p.device, generator=generator)
    rejected = (u >= ratio).nonzero()
    if len(rejected) == 0:
        return k, int(torch.multinomial(p[k], 1, generator=generator))
    j = int(rejected[0])
    residual = (p[j] - q[j]).clamp_min(0)
    if residual.sum() <= 0:            # p == q up to rounding: the residual is empty, p itself is exact
        residual = p[j]
    return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def speculative_chains(p: torch.Tensor, sampled: torch.Tensor, u: torch.Tensor,
                       chains: list[tuple[int, tuple[int, ...], torch.Tensor]], u_accept: torch.Tensor
                       ) -> tuple[torch.Tensor, list[int]]:
    """The min(1, p/q) rule for several chains at once.

    p: [R, V] the target's processed probabilities per sample row; ``sampled``: [R] the ordinary draws from p
    with the uniforms ``u`` [R] (float64); ``chains``: (first sample row r0, draft tokens x_0..x_{k-1}, q [k, V])
    per sequence, row r0 + j verifying x_j; ``u_accept``: one uniform per draft node, in ``chains`` order.
    Returns (the emitted token per sample row, number accepted per chain): row r0 + j holds x_j for every
    accepted j, the residual draw at the first rejected j (drawn with that row's ``u``), and the ordinary draw
    at row r0 + k when all are accepted, so that ``DraftTree.walk`` over it accepts exactly the same prefix (a
    residual draw never equals the rejected token: its residual mass is 0)."""
    from leapdecode.sampling.sampler import inverse_cdf_sample

    dev = p.device
    rows = torch.tensor([r0 + j for r0, x, _ in chains for j in range(len(x))], device=dev)
    xs = torch.tensor([t for _, x, _ in chains for t in x], device=dev)
    q = torch.cat([qc.to(device=dev, dtype=p.dtype) for _, _, qc in chains])
    qx = q.gather(1, xs[:, None]).squeeze(1)
    px = p[rows].gather(1, xs[:, None]).squeeze(1)
    accept = (u_accept.to(dev, torch.float64) * qx.double() < px.double()).tolist()   # u < p/q, q > 0 as drawn
    emitted = sampled.clone()
    n_acc: list[int] = []
    res_rows: list[int] = []
    res_q: list[int] = []
    i = 0
    for r0, x, _ in chains:
        n = 0
        while n < len(x) and accept[i + n]:
            n += 1
        n_acc.append(n)
        if n < len(x):
            res_rows.append(r0 + n)
            res_q.append(i + n)
        i += len(x)
    if n_acc and any(n_acc):
        acc_rows = [r0 + j for (r0, _, _), n in zip(chains, n_acc) for j in range(n)]
        acc_tok = [x[j] for (_, x, _), n in zip(chains, n_acc) for j in range(n)]
        emitted[torch.tensor(acc_rows, device=dev)] = torch.tensor(acc_tok, device=dev, dtype=emitted.dtype)
    if res_rows:
        rr = torch.tensor(res_rows, device=dev)
        residual = (p[rr] - q[torch.tensor(res_q, device=dev)]).clamp_min(0)
        empty = residual.sum(-1, keepdim=True) <= 0          # p == q up to rounding: p itself is exact
        residual = torch.where(empty, p[rr], residual)
        emitted[rr] = inverse_cdf_sample(residual, u[rr]).to(emitted.dtype)
    return emitted, n_acc


# -- several candidates per position (token trees drawn from q) ---------------------------------------------------

def recursive_rejection(p: torch.Tensor, q: torch.Tensor, candidates: list[int], u_accept: list[float],
                        u_final: float) -> tuple[int, int]:
    """Recursive rejection sampling over siblings drawn from q *without replacement* (RSD, Jeon et al. 2024; the
    multi-draft view of SpecTr): one position, several candidates.

    ``candidates`` x_1..x_m were drawn in that order from q_1 = q, q_2 = q_1 without x_1 (renormalised), ... .
    Stage i accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = normalize(max(p_i -
    q_i, 0)). If every candidate is rejected the token is drawn from p_{m+1} (inverse CDF at ``u_final``).
    The output is distributed exactly as p: given the rejected x_i, stage i+1 is a speculative-sampling step with
    target p_{i+1} (which does not depend on x_i) and any proposal, so it returns an exact sample of p_{i+1}, and
    P(out = y) = q_i(y) min(1, p_i(y)/q_i(y)) + P(reject) p_{i+1}(y) = p_i(y); by induction from the last stage.
    p, q: [V] probabilities (any float dtype); returns (index of the accepted candidate or -1, the token)."""
    from leapdecode.sampling.sampler import inverse_cdf_sample

    p = p.double()
    q = q.double().clone()
    for i, x in enumerate(candidates):
        total = q.sum()
        if total <= 0:
            break
        qi = q / total
        if u_accept[i] * qi[x] < p[x]:
            return i, int(x)
        residual = (p - qi).clamp_min(0)
        if residual.sum() > 0:             # (empty only when p == q_i up to rounding: p itself is then exact)
            p = residual / residual.sum()
        q[x] = 0.0
    token = inverse_cdf_sample(p[None], torch.tensor([u_final], dtype=torch.float64, device=p.device))
    return -1, int(token[0])


def verify_tree_with_probs(tree, p_rows: torch.Tensor, q_rows: torch.Tensor, u_accept: torch.Tensor,
                           u_rows: torch.Tensor) -> tuple[list[int], int]:
    """Walk a token tree whose siblings were drawn from q without replacement, keeping p exactly.

    ``tree``: a ``DraftTree`` whose children of each node are listed in the order they were drawn; ``p_rows``
    [1 + n, V]: the target's processed probabilities after the last committed token (row 0) and after node i (row
    1 + i); ``q_rows`` [n, V]: the distribution node i was drawn from (siblings share it); ``u_accept`` [n]: one
    acceptance uniform per node; ``u_rows`` [1 + n]: one uniform per row for the final draw. Returns (accepted
    nodes root first, the bonus token), like ``DraftTree.walk``."""
    children: dict[int, list[int]] = {}
    for i in range(len(tree)):
        children.setdefault(tree.parent(i), []).append(i)
    ua = u_accept.tolist()
    path: list[int] = []
    node = -1
    while True:
        kids = children.get(node, [])
        if not kids:
            return path, int(inverse_cdf_sample_row(p_rows[node + 1], float(u_rows[node + 1])))
        j, token = recursive_rejection(p_rows[node + 1], q_rows[kids[0]], [tree.tokens[c] for c in kids],
                                       [ua[c] for c in kids], float(u_rows[node + 1]))
        if j < 0:
            return path, token
        node = kids[j]
        path.append(node)


def inverse_cdf_sample_row(p: torch.Tensor, u: float) -> int:
    from leapdecode.sampling.sampler import inverse_cdf_sample
    return int(inverse_cdf_sample(p[None].double(), torch.tensor([u], dtype=torch.float64, device=p.device))[0])
