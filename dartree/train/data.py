"""Training data: prompts from ../shared/prompts, responses written by the target itself.

Responses are generated in batches (left-padded, one preallocated KV cache). Each batch becomes one
shard (safetensors) of token ids only, a few hundred KB per thousand sequences, so shards are small
enough to commit and accumulate across sessions:

- ``tokens`` int32 [sum L]: prompt + response of every sequence, concatenated;
- ``offsets`` int64 [n+1], ``prompt_lens`` int32 [n].

The target's tapped states and its next-token distribution are recomputed from the ids at training
time (one teacher-forced forward per sequence, ``tapped_target_states``), so a shard does not depend on the
tapped layers or on the drafter's vocabulary. Shard k always holds the same prompts (one fixed
shuffle), shards are written atomically and skipped when present: asking for more prompts later
extends the data set, and an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import DartreeError
from ..attention import kv_cache_dtype
from ..taps import LayerTap
from ..pipeline import Pipeline
from ..prompts import chat_token_ids, code_prompt, instruction_prompt, math_prompt
from ..settings import GenerationSettings
from ..targets.hf import all_growing, growing_cache

MBPP_TRAIN_IDS = set(range(511, 975)) | set(range(1, 11))  # 11..510 is MBPP's test split


# The original set's files, the category each is trained as, and whether its licence lets a shipped
# drafter be trained on it (Alpaca's instructions are CC BY-NC: its sequences are never trained on).
ORIGINAL_FILES = {"gsm8k_train": "math", "alpaca_train_2000": "instruction", "dolly_train_2000": "instruction",
                  "mbpp_full": "coding"}
NON_COMMERCIAL_SOURCES = ("alpaca_train_2000",)


def original_prompts(prompts_dir: str | Path, seed: int = 0) -> list[TrainingPrompt]:
    """The original set (GSM8K, Alpaca, Dolly, MBPP train ids) in its one fixed shuffle, each prompt
    with the file it came from: the shuffle permutes by position only, so labelling the prompts does
    not move any of them (shard k of the original data still holds the same prompts)."""
    d = Path(prompts_dir)
    if not d.is_dir():
        raise DartreeError(f"prompts directory {str(d)!r} does not exist (expected ../shared/prompts)")
    out: list[TrainingPrompt] = []
    label = lambda text, stem: TrainingPrompt(text, stem, ORIGINAL_FILES[stem])  # noqa: E731
    with open(d / "gsm8k_train.jsonl") as f:
        out += [label(math_prompt(json.loads(line)["question"]), "gsm8k_train") for line in f if line.strip()]
    for name in ("alpaca_train_2000", "dolly_train_2000"):
        out += [label(instruction_prompt(r["instruction"], r.get("input", "")), name)
                for r in json.loads((d / f"{name}.json").read_text())]
    with open(d / "mbpp_full.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row["task_id"] in MBPP_TRAIN_IDS:
                out.append(label(row["text"], "mbpp_full"))
                tests = "\n".join(row["test_list"])
                out.append(label(code_prompt(f'"""\n{row["text"]}\n{tests}\n"""\n'), "mbpp_full"))
    random.Random(seed).shuffle(out)
    return out


# How many prompts of each file of the expanded set are held out (never trained on, evaluated by category).
HELD_OUT_PER_FILE = 40
PROMPT_SETS = ("original", "expanded")


@dataclass(frozen=True)
class TrainingPrompt:
    text: str
    source: str    # the file it came from (its stem)
    category: str  # the label SOURCES.md gives


def expanded_prompt_files(prompts_dir: str | Path) -> list[Path]:
    """The expanded set's files: every JSONL in the folder whose rows carry ``source``, ``category``
    and ``prompt`` (the older gsm8k/mbpp files do not, and the CC BY-NC Alpaca file is JSON)."""
    d = Path(prompts_dir)
    if not d.is_dir():
        raise DartreeError(f"prompts directory {str(d)!r} does not exist (expected ../shared/prompts)")
    files = []
    for f in sorted(d.glob("*.jsonl")):
        with open(f) as fh:
            first = json.loads(fh.readline() or "{}")
        if {"source", "category", "prompt"} <= first.keys():
            files.append(f)
    if not files:
        raise DartreeError(f"no expanded prompt files (JSONL rows with source/category/prompt) in {str(d)!r}")
    return files


def expanded_prompts(prompts_dir: str | Path, seed: int = 0, split: str = "train") -> list[TrainingPrompt]:
    """The expanded prompt set, ``split`` "train" (shuffled deterministically) or "held_out" (the
    first ``HELD_OUT_PER_FILE`` of each file's own fixed shuffle, in file order). Math problems get
    the evaluation's math suffix, as the math benchmarks are asked that way."""
    if split not in ("train", "held_out"):
        raise DartreeError(f"split must be 'train' or 'held_out', got {split!r}")
    out: list[TrainingPrompt] = []
    for f in expanded_prompt_files(prompts_dir):
        rows = [json.loads(line) for line in open(f) if line.strip()]
        random.Random(f"{f.stem}:{seed}").shuffle(rows)
        rows = rows[:HELD_OUT_PER_FILE] if split == "held_out" else rows[HELD_OUT_PER_FILE:]
        for r in rows:
            text = math_prompt(r["prompt"]) if r["category"] == "math" else r["prompt"]
            out.append(TrainingPrompt(text, f.stem, r["category"]))
    if split == "train":
        random.Random(seed).shuffle(out)
    return out


def prompt_set(name: str, prompts_dir: str | Path, seed: int = 0) -> list[TrainingPrompt]:
    """The training prompts of set ``name`` (one of ``PROMPT_SETS``)."""
    if name == "original":
        return original_prompts(prompts_dir, seed)
    if name == "expanded":
        return expanded_prompts(prompts_dir, seed, "train")
    raise DartreeError(f"unknown prompt set {name!r}; expected one of {', '.join(PROMPT_SETS)}")


def reference_token_counts(prompts_dir: str | Path, tokenizer, vocab_size: int) -> torch.Tensor:
    """[vocab_size] token counts of the human-written training text (questions, instructions and
    reference answers of ../shared/prompts, MBPP train ids only): a prior that ranks the tokens the
    target-written responses have not (yet) used when the draft vocabulary is chosen."""
    d = Path(prompts_dir)
    if not d.is_dir():
        raise DartreeError(f"prompts directory {str(d)!r} does not exist (expected ../shared/prompts)")
    texts: list[str] = []
    with open(d / "gsm8k_train.jsonl") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                texts += [row["question"], row["answer"]]
    for name in ("alpaca_train_2000.json", "dolly_train_2000.json"):
        for r in json.loads((d / name).read_text()):
            texts += [r["instruction"], r.get("input", ""), r.get("output", "")]
    with open(d / "mbpp_full.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row["task_id"] in MBPP_TRAIN_IDS:
                texts += [row["text"], row["code"]]
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in tokenizer([t for t in texts if t], add_special_tokens=False)["input_ids"]:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] prompt + response
    prompt_len: int
    source: str = ""      # where the prompt came from ("" in shards written before sources were kept)


@torch.no_grad()
def tapped_target_states(model, tapped: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced forward of one sequence [L]: tapped states [L, m*H] and final normed states [L, H].

    Row i belongs to position i; the drafter context at an anchor a is rows < a, and the target's
    next-token distribution after position i is lm_head(final[i]).
    """
    tap = LayerTap(model, tapped, final=True)
    try:
        model.model(input_ids=tokens[None].to(next(model.parameters()).device), use_cache=False)
        feats, final = tap.pop()
    finally:
        tap.close()
    return feats[0], final[0]


@torch.no_grad()
def prefill_left_padded(model, prompts: list[list[int]], pad_id: int, group: int = 8):
    """Prefill ``prompts`` as one left-padded batch: the last-position logits [n, V], the cache
    (a ``target.growing_cache`` in the attention's dtype) and the attention mask [n, width].

    Prompts of one batch differ in length (36 to 282 tokens, mean 106, in a measured GSM8K/Alpaca
    batch), and a left-padded forward computes the padding too, so rows are prefilled ``group`` at a
    time in length order, each group padded only to its own longest prompt, and their K/V are
    stacked right-aligned into one cache (padding slots are masked, so what they hold is unused)."""
    device, store = next(model.parameters()).device, kv_cache_dtype(model)
    n, width = len(prompts), max(len(p) for p in prompts)
    attn = torch.zeros((n, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        attn[i, width - len(p):] = 1
    cache = growing_cache(model.config, store)
    if not all_growing(cache):
        group = n  # a sliding-window or other layer type: one forward over the whole batch
    # one group is prefilled straight into ``cache``, whose rows must then be in prompt order
    order = sorted(range(n), key=lambda i: len(prompts[i])) if group < n else list(range(n))
    logits, keys, values = None, [None] * len(cache.layers), [None] * len(cache.layers)
    for start in range(0, n, group):
        rows = order[start:start + group]
        w = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), w), pad_id, dtype=torch.long, device=device)
        for r, i in enumerate(rows):
            ids[r, w - len(prompts[i]):] = torch.tensor(prompts[i], device=device)
        part_attn = attn[rows, width - w:]
        part = cache if group >= n else growing_cache(model.config, store)
        out = model(input_ids=ids, attention_mask=part_attn, position_ids=(part_attn.cumsum(-1) - 1).clamp(min=0),
                    cache=part, use_cache=True, logits_to_keep=1).logits[:, -1]
        if logits is None:
            logits = out.new_empty((n, out.shape[-1]))
        logits[rows] = out
        if part is cache:
            return logits, cache, attn
        index = torch.tensor(rows, device=device)
        for li, layer in enumerate(part.layers):
            if keys[li] is None:
                keys[li] = layer.keys.new_zeros((n, *layer.keys.shape[1:-2], width, layer.keys.shape[-1]))
                values[li] = layer.values.new_zeros((n, *layer.values.shape[1:-2], width, layer.values.shape[-1]))
            keys[li][index, ..., width - w:, :] = layer.keys
            values[li][index, ..., width - w:, :] = layer.values
    for layer, k, v in zip(cache.layers, keys, values):
        layer.update(k, v)
    return logits, cache, attn


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   stop_ids: set[int], pad_id: int, generator: torch.Generator) -> list[Sequence]:
    """Responses to ``prompts`` (one left-padded batch), greedy or sampled at ``temperature``.

    The prompts are prefilled in length groups (``prefill_left_padded``); the K/V cache holds only
    the filled positions, in the attention's dtype (no per-step cast of a bf16 cache on the CPU);
    rows whose response has ended leave the batch. Measured against a full-length static cache (64
    prompts, 256 new tokens, SmolLM2-135M bf16, one thread on an AVX512_BF16 EPYC beside a training
    job): 239.6 s -> 87.0 s for the batch, 52 -> 148 tokens/s."""
    device = next(model.parameters()).device
    logits, cache, attn = prefill_left_padded(model, prompts, pad_id)
    n = len(prompts)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    responses = [[] for _ in range(n)]
    live = list(range(n))  # the prompt index of each batch row (-1: its response has ended)
    can_drop = all_growing(cache)
    for step in range(max_new_tokens):
        if temperature > 0:  # sampled on the CPU with a CPU generator: the same data on any device
            probs = (logits.float() / temperature).softmax(-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(device)
        else:
            nxt = logits.argmax(-1)
        picked = nxt.tolist()
        for row, i in enumerate(live):
            if i >= 0:
                responses[i].append(picked[row])
                if picked[row] in stop_ids:
                    live[row] = -1
        going = [row for row, i in enumerate(live) if i >= 0]
        if not going or step == max_new_tokens - 1:
            break
        # Dropping rows copies the whole cache, so ended rows ride along until an eighth have ended.
        if can_drop and len(live) - len(going) >= max(1, len(live) // 8):
            rows = torch.tensor(going, device=device)
            for layer in cache.layers:
                layer.select_rows(rows)
            live = [live[row] for row in going]
            nxt, attn, pos = nxt[rows], attn[rows], pos[rows]
        attn = torch.cat([attn, torch.ones(len(live), 1, dtype=torch.long, device=device)], dim=1)
        pos = pos[:, -1:] + 1
        logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
    return [Sequence(torch.tensor(p + r, dtype=torch.int32), len(p)) for p, r in zip(prompts, responses)]


def save_shard(path: Path, seqs: list[Sequence], meta: dict) -> None:
    from safetensors.torch import save_file

    lengths = torch.tensor([s.tokens.numel() for s in seqs])
    tensors = {
        "tokens": torch.cat([s.tokens for s in seqs]).to(torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),
    }
    names = sorted({s.source for s in seqs})
    if names != [""]:  # the source of each sequence: an index into the metadata's list of names
        tensors["source_ids"] = torch.tensor([names.index(s.source) for s in seqs], dtype=torch.int16)
        meta = {**meta, "sources": json.dumps(names)}
    tmp = path.with_suffix(f".{os.getpid()}.partial")  # two processes on one shard never share a temporary file
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    tmp.rename(path)


def load_shard(path: Path) -> list[Sequence]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:  # tensors and metadata in one read
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata() or {}
    offsets = t["offsets"].tolist()
    sources = [""] * (len(offsets) - 1)
    if "source_ids" in t:
        names = json.loads(meta["sources"])
        sources = [names[i] for i in t["source_ids"].tolist()]
    return [Sequence(t["tokens"][a:b].long(), int(n), src)
            for a, b, n, src in zip(offsets, offsets[1:], t["prompt_lens"].tolist(), sources)]


def sequence_category(seq: Sequence) -> str:
    """A sequence's category (the part of its source after the file name); "unlabelled" when its
    shard kept no sources and ``label_original_sources`` could not place it."""
    return seq.source.rpartition("/")[2] if seq.source else "unlabelled"


def label_original_sources(seqs: list[Sequence], prompts_dir: str | Path, tokenizer) -> int:
    """Give the sequences of shards written before sources were kept (the original set's) the file
    and category of their prompt, found by the prompt's text in the chat template; returns how many
    were labelled. Matching is by the last 100 characters of the user's turn (prompts were kept to
    their last 512 tokens), which tells every prompt of the original set apart."""
    unlabelled = [s for s in seqs if not s.source]
    if not unlabelled:
        return 0
    try:
        prompts = original_prompts(prompts_dir)
    except (DartreeError, OSError):  # a prompts folder without the original files: nothing to label by
        return 0
    by_tail: dict[str, set[str]] = {}
    for p in prompts:
        by_tail.setdefault(p.text.strip()[-100:], set()).add(f"{p.source}/{p.category}")
    texts = tokenizer.batch_decode([s.tokens[:s.prompt_len] for s in unlabelled])
    done = 0
    for seq, text in zip(unlabelled, texts):
        user = text.rsplit("<|im_end|>", 1)[0].split("<|im_start|>user\n", 1)[-1].strip()
        found = by_tail.get(user[-100:], set())
        if len(found) == 1:
            seq.source = next(iter(found))
            done += 1
    return done


def shard_path(data_dir: str | Path, k: int) -> Path:
    """Where shard ``k`` lives (``shard_files`` lists the ones present)."""
    return Path(data_dir) / f"shard-{k:05d}.safetensors"


def claim_shard(data_dir: str | Path, k: int) -> bool:
    """Claim shard ``k`` for this process, so a second data process skips it while it is being written.

    The claim is a ``.claim`` file holding "host pid", linked into place in one step (so it never
    exists half written); one left by a process that is gone from this host is taken over (a killed
    job resumes), one held by a live process or by another host is respected (delete it by hand if
    that host's job is dead). ``release_shard`` removes it once the shard is saved. Returns False when
    another process holds the shard."""
    path = shard_path(data_dir, k).with_suffix(".claim")
    mine = path.with_suffix(f".{os.getpid()}.claiming")
    mine.write_text(f"{socket.gethostname()} {os.getpid()}")
    try:
        for _ in range(2):
            try:
                os.link(mine, path)
                return True
            except FileExistsError:
                if claim_is_live(path):
                    return False
                path.unlink(missing_ok=True)  # its process is gone: take it over
        return False
    finally:
        mine.unlink(missing_ok=True)


def claim_is_live(path: Path) -> bool:
    try:
        host, pid = path.read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return False  # gone meanwhile, or not a claim this code wrote
    if host != socket.gethostname():
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def release_shard(data_dir: str | Path, k: int) -> None:
    shard_path(data_dir, k).with_suffix(".claim").unlink(missing_ok=True)


def shard_files(data_dir: str | Path) -> list[Path]:
    """The complete shards in ``data_dir``, in shard order (a shard being written is not listed)."""
    files = sorted(Path(data_dir).glob("shard-*.safetensors"))
    if not files:
        raise DartreeError(f"no shards in {data_dir}; run `dartree train data --out {data_dir}` first")
    return files


def load_shards(files: list[Path], min_response: int = 2) -> list[Sequence]:
    """Every sequence of ``files`` (in order) with at least ``min_response`` new tokens."""
    return [s for f in files for s in load_shard(f) if s.tokens.numel() - s.prompt_len >= min_response]


@dataclass
class ShardJob:
    """The prompts of one shard and how to answer them."""

    k: int
    prompts: list[TrainingPrompt]
    encoded: list[list[int]]
    temperature: float
    seed: int
    queued_at: float = field(default_factory=time.perf_counter)  # on the engine, shards overlap: its span starts here


def batch_responses(model, jobs: Iterable[ShardJob], max_new_tokens: int, stop_ids: set[int], pad_id: int):
    """Each job answered as one left-padded batch of the Hugging Face ``model`` (``generate_batch``;
    sampled with one generator per shard): yields (job, sequences in prompt order)."""
    for job in jobs:
        order = sorted(range(len(job.encoded)), key=lambda i: len(job.encoded[i]))
        gen = torch.Generator().manual_seed(job.seed)
        seqs = generate_batch(model, [job.encoded[i] for i in order], max_new_tokens, job.temperature, stop_ids, pad_id, gen)
        by_prompt = [None] * len(order)
        for s, i in zip(seqs, order):
            by_prompt[i] = s
        yield job, by_prompt


def engine_responses(pipe: Pipeline, jobs: Iterable[ShardJob], max_new_tokens: int, stop_ids: set[int], slots: int):
    """Every job's prompts as ``ar`` requests of the batched engine (``pipe``'s lean forward, up to
    ``slots`` requests per round, each sampled from its own seed): the next job's requests queue
    while the current one's last answers finish, so the batch stays full across shards. Yields
    (job, sequences in prompt order) as each job's last request ends. With exact products the text of
    every answer is the one the target writes for that prompt alone (the engine's rows do not depend
    on each other); with bf16 products (``lean.PRODUCTS``) it is the bf16-product target's, and a
    near-tie may fall either way depending on what shares the round."""
    engine = pipe.engine(slots)
    jobs = iter(jobs)
    in_flight: dict[int, tuple[ShardJob, list]] = {}
    more = True
    while True:
        while more and len(engine.waiting) < engine.max_batch:  # keep a full batch of work waiting
            job = next(jobs, None)
            if job is None:
                more = False
                break
            requests = []
            for i, ids in enumerate(job.encoded):
                settings = GenerationSettings(method="ar", max_new_tokens=max_new_tokens, temperature=job.temperature,
                                              seed=job.seed * 4096 + i).validate()
                prompt = torch.tensor(ids)
                pipe.check_request(prompt, settings)
                requests.append(pipe.request(prompt, settings, stop_token_ids=sorted(stop_ids), alone=False))
                engine.submit(requests[-1])
            in_flight[job.k] = (job, requests)
        if not engine.busy:
            return
        engine.step()
        for k in [k for k, (_, rs) in in_flight.items() if all(r.finished for r in rs)]:
            job, requests = in_flight.pop(k)
            for r in requests:
                if r.error is not None:
                    raise r.error
            yield job, [Sequence(torch.tensor(ids + r.output, dtype=torch.int32), len(ids))
                        for ids, r in zip(job.encoded, requests)]


def generate_data(target, tokenizer, prompts_dir, out_dir, num_prompts: int | None = None, batch_size: int = 48,
                  max_new_tokens: int = 256, sample_fraction: float = 0.25, seed: int = 0, max_minutes: float | None = None,
                  start_shard: int = 0, prompt_set_name: str = "original", slots: int = 64) -> None:
    """Write shards of target-written responses until ``num_prompts`` (default: all) are covered (resumable).

    ``target``: a ``Pipeline`` on the lean forward (answers from the batched engine, ``slots``
    requests per round, with the pipeline's ``lean_products``) or a Hugging Face model (one left-padded batch per shard, e.g. on a GPU).
    Missing shards are written in order from ``start_shard`` (wrapping around); a shard another
    process wrote meanwhile, or is writing now (``claim_shard``), is skipped, so processes started at
    different shards share the work without writing any shard twice, even once one catches up with another."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = prompt_set(prompt_set_name, prompts_dir, seed)
    if num_prompts is not None:
        prompts = prompts[:num_prompts]
    shards = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    stop = {tokenizer.eos_token_id}
    on_engine = isinstance(target, Pipeline)
    dtype = str((target.target.dtype if on_engine else next(target.parameters()).dtype)).removeprefix("torch.")
    generator = "batch"
    if on_engine:  # the lean forward's products say how the answers were computed ("bfloat16": bf16 weight products)
        generator = "engine" if target.target.weights.products == "exact" else f"engine, {target.target.weights.products} products"
    t0 = time.perf_counter()
    if not 0 <= start_shard < len(shards):
        raise DartreeError(f"--start-shard must be between 0 and {len(shards) - 1} (this prompt set makes {len(shards)} shards), got {start_shard}")
    order = list(range(start_shard, len(shards))) + list(range(start_shard))
    todo = [k for k in order if not shard_path(out_dir, k).exists()]
    bar = tqdm(total=len(todo), desc=f"generating responses ({len(shards) - len(todo)} of {len(shards)} shards present)", unit="shard")
    def jobs():
        for k in todo:
            if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes:
                bar.write(f"stopping after {max_minutes} minutes (shards under way are finished first); run again to resume at shard {k}")
                return
            if shard_path(out_dir, k).exists() or not claim_shard(out_dir, k):  # written or under way elsewhere
                bar.update()
                continue
            if shard_path(out_dir, k).exists():  # finished by the other process between the two checks
                release_shard(out_dir, k)
                bar.update()
                continue
            temperature = 1.0 if random.Random(seed * 100_003 + k).random() < sample_fraction else 0.0
            # encoded shard by shard: the expanded set's 70k chat templates would take minutes up front
            encoded = [chat_token_ids(tokenizer, [{"role": "user", "content": p.text}])[-512:] for p in shards[k]]  # keep prompts short enough for a CPU
            yield ShardJob(k, shards[k], encoded, temperature, seed * 1_000_003 + k)

    if on_engine:
        answered = engine_responses(target, jobs(), max_new_tokens, stop, slots)
    else:
        answered = batch_responses(target, jobs(), max_new_tokens, stop, tokenizer.eos_token_id)
    new_total = 0
    for job, seqs in answered:
        for s, p in zip(seqs, job.prompts):
            s.source = f"{p.source}/{p.category}"
        new = sum(s.tokens.numel() - s.prompt_len for s in seqs)
        new_total += new
        seconds = time.perf_counter() - job.queued_at
        save_shard(shard_path(out_dir, job.k), seqs,
                   {"temperature": job.temperature, "shard": job.k, "dtype": dtype, "max_new_tokens": max_new_tokens,
                    "generator": generator, "seconds": round(seconds, 1), "new_tokens": new})
        release_shard(out_dir, job.k)
        bar.update()
        bar.set_postfix(T=job.temperature, mean_tok_s=f"{new_total / (time.perf_counter() - t0):.0f}")
    bar.close()
