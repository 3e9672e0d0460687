"""`leapdecode serve | generate | bench` on the tiny test model, mostly in-process through ``main(argv)``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["bench"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: leapdecode" in out
    if command == ["serve"]:
        for flag in ("--model", "--host", "--port", "--api-key", "--speculative-method", "--num-speculative-tokens",
                     "--max-num-seqs", "--max-model-len", "--max-queued-requests"):
            assert flag in out


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "leapdecode.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and "serve" in r.stdout and "generate" in r.stdout and "bench" in r.stdout


def test_missing_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_generate_streams_the_greedy_completion(llama_dir, capsys):
    prompt = "def fibonacci(n):"
    ref = LLM(llama_dir, max_model_len=128, num_kv_blocks=64).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert main(["generate", "--model", llama_dir, "--max-model-len", "128", "--max-tokens", "12", prompt]) == 0
    captured = capsys.readouterr()
    assert captured.out == prompt + ref.text + "\n"
    assert f"[{len(ref.token_ids)} tokens" in captured.err and "tok/s" in captured.err

    assert main(["generate", "--model", llama_dir, "--max-model-len", "128", "--max-tokens", "4", "--chat",
                 "--quiet", "hello"]) == 0
    captured = capsys.readouterr()
    assert not captured.out.startswith("hello") and captured.err == ""


def test_generate_with_speculation_is_lossless_or_a_clear_error(llama_dir, capsys):
    args = ["generate", "--model", llama_dir, "--max-model-len", "128", "--max-tokens", "12", "--no-echo", "--quiet"]
    assert main(args + ["The dog"]) == 0
    plain = capsys.readouterr().out
    rc = main(args + ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "The dog"])
    captured = capsys.readouterr()
    if rc == 0:
        assert captured.out == plain
    else:       # speculation not integrated in this build: one readable line, no traceback
        assert rc == 2 and "speculative" in captured.err and "Traceback" not in captured.err


def test_bad_arguments_are_one_line_errors(llama_dir, capsys):
    rc = main(["bench", "--model", llama_dir, "--max-model-len", "32", "--input-len", "30", "--output-len", "8"])
    assert rc == 2 and "exceeds max_model_len" in capsys.readouterr().err
    rc = main(["generate", "--model", llama_dir, "--temperature", "-1", "x"])
    assert rc == 2 and "temperature" in capsys.readouterr().err
    rc = main(["generate", "--model", os.path.join(ROOT, "no-such-model"), "x"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("leapdecode generate: error:") and "Traceback" not in err


def test_bench_prints_a_table_and_json(llama_dir, capsys):
    rc = main(["bench", "--model", llama_dir, "--max-model-len", "64", "--num-requests", "6", "--input-len", "8",
               "--output-len", "5", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "output tokens/s" in out and "TTFT p99 (ms)" in out and "TPOT p50 (ms)" in out
    results = json.loads(out.strip().splitlines()[-1])
    assert results["num_requests"] == 6
    assert results["requests_per_s"] > 0 and results["output_tokens_per_s"] > 0
    assert results["ttft_ms_p50"] <= results["ttft_ms_p99"]


def test_serve_parser_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.max_queued_requests) == ("127.0.0.1", 8000, None, 512)
    assert args.model is None and args.speculative_method is None
