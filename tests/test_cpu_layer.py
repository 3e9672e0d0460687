"""The one-call decoder layer on the CPU (model/cpu_layer.py): the same bits as the layer-by-layer path, for plain
decoding, chain and tree verification and int8 drafts, and taken where the step allows it."""
import pytest
import torch

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.assets import default_model_path
from leapdecode.model import cpu_layer, int8_linear, packed_linear
from leapdecode.model.int8_linear import Int8Linear

pytestmark = pytest.mark.skipif(packed_linear.float_rows() is None,
                                reason="no row kernel for float32 weights here (no compiler or no AVX-512): the tiny "
                                       "float models' layers run module by module")


def _observe(monkeypatch, seen) -> None:
    """Call ``seen(layer_idx, kind, rows, meta)`` for every layer the one-call path runs, one at a time
    (``cpu_layer.run``) or a model's range of layers at once (``LayerStack``); kind "int8" or "float"."""
    real_run, real_stack = cpu_layer.run, cpu_layer.LayerStack.__call__

    def run(layer, x, meta):
        out = real_run(layer, x, meta)
        if out is not None:
            seen(layer.self_attn.layer_idx, "int8" if isinstance(layer.self_attn.qkv_proj, Int8Linear) else "float",
                 x.shape[0], meta)
        return out

    def stack(self, x, meta, layers):
        out = real_stack(self, x, meta, layers)
        if out is not None:
            for i in layers:
                seen(i, "float" if self.rows_max is None else "int8", x.shape[0], meta)
        return out
    monkeypatch.setattr(cpu_layer, "run", run)
    monkeypatch.setattr(cpu_layer.LayerStack, "__call__", stack)


def _module_path(monkeypatch) -> None:
    """Every layer module by module: the one-call layer, alone and in a model's stack, held off."""
    monkeypatch.setattr(cpu_layer, "run", lambda *a: None)
    monkeypatch.setattr(cpu_layer, "stack_of", lambda *a: None)


def _counting(monkeypatch, taken: dict) -> None:
    def seen(idx, kind, rows, meta):
        taken[kind, rows] = taken.get((kind, rows), 0) + 1
        if len(meta.cpu_step.tensors) > 8:          # several attention groups (e.g. decodes and verifications)
            taken["groups"] = taken.get("groups", 0) + 1
    _observe(monkeypatch, seen)


def _generate(llm, prompts, params, batch=False):
    if batch:
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]   # batch 1
    assert_pool_free(llm)
    return [(o.token_ids, o.logprobs) for o in outs]


def test_one_call_layer_gives_the_module_paths_bits(llama_dir, monkeypatch):
    """Greedy tokens and every logprob equal, bit for bit, with the one-call layer and without it, for plain
    decoding and for chain and tree verification (some drafts rejected), and equal to plain decoding's: a tree's
    nodes are attended by slot, in plain decoding's key order (torch_ref._tree_rows). Fails if the one-call path is
    never taken, computes anything differently, or tree nodes are read in place (their sums then differ in the last
    bits)."""
    prompts = [[3 + (7 * i + j) % 50 for j in range(20)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    taken: dict = {}
    _counting(monkeypatch, taken)
    plain = _generate(make_llm(llama_dir), prompts, params)
    truth = {tuple(p): [[t for t in r[0]]] for p, r in zip(prompts, plain)}
    results = {}
    for tree in (False, True):
        spec = {"drafter": OracleDrafter(truth, wrong_every=3, tree=tree), "num_speculative_tokens": 4,
                "adaptive": False}
        results[tree] = _generate(make_llm(llama_dir, speculative_config=spec), prompts, params)
    assert taken.get(("float", 1), 0) > 0 and sum(n for (_, rows), n in taken.items() if rows > 1) > 0, taken
    _module_path(monkeypatch)                                        # the layer-by-layer path
    assert _generate(make_llm(llama_dir), prompts, params) == plain
    for tree in (False, True):
        spec = {"drafter": OracleDrafter(truth, wrong_every=3, tree=tree), "num_speculative_tokens": 4,
                "adaptive": False}
        module = _generate(make_llm(llama_dir, speculative_config=spec), prompts, params)
        assert [t for t, _ in module] == [t for t, _ in plain]
        assert module == results[tree] == plain, tree


def test_a_models_layers_run_in_one_call_with_the_layer_by_layer_bits(llama_dir, monkeypatch):
    """The model's stack (``LayerStack``: every layer of a forward in one C++ call) gives plain decoding's and chain
    verification's greedy tokens and logprobs bit for bit as each layer in its own call and as the module path, and
    it is what runs them: with it, no target layer goes through ``cpu_layer.run``. A forward that captures an
    intermediate layer (DoLa's early exits) runs layer by layer. Fails if the stack is never taken, or runs a
    layer differently."""
    prompts = [[3 + (5 * i + j) % 60 for j in range(18)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3)
    counts = {"stack": 0, "run": 0}
    real_stack, real_run = cpu_layer.LayerStack.__call__, cpu_layer.run

    def stack(self, x, meta, layers):
        out = real_stack(self, x, meta, layers)
        counts["stack"] += out is not None
        return out

    def run(layer, x, meta):
        out = real_run(layer, x, meta)
        counts["run"] += out is not None
        return out
    monkeypatch.setattr(cpu_layer.LayerStack, "__call__", stack)
    monkeypatch.setattr(cpu_layer, "run", run)
    plain = _generate(make_llm(llama_dir), prompts, params)
    truth = {tuple(p): [list(r[0])] for p, r in zip(prompts, plain)}

    def spec():
        return {"drafter": OracleDrafter(truth, wrong_every=3), "num_speculative_tokens": 4, "adaptive": False}
    drafted = _generate(make_llm(llama_dir, speculative_config=spec()), prompts, params)
    assert counts["stack"] > 0 and counts["run"] == 0, counts
    counts.update(stack=0, run=0)
    dola = _generate(make_llm(llama_dir), prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                   dola_layers="high"))
    assert counts["run"] > 0, counts                 # early exits captured: layer by layer
    monkeypatch.setattr(cpu_layer, "stack_of", lambda *a: None)     # each layer in its own call
    assert _generate(make_llm(llama_dir), prompts, params) == plain
    assert _generate(make_llm(llama_dir, speculative_config=spec()), prompts, params) == drafted
    _module_path(monkeypatch)
    assert _generate(make_llm(llama_dir), prompts, params) == plain
    assert _generate(make_llm(llama_dir, speculative_config=spec()), prompts, params) == drafted
    assert [t for t, _ in drafted] == [t for t, _ in plain] and dola


def test_one_call_layer_with_several_attention_groups(llama_dir, monkeypatch):
    """Batched steps whose attention plan has several groups (decodes of different context lengths apart from tree
    verifications, a prompt's short chunks beside decodes): greedy tokens and logprobs the module path's, bit for
    bit; fails if such steps never take the one-call path."""
    prompts = [[3 + (7 * i + j) % 50 for j in range(8 + 30 * (i % 3))] for i in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = _generate(make_llm(llama_dir, max_num_batched_tokens=64), prompts, params, batch=True)
    truth = {tuple(p): [[t for t in r[0]]] for p, r in zip(prompts, plain)}

    def spec():
        return {"drafter": OracleDrafter(truth, wrong_every=3, tree=True), "num_speculative_tokens": 4,
                "adaptive": False}
    taken: dict = {}
    _counting(monkeypatch, taken)
    fused = _generate(make_llm(llama_dir, speculative_config=spec(), max_num_batched_tokens=64), prompts, params,
                      batch=True)
    assert taken.get("groups", 0) > 0, taken
    _module_path(monkeypatch)
    module = _generate(make_llm(llama_dir, speculative_config=spec(), max_num_batched_tokens=64), prompts, params,
                       batch=True)
    assert fused == module
    assert [t for t, _ in fused] == [t for t, _ in plain]


def test_int8_draft_layers_take_one_call_and_draft_the_same(monkeypatch):
    """layer_skip's int8 copy of the target runs its layers in one call too (up to Int8Linear.ROWS_MAX rows), and
    proposes exactly what the layer-by-layer draft proposes: same drafts, same acceptance, same output."""
    if not int8_linear.available():
        pytest.skip("no int8 kernel here")
    prompts = ["def fibonacci(n):\n", "import os\n\nclass Config:\n    def __init__(self, "]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "layer_skip", "num_speculative_tokens": 3, "int8": True, "adaptive": False}

    def run():       # the embedded 4-layer model (layer_skip needs 3 layers or more)
        llm = make_llm(default_model_path(), speculative_config=spec)
        out = _generate(llm, prompts, params)
        return out, (llm.engine.stats["draft_tokens"], llm.engine.stats["accepted_tokens"])

    taken: dict = {}
    _counting(monkeypatch, taken)
    fused = run()
    assert taken.get(("int8", 1), 0) > 0 and fused[1][0] > 0, (taken, fused[1])
    _module_path(monkeypatch)
    assert run() == fused


def test_rows_beyond_an_int8_layers_tile_take_the_module_path(llama_dir):
    """An int8 layer called with more rows than its row-kernel tile (fbgemm's territory) is not run in one call."""
    llm = make_llm(llama_dir)
    layer = llm.engine.runner.model.layers[0]
    copy = int8_linear.int8_copy(layer, ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                         "mlp.down_proj"])
    if copy.self_attn.qkv_proj.kernel != "rows":
        pytest.skip("the int8 layers run through fbgemm here")
    fused = cpu_layer.FusedLayer.of(copy)
    assert fused is not None and fused.rows_max == Int8Linear.ROWS_MAX
    assert cpu_layer.FusedLayer.of(layer).rows_max is None      # the float target's own layer: any rows
    assert cpu_layer.FusedLayer.of(layer) is not fused          # the copy is not confused with its original


def test_an_int8_copy_of_the_model_walks_its_own_layers(llama_dir):
    """``int8_copy`` of a whole model: the list of layers its forward walks (``_layer_list``, kept beside the child
    table) holds the copy's int8 layers, the original's still its own float ones; a shallow copy alone left the
    copy's forward running the original's layers."""
    model = make_llm(llama_dir).engine.runner.model
    names = [f"layers.{n}" for n in int8_linear.linear_names(model.layers)]
    copy = int8_linear.int8_copy(model, names)
    assert all(a is b for a, b in zip(copy._layer_list, copy.layers)) and len(copy._layer_list) == len(copy.layers)
    assert all(a is b for a, b in zip(model._layer_list, model.layers))
    assert isinstance(copy._layer_list[0].self_attn.qkv_proj, Int8Linear)
    assert not isinstance(model._layer_list[0].self_attn.qkv_proj, Int8Linear)


def test_sparse_decode_rows_take_one_call_with_the_module_paths_bits(tiny_dir, monkeypatch):
    """Sparse decoding (per_layer): steps with sparse decode rows beside ordinary ones run through the one-call layer
    (full attention below the first selection layer, the top-k kernel from it on) and give the layer-by-layer
    path's greedy tokens and logprobs bit for bit. Fails if such steps never take the one-call layer, or take it
    with the wrong rule on either side of the first selection layer."""
    deep = tiny_dir("llama", num_hidden_layers=6)
    sparse = {"budget": 16, "window": 4, "dense_layers": 2}
    prompts = [[3 + (11 * i + 7 * j) % 300 for j in range(n)] for i, n in enumerate((300, 140, 220, 10))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    layers = []
    _observe(monkeypatch, lambda idx, kind, rows, meta: meta.cpu_step.sparse is not None and layers.append(idx))
    fused = _generate(make_llm(deep, max_model_len=512, sparse_attention=sparse), prompts, params, batch=True)
    assert set(layers) == set(range(6)), layers
    _module_path(monkeypatch)                                        # the layer-by-layer path
    assert _generate(make_llm(deep, max_model_len=512, sparse_attention=sparse), prompts, params, batch=True) == fused
    full = _generate(make_llm(deep, max_model_len=512), prompts, params, batch=True)
    assert full != fused                                             # (the budget is small enough to matter)


@pytest.mark.parametrize("kv", [{"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "int4"},
                                {"kv_cache_dtype": "fp8", "kv_cache_recent_tokens": 16}],
                         ids=["int8", "int4-salient", "fp8-recent"])
def test_windowed_quantized_caches_take_one_call_with_the_module_paths_bits(llama_dir, monkeypatch, kv):
    """A windowed quantized cache (int8; int4 with its salient tokens; fp8 keeping recent tokens): steps that seal no
    block run through the one-call layer (writes into the float32 window, reads through the quantized kernel), plain
    decoding and chain verification, and give the layer-by-layer path's greedy tokens and logprobs bit for bit
    (blocks seal along the way, on the module path). Fails if such steps never take the one-call layer, or write or
    read the cache differently."""
    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(n)] for i, n in enumerate((40, 23, 57))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    windowed = []
    _observe(monkeypatch, lambda idx, kind, rows, meta: meta.cpu_step.windowed and windowed.append(rows))
    plain = _generate(make_llm(llama_dir, **kv), prompts, params, batch=True)
    truth = {tuple(p): [list(r[0])] for p, r in zip(prompts, plain)}

    def spec():     # a fresh drafter each time (its drafts decide which blocks are open when a row reads them)
        return {"drafter": OracleDrafter(truth, wrong_every=3), "num_speculative_tokens": 3, "adaptive": False}
    drafted = _generate(make_llm(llama_dir, speculative_config=spec(), **kv), prompts, params)
    assert windowed and max(windowed) > 1, windowed                # decodes and verification rows
    _module_path(monkeypatch)                                        # the layer-by-layer path
    assert _generate(make_llm(llama_dir, **kv), prompts, params, batch=True) == plain
    assert _generate(make_llm(llama_dir, speculative_config=spec(), **kv), prompts, params) == drafted


@pytest.mark.parametrize("kv", [{"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8", "kv_cache_recent_tokens": 16}],
                         ids=["int8", "fp8-recent"])
def test_decode_steps_that_fill_a_block_seal_after_the_forward_on_the_one_call_layer(llama_dir, monkeypatch, kv):
    """On the CPU a decode or verification step that completes a window block seals it after its forward (the
    plan's ``kv_seals_after``), so the step itself runs through the one-call layer, every layer of it, and gives
    the layer-by-layer path's tokens and logprobs bit for bit (both read the block from the window in that step).
    Fails if such steps seal inside their layers (no deferred seal: they fall back to the module path)."""
    from leapdecode.engine import input_batch
    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(n)] for i, n in enumerate((40, 23, 57))]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    real_build = input_batch.InputBuffers.build
    sealing, one_call = {}, {}      # (the metadata kept alive, so no later step reuses its id)

    def build(self, plan, *a, **k):
        batch = real_build(self, plan, *a, **k)
        if plan.kv_seals_after:
            sealing[id(batch.meta)] = batch.meta
        return batch

    def seen(idx, kind, rows, meta):
        if id(meta) in sealing:
            one_call[id(meta)] = one_call.get(id(meta), 0) + 1
    monkeypatch.setattr(input_batch.InputBuffers, "build", build)
    _observe(monkeypatch, seen)
    plain = _generate(make_llm(llama_dir, **kv), prompts, params, batch=True)
    truth = {tuple(p): [list(r[0])] for p, r in zip(prompts, plain)}

    def spec():
        return {"drafter": OracleDrafter(truth, wrong_every=3), "num_speculative_tokens": 3, "adaptive": False}
    drafted = _generate(make_llm(llama_dir, speculative_config=spec(), **kv), prompts, params)
    llm = make_llm(llama_dir, **kv)
    layers = len(llm.engine.runner.model.layers)
    assert len(sealing) >= 4 and set(one_call) == set(sealing), (len(sealing), one_call)
    assert all(n == layers for n in one_call.values()), (layers, one_call)
    _module_path(monkeypatch)                                        # the layer-by-layer path
    assert _generate(llm, prompts, params, batch=True) == plain
    assert _generate(make_llm(llama_dir, speculative_config=spec(), **kv), prompts, params) == drafted
