"""Our model over the paged cache gives transformers' logits, for every architecture, at prompt and decode
positions, whichever way the tokens are chunked."""
import pytest
import torch

from leapdecode.config import EngineConfig
from leapdecode.engine.engine import Engine
from leapdecode.engine.sequence import Sequence
from leapdecode.engine.step import ScheduledSeq, lay_out
from leapdecode.sampling_params import SamplingParams


def engine_logits(engine: Engine, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Feed ``tokens`` through the executor in the given chunk sizes (hand-made plans, every row's logits)."""
    seq = Sequence("parity", 0, tokens, SamplingParams())
    assert engine.block_manager.allocate(seq, len(tokens))
    out, start = [], 0
    for n in chunks:
        chunk = ScheduledSeq(seq.seq_id, start, tuple(tokens[start:start + n]), tuple(seq.block_table),
                             prompt_logprobs=True)
        out.append(engine.runner.execute(lay_out(0, engine.cfg.block_size, [chunk])).logits)
        start += n
    engine.block_manager.free_seq(seq)
    return torch.cat(out)


def hf_logits(path: str, tokens: list[int], dtype=torch.float32) -> torch.Tensor:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(tiny_dir, arch):
    path = tiny_dir(arch)
    engine = Engine(EngineConfig(model=path, dtype="float32", max_model_len=128, block_size=8))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 384, (40,), generator=g).tolist()
    ref = hf_logits(path, tokens)
    # prefill in uneven chunks that straddle block boundaries, then single-token decode steps
    ours = engine_logits(engine, tokens, [7, 9, 6] + [1] * 18)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bfloat16_close_to_transformers(tiny_dir):
    path = tiny_dir("llama")
    engine = Engine(EngineConfig(model=path, dtype="bfloat16", max_model_len=64))
    tokens = list(range(3, 30))
    ours = engine_logits(engine, tokens, [20] + [1] * 7)
    ref = hf_logits(path, tokens, torch.bfloat16)
    # both sides round differently in bf16 (we rotate and attend in float32), so compare row directions
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min().item() > 0.99


def test_sharded_checkpoint_loads_identically(tiny_dir, tmp_path):
    """model.safetensors.index.json with several shards gives the same logits as one file."""
    import transformers
    path = tiny_dir("qwen2")
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    tokens = list(range(5, 25))
    a = engine_logits(Engine(EngineConfig(model=path, dtype="float32", max_model_len=64)), tokens, [20])
    b = engine_logits(Engine(EngineConfig(model=str(sharded), dtype="float32", max_model_len=64)), tokens, [20])
    assert torch.equal(a, b)
