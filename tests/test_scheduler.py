"""The scheduler and the block manager without a model: plans are inspected, results are fabricated (as vLLM's
scheduler tests do), and the counters, block tables and the pool are checked after every move."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.scheduler import Scheduler
from leapdecode.engine.sequence import Sequence, SequenceStatus
from leapdecode.engine.step import PLACEHOLDER, SeqResult, StepResult
from leapdecode.engine.stop import StopChecker
from leapdecode.sampling_params import SamplingParams
from leapdecode.spec.tree import DraftTree

EOS = 1
BS = 4


def make(num_blocks=64, budget=32, max_seqs=16, max_model_len=256, caching=True):
    bm = BlockManager(num_blocks, BS, caching)
    return Scheduler(bm, budget, max_seqs, StopChecker({EOS}, max_model_len))


def seq(prompt, **params):
    params.setdefault("max_tokens", 8)
    params.setdefault("ignore_eos", False)
    return Sequence("r", 0, list(prompt), SamplingParams(**params))


def result(plan, accept=None, bonus=7):
    """Fabricate a step result: each sampling sequence accepts ``accept(chunk)`` draft nodes (default all of its
    first chain) and then samples ``bonus``."""
    seqs = {}
    for c in plan.seqs:
        if not c.samples:
            continue
        chain = c.draft.first_chain()
        n = len(chain) if accept is None else accept(c)
        truth = list(chain.tokens[:n]) + [bonus]
        path, b = c.draft.walk(truth + [bonus] * len(c.draft))
        seqs[c.seq_id] = SeqResult(c.seq_id, tuple(path), tuple(c.draft.tokens[i] for i in path) + (b,))
    return StepResult(plan.step_id, seqs)


def run_step(s, by_id, drafts=None, **kw):
    plan = s.schedule(drafts)
    out = s.update(plan, result(plan, **kw), by_id)
    return plan, out


def assert_pool_consistent(s, live):
    bm = s.bm
    refs = [0] * bm.num_blocks
    for q in live:
        assert len(q.block_table) * BS >= q.num_computed_tokens
        for b in q.block_table:
            refs[b] += 1
    assert refs == bm.ref_counts
    assert sorted(bm.free) == [b for b in range(bm.num_blocks) if refs[b] == 0]


def test_chunked_prefill_under_the_budget_then_decode():
    s = make(budget=32)
    a = seq(range(2, 102), max_tokens=3)
    s.add(a)
    by_id = {a.seq_id: a}
    sizes = []
    for _ in range(4):
        plan, _ = run_step(s, by_id)
        (c,) = plan.seqs
        sizes.append((c.start, c.num_new_tokens, c.samples))
        assert plan.num_tokens <= 32
    assert sizes == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert a.num_tokens == 101 and a.num_computed_tokens == 100
    plan, _ = run_step(s, by_id)                       # decode: the last token is computed, one sampled
    assert [(c.start, c.token_ids) for c in plan.seqs] == [(100, (7,))]
    run_step(s, by_id)
    assert a.is_finished and a.finish_reason == "length" and a.output_token_ids == [7, 7, 7]
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_decodes_first_then_prefills_and_the_budget_is_shared():
    s = make(budget=10)
    a, b = seq([2, 3, 4], max_tokens=5), seq(range(2, 40))
    by_id = {a.seq_id: a, b.seq_id: b}
    s.add(a)
    run_step(s, by_id)                                 # a's prompt
    s.add(b)
    plan, _ = run_step(s, by_id)
    assert [c.seq_id for c in plan.seqs] == [a.seq_id, b.seq_id]
    assert [c.num_new_tokens for c in plan.seqs] == [1, 9]      # the decode first, the prefill takes the rest
    plan, _ = run_step(s, by_id)
    assert plan.seqs[0].seq_id == a.seq_id and plan.seqs[0].num_new_tokens == 1   # never stalled by b


def test_drafts_ride_on_decodes_and_the_budget_trims_them():
    s = make(budget=4)
    a = seq([2, 3, 4, 5], max_tokens=20)
    by_id = {a.seq_id: a}
    s.add(a)
    run_step(s, by_id)
    tree = DraftTree.of([10, 11, 12, 13, 14], [-1, 0, 1, -1, 3])
    plan = s.schedule({a.seq_id: tree})
    (c,) = plan.seqs
    assert c.draft == tree.prefix(3) and c.num_new_tokens == 4 and c.token_ids == (7, 10, 11, 12)
    assert c.num_samples == 4 and plan.num_samples == 4
    assert c.positions() == [4, 5, 6, 7]
    s.update(plan, result(plan, accept=lambda c: 2), by_id)     # 10, 11 accepted, 12 rejected, bonus 7
    assert a.output_token_ids == [7, 10, 11, 7]
    assert a.num_computed_tokens == 7 == a.num_tokens - 1         # rollback: the rejected node is not computed
    assert s.draft_room(a) == 20 - 4 - 1
    # a prefill never takes a draft
    b = seq(range(2, 30))
    s.add(b)
    by_id[b.seq_id] = b
    plan = s.schedule({b.seq_id: DraftTree.of([5])})
    assert all(not c.draft for c in plan.seqs)


def test_an_accepted_tree_branch_is_moved_into_place_before_the_next_forward():
    s = make()
    a = seq([2, 3, 4], max_tokens=20)
    by_id = {a.seq_id: a}
    s.add(a)
    run_step(s, by_id)
    tree = DraftTree.of([20, 10, 11], [-1, -1, 1])               # wrong sibling first, then the true chain
    plan = s.schedule({a.seq_id: tree})
    truth = {a.seq_id: SeqResult(a.seq_id, (1, 2), (10, 11, 9))}
    s.update(plan, StepResult(plan.step_id, truth), by_id)
    assert a.output_token_ids == [7, 10, 11, 9]
    nxt = s.schedule()
    table = plan.seqs[0].block_table
    slot = lambda i: table[i // BS] * BS + i % BS
    assert nxt.kv_moves == ((slot(4 + 1), slot(4 + 0)), (slot(4 + 2), slot(4 + 1)))
    assert s.schedule().kv_moves == ()                             # handed over once


def test_stop_inside_accepted_tokens_ends_there_and_frees_the_blocks():
    s = make()
    a = seq([2, 3, 4], max_tokens=20)
    by_id = {a.seq_id: a}
    s.add(a)
    run_step(s, by_id)
    plan = s.schedule({a.seq_id: DraftTree.of([10, EOS, 12])})
    out = s.update(plan, result(plan), by_id)
    assert a.output_token_ids == [7, 10, EOS] and a.finish_reason == "stop" and out.finished == [a]
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.running


def test_preemption_recomputes_and_loses_nothing():
    s = make(num_blocks=6, budget=64)
    a, b = seq(range(2, 14), max_tokens=8), seq(range(20, 32), max_tokens=8)
    by_id = {a.seq_id: a, b.seq_id: b}
    s.add(a)
    s.add(b)
    run_step(s, by_id)                                 # both prompts: 3 + 3 blocks, the pool is full
    assert s.bm.num_free_blocks == 0
    plan, _ = run_step(s, by_id)                       # a needs a 4th block: b (the youngest) is preempted
    assert plan.preempted == (b.seq_id,) and b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert s.num_preemptions == 1
    assert_pool_consistent(s, [a])
    while not a.is_finished:
        run_step(s, by_id)
    while not b.is_finished:
        plan, _ = run_step(s, by_id)
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8   # b kept its token and resumed
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_prefix_cache_hit_after_the_first_request_commits():
    s = make(budget=64)
    prompt = list(range(2, 15))                         # 13 tokens: 3 full blocks
    a = seq(prompt, max_tokens=1)
    by_id = {a.seq_id: a}
    s.add(a)
    run_step(s, by_id)
    assert a.is_finished
    b = seq(prompt + [40], max_tokens=1)
    by_id[b.seq_id] = b
    s.add(b)
    plan = s.schedule()
    assert b.num_cached_tokens == 12 and plan.seqs[0].start == 12 and plan.seqs[0].token_ids == (14, 40)
    s.update(plan, result(plan), by_id)
    assert s.bm.num_free_blocks == s.bm.num_blocks
    c = seq(prompt, max_tokens=1, prompt_logprobs=1)    # prompt logprobs need every row: no prefix hit
    by_id[c.seq_id] = c
    s.add(c)
    assert s.schedule().seqs[0].start == 0


def test_n_siblings_fork_after_the_prompt_and_share_its_full_blocks():
    s = make(budget=64)
    prompt = list(range(2, 15))
    parent, child = seq(prompt, max_tokens=2), seq(prompt, max_tokens=2)
    by_id = {parent.seq_id: parent, child.seq_id: child}
    s.add(parent, [child])
    plan, _ = run_step(s, by_id)
    assert [c.seq_id for c in plan.seqs] == [parent.seq_id]
    assert child.block_table == parent.block_table[:3] and child.num_computed_tokens == 12
    assert all(s.bm.ref_counts[b] == 2 for b in child.block_table)
    plan, _ = run_step(s, by_id)
    assert {c.seq_id: (c.start, c.num_new_tokens) for c in plan.seqs} == {parent.seq_id: (13, 1),
                                                                          child.seq_id: (12, 1)}
    while not (parent.is_finished and child.is_finished):
        run_step(s, by_id)
    assert s.bm.num_free_blocks == s.bm.num_blocks


@pytest.mark.parametrize("when", ["waiting", "unforked", "running", "in_flight"])
def test_abort_at_every_point_frees_everything(when):
    s = make(budget=64)
    a, sib = seq(range(2, 20), max_tokens=5), seq(range(2, 20), max_tokens=5)
    by_id = {a.seq_id: a, sib.seq_id: sib}
    s.add(a, [sib])
    if when == "waiting":
        s.finish(a)
        s.finish(sib)
    elif when == "unforked":
        s.finish(sib)
        run_step(s, by_id)
        assert not s.waiting
        s.finish(a)
    elif when == "running":
        run_step(s, by_id)
        s.finish(a)
        s.finish(sib)
    else:
        plan = s.schedule()
        s.finish(a)
        s.finish(sib)
        del by_id[a.seq_id], by_id[sib.seq_id]
        assert s.update(plan, result(plan), by_id).touched == []
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.running and not s.waiting


def test_a_placeholder_lets_the_next_step_be_planned_before_the_tokens_are_read():
    s = make()
    a = seq([2, 3, 4], max_tokens=3)
    by_id = {a.seq_id: a}
    s.add(a)
    p1 = s.schedule()
    p2 = s.schedule()                                  # planned while p1 is in flight
    (c,) = p2.seqs
    assert c.start == 3 and c.token_ids == (PLACEHOLDER,) and p2.placeholders == ((0, p1.seqs[0].sample_start),)
    s.update(p1, result(p1, bonus=8), by_id)
    p3 = s.schedule()
    s.update(p2, result(p2, bonus=9), by_id)
    assert not s.schedule()                            # max_tokens reached with the third token in flight
    s.update(p3, result(p3, bonus=10), by_id)
    assert a.output_token_ids == [8, 9, 10] and a.finish_reason == "length"
    assert s.bm.num_free_blocks == s.bm.num_blocks


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_traffic_keeps_the_pool_consistent(seed):
    """Random arrivals, drafts, acceptances, stops, aborts and a tight pool: after every step the block
    ref counts equal the block tables, counters never pass the tokens, and everything is freed at the end."""
    rng = random.Random(seed)
    s = make(num_blocks=rng.randint(8, 24), budget=rng.randint(4, 40), max_seqs=rng.randint(1, 6),
             max_model_len=64)
    by_id, live = {}, []
    for step in range(60):
        if rng.random() < 0.3:
            n = rng.randint(1, 3)
            prompt = [rng.randrange(2, 6) for _ in range(rng.randint(1, 20))]
            group = [seq(prompt, max_tokens=rng.randint(1, 12)) for _ in range(n)]
            s.add(group[0], group[1:])
            for q in group:
                by_id[q.seq_id] = q
                live.append(q)
        drafts = {q.seq_id: DraftTree.of([rng.randrange(2, 6) for _ in range(rng.randint(0, 4))])
                  for q in s.decoding()}
        plan = s.schedule(drafts)
        for c in plan.seqs:
            q = by_id[c.seq_id]
            assert q.num_computed_tokens <= q.num_tokens + q.num_placeholders + len(c.draft)
        if rng.random() < 0.1 and live:
            victim = rng.choice(live)
            if not victim.is_finished:
                s.finish(victim)
        res = result(plan, accept=lambda c: rng.randint(0, len(c.draft)), bonus=rng.choice([EOS, 3, 4]))
        s.update(plan, res, by_id)
        live = [q for q in live if not q.is_finished]
        for q in live:
            assert q.num_placeholders == 0 and q.num_computed_tokens <= q.num_tokens
        assert_pool_consistent(s, live)
    for q in live:
        s.finish(q)
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_a_step_that_chooses_no_token_computes_the_last_token_again():
    s = make()
    a = seq([2, 3, 4, 5, 6], max_tokens=4)
    by_id = {a.seq_id: a}
    s.add(a)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {a.seq_id: SeqResult(a.seq_id, (), ())}), by_id)
    assert a.output_token_ids == [] and a.num_computed_tokens == 4 and a.is_decoding
    plan, _ = run_step(s, by_id)                       # the prompt's last token again, and now a token
    assert [(c.start, c.token_ids, c.samples) for c in plan.seqs] == [(4, (6,), True)]
    assert a.output_token_ids == [7]


@pytest.mark.parametrize("prompt_len", [8, 10])      # the prompt fills whole blocks, or ends inside one
def test_fork_shares_full_blocks_and_copies_the_partial_one(prompt_len):
    s = make(num_blocks=16)
    a = seq(range(2, 2 + prompt_len), max_tokens=6)
    by_id = {a.seq_id: a}
    s.add(a)
    plan = s.schedule()
    child = s.fork(a, 9, index=1)                      # between the step and its update
    by_id[child.seq_id] = child
    s.update(plan, result(plan), by_id)
    full, tail = divmod(prompt_len, BS)
    assert child.token_ids == a.token_ids[:-1] + [9] and a.output_token_ids == [7]
    assert child.block_table[:full] == a.block_table[:full]          # shared, reference counted
    assert child.num_computed_tokens == prompt_len and child.is_decoding
    nxt = s.schedule()
    if tail:
        assert child.block_table[full] != a.block_table[full]         # its own copy of the partial block
        src, dst = a.block_table[full] * BS, child.block_table[full] * BS
        assert nxt.kv_moves == tuple((src + i, dst + i) for i in range(tail))
    else:
        assert nxt.kv_moves == ()
    assert sorted((c.seq_id, c.token_ids) for c in nxt.seqs) == sorted([(a.seq_id, (7,)), (child.seq_id, (9,))])
    assert_pool_consistent(s, [a, child])
    s.update(nxt, result(nxt), by_id)
    s.finish(a)
    assert_pool_consistent(s, [child])
    s.finish(child)
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_fork_without_a_free_block_recomputes_the_tail():
    s = make(num_blocks=3)
    a = seq(range(2, 12), max_tokens=2)                # 10 tokens: 3 blocks, the last one partial
    by_id = {a.seq_id: a}
    s.add(a)
    plan = s.schedule()
    child = s.fork(a, 9, index=1)
    assert child.num_computed_tokens == 8 and len(child.block_table) == 2
    assert_pool_consistent(s, [a, child])
    s.finish(child)
    s.finish(a)
    assert s.bm.num_free_blocks == s.bm.num_blocks
