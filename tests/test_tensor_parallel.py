"""Tensor parallelism (engine/tp_executor.py, model/parallel_layers.py) on CPU with gloo and two processes: the
sharded model gives TP=1's logits (float32 tolerance) and greedy tokens on each architecture, with KV heads split
and replicated and an uneven vocabulary split; a batch with everything above the executor boundary (chunked prefill,
prefix-cache hits, n > 1, an n-gram drafter, beam forks, DoLa) gives the same outputs; workers stop cleanly, a
killed worker is a clear error and not a hang, and bad settings are ValueErrors naming the field."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from conftest import assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.assets import default_model_path
from leapdecode.decoding.beam_search import BeamSearchParams
from leapdecode.engine import tp_executor
from leapdecode.engine.step import ScheduledSeq, lay_out
from leapdecode.engine.sequence import Sequence
from leapdecode.model.config import ModelConfig
from leapdecode.model.parallel_layers import check_shardable

TIMEOUT_S = 30      # collectives and start-up give up after this long here, so a broken test cannot hang


@pytest.fixture(autouse=True)
def one_thread_short_timeouts(monkeypatch):
    """One torch thread in this process and in the workers (they take the engine's count), short timeouts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(tp_executor, "TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setenv("LEAPDECODE_TP_TIMEOUT", str(TIMEOUT_S))
    yield
    torch.set_num_threads(threads)
    assert not dist.is_initialized(), "a test left this process in a process group"


def plan_logits(llm, tokens: list[int], chunks: list[int], capture=()):
    """Feed ``tokens`` through the executor in the given chunk sizes (hand-made plans, every row's logits), with
    the hidden states of ``capture`` for every row."""
    engine = llm.engine
    seq = Sequence("tp", 0, tokens, SamplingParams())
    assert engine.block_manager.allocate(seq, len(tokens))
    logits, hidden, start = [], {i: [] for i in capture}, 0
    for n in chunks:
        chunk = ScheduledSeq(seq.seq_id, start, tuple(tokens[start:start + n]), tuple(seq.block_table),
                             prompt_logprobs=True)
        out = engine.runner.execute(lay_out(0, engine.cfg.block_size, [chunk]), capture=capture, all_rows=True)
        logits.append(out.logits)
        for i in capture:
            hidden[i].append(out.hidden_states[i])
        start += n
    engine.block_manager.free_seq(seq)
    return torch.cat(logits), {i: torch.cat(h) for i, h in hidden.items()}


PROMPTS = ["Once upon a time there was", "def add(a, b):\n", "The quick brown fox jumps over the lazy dog. The",
           [5, 9, 33, 5, 9, 33, 5, 9]]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),                                   # 4 query heads, 2 KV heads: one KV head per rank
    ("llama", {"num_key_value_heads": 1}),           # one KV head, replicated on both ranks
    ("qwen2", {"vocab_size": 385}),                  # qkv bias; 193 + 192 vocabulary rows
    ("qwen3", {"num_key_value_heads": 1}),           # q/k norm, replicated KV head
], ids=["llama-kv2", "llama-kv1", "qwen2-odd-vocab", "qwen3-kv1"])   # tied embeddings: see the next test
def test_tp2_matches_tp1(tiny_dir, arch, overrides):
    path = tiny_dir(arch, **overrides)
    ref = make_llm(path, block_size=8, cpu_packed_linears=False)   # the ranks' F.linear, as TP runs it
    # overlapped steps (placeholders broadcast to the worker), token counts padded to buckets as on CUDA
    with make_llm(path, block_size=8, tensor_parallel_size=2, async_scheduling=True, pad_to_buckets=True) as tp:
        # each rank's pool holds its own KV heads: half of them, or the one replicated head
        kv = ref.engine.model_cfg.num_kv_heads
        assert tp.engine.runner.kv_cache.num_kv_heads == max(1, kv // 2)
        assert tp.engine.runner.kv_bytes_per_block * (2 if kv >= 2 else 1) == ref.engine.runner.kv_bytes_per_block
        assert tp.engine.runner.num_blocks == ref.engine.runner.num_blocks

        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 384, (30,), generator=g).tolist()
        chunks = [7, 9, 6] + [1] * 8                # uneven chunks straddling blocks, then decode steps
        want, want_h = plan_logits(ref, tokens, chunks, capture=(0, 1, 2))
        got, got_h = plan_logits(tp, tokens, chunks, capture=(0, 1, 2))
        assert got.shape == want.shape == (30, ref.engine.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for i in (0, 1, 2):                         # the residual stream is whole on rank 0 after each all-reduce
            torch.testing.assert_close(got_h[i], want_h[i], rtol=1e-5, atol=1e-5)

        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in tp.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert tp.engine.stats["overlapped_steps"] > 0     # placeholders were broadcast to the worker
        assert_pool_free(tp)


def run_everything(llm):
    """One batch through everything that lives above the executor boundary."""
    shared = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    prompts = [shared + "def factorial(n):\n", shared + "for i in range(10):\n",
               "import os\nfor name in os.listdir('.'):\n    print(name)\n",
               "class Point:\n    def __init__(self, x, y):\n"]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, dola_layers="low"),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1)]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts[:2], params[:2], use_tqdm=False)    # the shared prefix is cached now
    beams = llm.beam_search([shared + "def"], BeamSearchParams(beam_width=3, max_tokens=6))   # forks copy KV
    tokens = [[c.token_ids for c in o.outputs] for o in first + again]
    logprobs = first[3].outputs[0].logprobs + first[3].prompt_logprobs[1:]    # token id -> logprob, per position
    return tokens, logprobs, [[s.tokens for s in b.sequences] for b in beams]


def test_engine_features_above_the_executor_match_tp1():
    """On the embedded code model (6 heads, 2 KV heads, tied embeddings), whose code the n-gram drafter predicts."""
    kw = dict(max_num_batched_tokens=24, block_size=8,                        # long prompts prefill in chunks
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    ref = make_llm(default_model_path(), **kw)
    want = run_everything(ref)
    tp = make_llm(default_model_path(), tensor_parallel_size=2, **kw)
    workers = tp.engine.runner.workers
    try:
        got = run_everything(tp)
        assert got[0] == want[0] and got[2] == want[2]
        assert len(got[1]) == len(want[1])
        for a, b in zip(got[1], want[1]):       # logprobs: same top tokens, values within float32 tolerance
            assert list(a) == list(b) and max(abs(a[t] - b[t]) for t in a) < 1e-4
        assert tp.engine.stats["accepted_tokens"] == ref.engine.stats["accepted_tokens"] > 0
        assert tp.engine.block_manager.hits == ref.engine.block_manager.hits > 0
        assert_pool_free(tp)
    except BaseException:
        tp.close()
        raise
    # clean shutdown: dropping the LLM stops its worker and leaves the process group
    assert all(p.is_alive() for p in workers)
    del tp
    assert not any(p.is_alive() for p in workers) and all(p.exitcode == 0 for p in workers)


def test_a_killed_worker_is_a_clear_error_not_a_hang(tiny_dir):
    llm = make_llm(tiny_dir("llama"), tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        assert llm.generate(["Once upon"], params, use_tqdm=False)[0].outputs[0].token_ids
        (worker,) = llm.engine.runner.workers
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        t0 = time.monotonic()
        with pytest.raises(tp_executor.TensorParallelError, match="rank 1 exited"):
            llm.generate(["Once upon"], params, use_tqdm=False)
        assert time.monotonic() - t0 < 5
        with pytest.raises(tp_executor.TensorParallelError, match="group is down"):    # and it stays down
            llm.engine.runner.execute(lay_out(0, 16, [ScheduledSeq(-1, 0, (1, 2), (0,), samples=True)]))
    finally:
        llm.close()


def test_a_worker_that_raises_reports_its_traceback(tiny_dir):
    llm = make_llm(tiny_dir("llama"), tensor_parallel_size=2)
    try:
        with pytest.raises(RuntimeError, match="one per process"):     # the group is this process's
            make_llm(tiny_dir("llama"), tensor_parallel_size=2)
        runner = llm.engine.runner
        with pytest.raises(tp_executor.TensorParallelError, match="unknown tensor-parallel command 'nonsense'"):
            runner._on_all_ranks(("nonsense",), lambda: runner.tp.all_reduce(torch.ones(2)))
    finally:
        llm.close()
    assert not any(p.is_alive() for p in runner.workers)


def test_no_orphans_when_the_engine_process_is_killed(tiny_dir):
    script = textwrap.dedent(f"""
        import sys, time, torch
        from leapdecode import LLM
        if __name__ == "__main__":
            torch.set_num_threads(1)
            llm = LLM({tiny_dir("llama")!r}, dtype="float32", max_model_len=64, tensor_parallel_size=2)
            print(*[p.pid for p in llm.engine.runner.workers], flush=True)
            time.sleep(600)
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in pids)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan that exited waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_bad_tensor_parallel_size(tiny_dir, value):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(tiny_dir("llama"), tensor_parallel_size=value)


def test_models_that_do_not_shard_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 4 attention heads"):
        make_llm(tiny_dir("llama"), tensor_parallel_size=3)
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 96,
                               "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 12,
                               "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="tensor_parallel_size=3 and the model's 4 KV heads"):
        check_shardable(cfg, 3)
    check_shardable(cfg, 2)
    check_shardable(cfg, 12)


@pytest.mark.parametrize("method", ["draft_model", "layer_skip", "eagle", "auto+layer_skip"])
def test_model_drafters_are_refused(tiny_dir, method):
    spec = ({"method": "auto", "methods": ["suffix", "layer_skip"]} if method.startswith("auto")
            else {"method": method})
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        make_llm(tiny_dir("llama"), tensor_parallel_size=2, speculative_config=spec)
