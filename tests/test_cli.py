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


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["chat"], ["bench"]])
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


def test_generate_with_speculation_is_lossless(llama_dir, capsys):
    args = ["generate", "--model", llama_dir, "--max-model-len", "128", "--max-tokens", "12", "--no-echo", "--quiet"]
    assert main(args + ["The dog"]) == 0
    plain = capsys.readouterr().out
    for method in ("ngram", "suffix"):
        rc = main(args + ["--speculative-method", method, "--num-speculative-tokens", "3", "The dog"])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        assert captured.out == plain, method


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


@pytest.mark.parametrize("flag,expected", [([], "exit"), (["--on-engine-failure", "stay"], None)])
def test_serve_exits_on_engine_failure_by_default(llama_dir, monkeypatch, flag, expected):
    """A dead engine (a device fault) stops `leapdecode serve` for its supervisor, unless told to stay up."""
    import types

    import uvicorn

    import leapdecode.server as server
    seen = {}
    real = server.build_app

    def spy(llm, **kw):
        seen.update(kw)
        return real(llm, **kw)
    monkeypatch.setattr(server, "build_app", spy)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.setdefault("ran", types.SimpleNamespace(**kw)))
    args = build_parser().parse_args(["serve", "--model", llama_dir, "--max-model-len", "128", *flag])
    assert args.func(args) == 0
    assert seen["on_engine_failure"] == expected and seen["ran"].port == 8000


def test_chat_keeps_the_conversation_resets_and_exits(llama_dir, capsys, monkeypatch):
    """Non-interactive chat: each stdin line is a user turn; answers equal LLM.chat on the same history."""
    import io
    llm = LLM(llama_dir, max_model_len=256, num_kv_blocks=64)
    p = SamplingParams(max_tokens=6, temperature=0.0)

    def answer(messages):
        return llm.chat(messages, p, use_tqdm=False)[0].outputs[0].text

    first = answer([{"role": "user", "content": "hello"}])
    second = answer([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "again"}])
    fresh = answer([{"role": "user", "content": "again"}])
    expected = f"> hello\n{first}\n> again\n{second}\n> again\n{fresh}\n"
    script = "hello\n\nagain\n/reset\nagain\n/exit\nnever read\n"
    for extra, per_step in (([], False), (["--speculative-method", "suffix"], True)):
        monkeypatch.setattr(sys, "stdin", io.StringIO(script))
        rc = main(["chat", "--model", llama_dir, "--max-model-len", "256", "--max-tokens", "6", *extra])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        assert captured.out == expected
        assert captured.err.count("tok/s") == 3 and "(new conversation)" in captured.err
        assert ("tokens/step" in captured.err) == per_step


def test_chat_drops_old_turns_that_no_longer_fit(llama_dir, capsys, monkeypatch):
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"turn {i} " + "words " * 8 + "\n" for i in range(6))))
    rc = main(["chat", "--model", llama_dir, "--max-model-len", "64", "--max-tokens", "8", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.count("> turn") == 6 and captured.err == ""
