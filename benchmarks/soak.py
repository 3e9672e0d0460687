"""Memory soak of the OpenAI server: mixed traffic for a while, the server's resident memory sampled throughout.

    python benchmarks/soak.py --minutes 10 --clients 12                       # plain, then with speculation
    python benchmarks/soak.py --minutes 3 --spec none --model PATH

Starts ``leapdecode serve`` as a subprocess (the embedded model unless ``--model``), then ``--clients`` threads
send a mix for ``--minutes``: completions and chat, streamed and not, a fifth of the streams closed after a few
events, n=2, logprobs, stop strings, seeds, and structured output with a never-seen JSON schema in one request
of ten (each compiles and enters the grammar cache, whose bound is ``--grammar-cache-size``). The server's RSS
(``/proc/PID/status``) is sampled every 5 s. The KV pool is small (``--kv-cache-memory``, 64 MiB): its pages
are allocated untouched and count in RSS only once a block is first used, and the prefix cache hands out the least
recently used free block, so a large pool keeps adding RSS for a long time (up to its size) without any leak. Reported: requests done and failed, RSS after the warm-up (the first
quarter), at the end, the slope over the last half (MB per 1,000 requests), and the bounded caches' sizes from
``/metrics`` at the end. Flat means the slope is near zero once the caches are full.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_request(http: httpx.Client, rng: random.Random, counter: list[int]) -> bool:
    kind = rng.random()
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "def", "return", "the", "value"])
                     for _ in range(rng.randint(3, 40)))
    body: dict = {"model": "m", "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0.0, 0.7, 1.0]),
                  "seed": rng.randint(0, 1000)}
    if kind < 0.1:                             # a new schema: compiled once, then kept by the LRU
        counter[0] += 1
        name = f"field_{counter[0]}_{rng.randint(0, 10**9)}"
        schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name],
                  "additionalProperties": False}
        body.update(messages=[{"role": "user", "content": words}],
                    response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        path = "/v1/chat/completions"
    elif kind < 0.5:
        body.update(messages=[{"role": "user", "content": words}])
        path = "/v1/chat/completions"
    else:
        body.update(prompt=words, logprobs=rng.choice([None, 2]), stop=rng.choice([None, ["the"]]),
                    n=rng.choice([1, 1, 2]))
        path = "/v1/completions"
    stream = rng.random() < 0.5
    body["stream"] = stream
    if not stream:
        return http.post(path, json=body).status_code == 200
    cut = rng.random() < 0.2
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return False
        for i, _ in enumerate(r.iter_lines()):
            if cut and i >= 3:
                break                          # the client goes away mid-stream
    return True


def soak(args: argparse.Namespace, spec: str | None) -> dict:
    port = args.port
    cmd = [sys.executable, "-m", "leapdecode.cli", "serve", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--served-model-name", "m", "--grammar-cache-size", str(args.grammar_cache_size),
           "--kv-cache-memory", args.kv_cache_memory, "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    if spec:
        cmd += ["--speculative-method", spec]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read()[-2000:])
            time.sleep(0.5)
        done, failed, schemas = [0], [0], [0]
        stop_at = time.time() + args.minutes * 60
        samples: list[tuple[float, int, float]] = []

        def client(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=url, timeout=300) as http:
                while time.time() < stop_at:
                    try:
                        ok = one_request(http, rng, schemas)
                    except httpx.HTTPError:
                        ok = False
                    done[0] += 1
                    failed[0] += not ok

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        while time.time() < stop_at:
            samples.append((time.time() - t0, done[0], rss_mb(proc.pid)))
            time.sleep(5)
        for t in threads:
            t.join()
        samples.append((time.time() - t0, done[0], rss_mb(proc.pid)))
        metrics = httpx.get(url + "/metrics", timeout=30).text
        caches = {m.group(1): float(m.group(2)) for m in
                  re.finditer(r'leapdecode_cache_entries\{cache="([^"]+)"\} ([0-9.e+]+)', metrics)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    warm = samples[len(samples) // 4]
    half = samples[len(samples) // 2]
    end = samples[-1]
    slope = (end[2] - half[2]) / max(1, end[1] - half[1]) * 1000
    return {"spec": spec or "none", "requests": done[0], "failed": failed[0], "schemas": schemas[0],
            "rss_start": samples[0][2], "rss_warm": warm[2], "rss_half": half[2], "rss_end": end[2],
            "slope_mb_per_1k": slope, "caches": caches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--spec", nargs="+", default=["none", "suffix"], help="speculative methods to soak, or none")
    ap.add_argument("--grammar-cache-size", type=int, default=256)
    ap.add_argument("--kv-cache-memory", default="64MiB",
                    help="the KV pool's size: its pages are allocated untouched and enter RSS as blocks are first "
                         "used, so a small pool is fully touched during the warm-up and its growth is not "
                         "mistaken for a leak (default: 64MiB)")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    if not args.model:
        import leapdecode
        args.model = os.path.join(os.path.dirname(leapdecode.__file__), "assets", "default_model")
    print(f"# soak: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {os.path.basename(args.model)}, "
          f"{args.minutes:g} min, {args.clients} clients, grammar cache {args.grammar_cache_size}, "
          f"KV pool {args.kv_cache_memory}")
    print("| speculation | requests | failed | new schemas | RSS start / after warm-up / half / end (MB) | "
          "slope over the 2nd half (MB per 1k requests) | caches at the end |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.spec:
        r = soak(args, None if spec == "none" else spec)
        print(f"| {r['spec']} | {r['requests']} | {r['failed']} | {r['schemas']} | {r['rss_start']:.0f} / "
              f"{r['rss_warm']:.0f} / {r['rss_half']:.0f} / {r['rss_end']:.0f} | {r['slope_mb_per_1k']:+.1f} | "
              f"{json.dumps({k: int(v) for k, v in r['caches'].items()})} |", flush=True)


if __name__ == "__main__":
    main()
