"""Run methods x temperatures x tree settings on the same prompts in one process.

Every (sample, configuration) becomes one JSONL record; a run skips records already written, so it
resumes where it stopped. At temperature 0 each method's tokens are compared with ``ar``'s and any
mismatch is reported loudly (and stored in the record).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
import itertools
from dataclasses import asdict, field, make_dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..budget import BudgetPolicy
from ..costmodel import CostModel
from ..errors import require
from ..settings import GenerationSettings
from ..targets.lean import from_gguf
from ..trees import BUILDERS, TreeSettings, make_builder
from . import llama_cpp
from .datasets import Sample
from .records import GreedyAnswers, append_line, read_records
from ..replay import replay

HF_PEERS = ("hf-generate", "hf-prompt-lookup")
PEERS = (*HF_PEERS, *llama_cpp.LLAMA_PEERS)  # other engines decoding the same target, timed beside ours
EXACT_DTYPES = ("float32", "float64")  # where speculation reproduces ar token for token (tested); 16-bit ones are measured


class _RunConfigMethods:
    """What a bench configuration does (``RunConfig`` below gets its fields from the declarations)."""

    @property
    def key(self) -> str:
        """A readable name of the configuration, e.g. ``dartree|T=0|B=16|W=12|K=64|beta=-0.2``: the
        method, the temperature, each tree setting it sets by its short name (``TreeSettings``'
        declarations) and ``|bfloat16`` for a dtype other than float32 (so float32 records keep their keys)."""
        parts = [self.method, f"T={self.temperature:g}"]
        for setting in TreeSettings.declarations():
            value = getattr(self, setting.name)
            if isinstance(value, bool):  # a switch: named when on (records made before it existed ran with it off)
                parts.extend([f"{setting.metadata['key']}=on"] if value else [])
            elif value is not None:
                parts.append(f"{setting.metadata['key']}={value:g}" if isinstance(value, float) else f"{setting.metadata['key']}={value}")
        if self.dtype != "float32":
            parts.append(self.dtype)
        return "|".join(parts)

    @property
    def label(self) -> str:
        """The configuration without its temperature, spaced (a '|' would split a markdown cell)."""
        return " ".join(p for p in self.key.split("|") if not p.startswith("T="))

    @classmethod
    def from_record(cls, record: dict) -> "RunConfig":
        """The typed configuration of a bench record (records carry every field beside their key;
        records written before runs crossed dtypes have no ``dtype``: float32; records written before a
        tree setting was renamed carry it under its old name, e.g. ``top_k`` for ``tree_top_k``)."""
        renamed = {new: record[old] for old, new in TreeSettings.retired.items() if old in record and new not in record}
        # records written before a switch existed ran with it off, whatever its default is now
        reads = getattr(BUILDERS.get(record["method"]), "reads", ())
        switched_off = {s.name: False for s in TreeSettings.declarations()
                        if isinstance(s.default, bool) and s.name in reads and s.name not in record}
        record = {**record, **renamed, **switched_off}
        return cls(**{name: record[name] for name in cls.__dataclass_fields__ if name in record})

    def settings(self, max_new_tokens: int, seed: int | None = 0) -> GenerationSettings:
        return GenerationSettings(method=self.method, max_new_tokens=max_new_tokens, temperature=self.temperature,
                                  seed=seed, tree=self.tree_settings())

    def tree_settings(self) -> TreeSettings:
        """The full TreeSettings of this configuration (defaults where the method reads nothing)."""
        return TreeSettings(**{s.name: getattr(self, s.name) for s in TreeSettings.declarations() if getattr(self, s.name) is not None})


# One bench configuration: the method, the temperature, every tree setting ``TreeSettings`` declares
# (None where the method does not read it) and the dtype (one run may cross several: ``--dtype
# float32,bfloat16``). Its fields, its key and its records all follow the declarations.
RunConfig = make_dataclass(
    "RunConfig",
    [("method", str), ("temperature", float, field(default=0.0)),
     *[(s.name, "int | float | str | None", field(default=None)) for s in TreeSettings.declarations()],
     ("dtype", str, field(default="float32"))],
    bases=(_RunConfigMethods,), frozen=True, namespace={"__module__": __name__})


def build_grid(methods, temperatures, budgets=(TreeSettings.budget,), dtypes=("float32",), **values) -> list[RunConfig]:
    """ar first (the reference), then every method; the tree settings of each configuration are
    exactly those its method reads (``TreeBuilder.settings_read``), crossed over the values given
    (``budgets``, and any other setting by its name, e.g. ``width=[4, 12]``; the default otherwise);
    the whole grid once per dtype (each dtype has its own ar)."""
    names = [s.name for s in TreeSettings.declarations()]
    unknown = set(values) - set(names)
    require(not unknown, f"unknown tree setting(s) {sorted(unknown)}; known: {', '.join(names)}")
    choices = {s.name: list(values.get(s.name, (s.default,))) for s in TreeSettings.declarations()}
    choices["budget"] = list(budgets)
    grid = []
    for t, dtype in ((t, d) for d in dtypes for t in temperatures):
        ordered = ["ar"] + [m for m in methods if m != "ar"]
        for m in ordered:
            if m in PEERS:
                if t == 0:
                    grid.append(RunConfig(m, t, dtype=dtype))
                continue
            builder = BUILDERS[m]
            for budget in choices["budget"] if "budget" in builder.reads else (None,):
                crossed = [n for n in builder.settings_read(budget) if n != "budget"]
                for combo in itertools.product(*(choices[n] for n in crossed)):
                    grid.append(RunConfig(m, t, dtype=dtype, budget=budget, **dict(zip(crossed, combo))))
    return list(dict.fromkeys(grid))


def _sha1(tokens: list[int]) -> str:
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()


def _run_ours(pipe, sample: Sample, cfg: RunConfig, max_new_tokens: int, seed: int) -> list[dict]:
    messages, turns = [], []
    for turn in sample.turns:
        messages.append({"role": "user", "content": turn})
        res = pipe.generate(messages=list(messages), settings=cfg.settings(max_new_tokens, seed))
        s = res.stats
        turns.append({"token_ids": res.token_ids, "new_tokens": s.new_tokens, "rounds": s.rounds,
                      "acceptance_lengths": s.acceptance_lengths, "decode_seconds": s.decode_seconds,
                      "stage_ms": s.stage_ms, "tree_sizes_mean": s.to_dict()["mean_tree_size"]})
        messages.append({"role": "assistant", "content": res.text})
    return turns


_PLAIN_MODELS: dict[tuple[str, str, str], torch.nn.Module] = {}


def plain_hf_model(pipe) -> torch.nn.Module:
    """The pipeline's target as a user would load it without dartree: ``from_pretrained`` with
    Hugging Face's own attention and products (dartree's loading changes both on a CPU), once per
    target, dtype and device. The Hugging Face peers run on it."""
    model = pipe.target_model
    if from_gguf(model):  # a target on a GGUF file as stored: the peers load the file's float32 checkpoint
        from ..default_model import gguf_checkpoint_dir

        key = (str(gguf_checkpoint_dir(model.dartree_gguf_file)), str(model.dtype), "cpu")
    else:
        key = (str(model.config._name_or_path), str(model.dtype), str(model.device))
    if key not in _PLAIN_MODELS:
        from transformers import AutoModelForCausalLM

        _PLAIN_MODELS[key] = AutoModelForCausalLM.from_pretrained(key[0], dtype=model.dtype).to(key[2]).eval()
    return _PLAIN_MODELS[key]


def _peer_turns(pipe, sample: Sample, decode) -> list[dict]:
    """A peer over every turn of ``sample``: ``decode(prompt ids [P])`` gives one turn's record (with
    its ``token_ids``), whose text is the next turn's assistant message."""
    messages, turns = [], []
    for turn in sample.turns:
        messages.append({"role": "user", "content": turn})
        record = decode(pipe.encode(messages=list(messages)))
        turns.append(record)
        messages.append({"role": "assistant", "content": pipe.tokenizer.decode(record["token_ids"], skip_special_tokens=True)})
    return turns


@torch.no_grad()
def run_hf_peer(pipe, sample: Sample, cfg: RunConfig, max_new_tokens: int) -> list[dict]:
    """Hugging Face generate (greedy) or prompt-lookup decoding on the target as Hugging Face loads
    it (``plain_hf_model``), timed the same way (prefill excluded)."""
    model, stop = plain_hf_model(pipe), sorted(pipe.default_stop_ids())

    def decode(prompt: torch.Tensor) -> dict:
        ids = prompt[None]
        attn = torch.ones_like(ids)
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=attn, logits_to_keep=1)  # prefill alone, to subtract
        prefill = time.perf_counter() - t0
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0)
        if cfg.method == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=attn, **kwargs)
        total = time.perf_counter() - t0
        tokens = out[0, ids.shape[1]:].tolist()
        return {"token_ids": tokens, "new_tokens": len(tokens), "rounds": None, "acceptance_lengths": [],
                "decode_seconds": max(total - prefill, 1e-9), "stage_ms": {}, "total_seconds": total}

    return _peer_turns(pipe, sample, decode)


def run_llama_peer(server: llama_cpp.LlamaServer, pipe, sample: Sample, max_new_tokens: int) -> list[dict]:
    """A llama.cpp peer on the same prompt token ids as ours (every turn), greedy, timed by llama.cpp
    itself (prompt processing excluded)."""

    def decode(prompt: torch.Tensor) -> dict:
        out = server.complete(prompt.tolist(), max_new_tokens)
        return {"token_ids": out["token_ids"], "new_tokens": out["new_tokens"], "rounds": None, "acceptance_lengths": [],
                "decode_seconds": max(out["decode_seconds"], 1e-9), "stage_ms": {}, "total_seconds": out["total_seconds"],
                "drafted": out["drafted"], "draft_accepted": out["draft_accepted"]}

    return _peer_turns(pipe, sample, decode)


def run(pipes, samples: list[Sample], grid: list[RunConfig], out_path: Path, max_new_tokens: int, seed: int = 0) -> list[dict]:
    """Decode every (sample, configuration); ``pipes``: one Pipeline, or {dtype name: Pipeline} for
    a grid that crosses dtypes. At T = 0 each run is checked against ``ar`` of its own dtype
    (``matches_ar``) and, in another dtype, also against float32 ``ar`` (``matches_ar_float32``:
    bf16 trees round differently from one-token steps, so this is measured, not promised). A peer's
    tokens are compared too (``same_as_ar``: measured, never counted as a mismatch of ours). The
    llama.cpp peers' servers start on first use and stop at the end."""
    if not isinstance(pipes, dict):
        pipes = {c.dtype: pipes for c in grid}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records = read_records(out_path)
    done = {(r["dataset"], r["sample_id"], r["key"]) for r in records}
    ar_tokens = {(r["dataset"], r["sample_id"], r["temperature"], RunConfig.from_record(r).dtype): [t["token_ids"] for t in r["turns"]]
                 for r in records if r["method"] == "ar"}
    mismatches = rounded = 0
    todo = [(s, c) for s in samples for c in grid if (s.dataset, s.sample_id, c.key) not in done]
    servers: dict[str, llama_cpp.LlamaServer] = {}
    with open(out_path, "a") as sink, contextlib.ExitStack() as stopping:
        for sample, cfg in tqdm(todo, desc="bench", unit="run"):
            pipe = pipes[cfg.dtype]
            if cfg.method in llama_cpp.LLAMA_PEERS:
                if cfg.method not in servers:
                    servers[cfg.method] = llama_cpp.start_peer(cfg.method, torch.get_num_threads())
                    stopping.callback(servers[cfg.method].close)
                turns = run_llama_peer(servers[cfg.method], pipe, sample, max_new_tokens)
            elif cfg.method in HF_PEERS:
                turns = run_hf_peer(pipe, sample, cfg, max_new_tokens)
            else:
                turns = _run_ours(pipe, sample, cfg, max_new_tokens, seed)
            peer = cfg.method in llama_cpp.LLAMA_PEERS or cfg.method in HF_PEERS
            rec = {"dataset": sample.dataset, "sample_id": sample.sample_id, "key": cfg.key, **asdict(cfg),
                   "target": cfg.method if peer else pipe.target.name,  # which forward and weights ran it
                   "max_new_tokens": max_new_tokens, "turns": turns,
                   "output_sha1": _sha1([t["token_ids"] for t in turns])}
            ref = ar_tokens.get((sample.dataset, sample.sample_id, cfg.temperature, cfg.dtype))
            ref32 = ar_tokens.get((sample.dataset, sample.sample_id, cfg.temperature, "float32"))
            if cfg.temperature == 0 and cfg.dtype != "float32" and ref32 is not None:
                rec["matches_ar_float32"] = ref32 == [t["token_ids"] for t in turns]
            if cfg.method == "ar":
                ar_tokens[(sample.dataset, sample.sample_id, cfg.temperature, cfg.dtype)] = [t["token_ids"] for t in turns]
            elif cfg.method in PEERS:
                if cfg.temperature == 0 and ref is not None:
                    rec["same_as_ar"] = ref == [t["token_ids"] for t in turns]
            elif cfg.temperature == 0 and ref is not None:
                rec["matches_ar"] = ref == [t["token_ids"] for t in turns]
                if not rec["matches_ar"] and cfg.dtype in EXACT_DTYPES:
                    mismatches += 1
                    tqdm.write(f"!!! MISMATCH at T=0: {cfg.key} on {sample.dataset}/{sample.sample_id} differs from ar", file=sys.stderr)
                elif not rec["matches_ar"]:
                    rounded += 1
            append_line(sink, rec)
            records.append(rec)
    if mismatches:
        print(f"!!! {mismatches} run(s) at T=0 did not reproduce ar's tokens (see matches_ar in {out_path})", file=sys.stderr)
    if rounded:
        print(f"{rounded} run(s) in a 16-bit dtype differ from ar of that dtype at T=0 (a tree forward rounds "
              f"differently from a one-token step; see matches_ar in {out_path})", file=sys.stderr)
    return records


def run_replay(pipe, samples: list[Sample], grid: list[RunConfig], out_path: Path, max_new_tokens: int,
               cost: CostModel | None = None) -> list[dict]:
    """T = 0 acceptance lengths by exact replay (``dartree.replay``): one greedy run and one
    teacher-forced target forward per turn, then every configuration's rounds on the drafter and
    tree builder alone. Records have the bench schema with ``"replay": true``; the only time in
    them is the tree build, measured on identical drafts for every configuration.

    With a cost model (needed for budget "auto", whose policy keeps its calibration from prompt to
    prompt as a pipeline does), each turn also records ``modeled_ms``, the rounds' time on that
    model, and each record the model's one-row step (``modeled_step_ms``): the report turns them
    into a modeled speedup over ``ar``."""
    configs = [c for c in grid if c.temperature == 0 and c.method not in PEERS and c.method != "ar"]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records = read_records(out_path)
    done = {(r["dataset"], r["sample_id"], r["key"]) for r in records}
    todo = [s for s in samples if any((s.dataset, s.sample_id, c.key) not in done for c in configs)]
    stop = pipe.default_stop_ids()
    builders = {c.key: make_builder(c.method, c.tree_settings()) for c in configs}
    policies = {c.key: BudgetPolicy(cost.for_proposer(builders[c.key].proposer),
                                         max_depth=pipe.proposal_depth(builders[c.key].proposer))
                for c in configs if c.budget == "auto"}
    require(cost is not None or not policies, "replaying budget 'auto' needs a cost model")
    # The greedy tokens are the expensive part (a full ar run): keep them, so further grids on the
    # same prompts (ablations) reuse them.
    greedy = GreedyAnswers(out_path.parent / "greedy.jsonl", ("dataset", "sample_id", "turn", "max_new_tokens"))
    with open(out_path, "a") as sink:
        for sample in tqdm(todo, desc="replay", unit="prompt"):
            messages, turns = [], {c.key: [] for c in configs}
            for index, turn in enumerate(sample.turns):
                messages.append({"role": "user", "content": turn})
                ids = pipe.encode(messages=list(messages))
                answer = greedy.tokens(pipe, ids, max_new_tokens, stop, dataset=sample.dataset, sample_id=sample.sample_id,
                                       turn=index, max_new_tokens=max_new_tokens)
                tree_seconds, modeled_ms = {}, {}
                output, lengths = replay(pipe, ids, builders, max_new_tokens, stop, answer,
                                         timings=tree_seconds, cost=cost, policies=policies, modeled=modeled_ms)
                for key, acc in lengths.items():
                    turns[key].append({"token_ids": output, "new_tokens": len(output), "rounds": len(acc),
                                       "acceptance_lengths": acc, "decode_seconds": 0.0,
                                       "stage_ms": {"tree": 1000.0 * tree_seconds[key]},
                                       **({"modeled_ms": modeled_ms[key]} if cost is not None else {})})
                messages.append({"role": "assistant", "content": pipe.tokenizer.decode(output, skip_special_tokens=True)})
            for c in configs:
                if (sample.dataset, sample.sample_id, c.key) in done:
                    continue
                rec = {"dataset": sample.dataset, "sample_id": sample.sample_id, "key": c.key, **asdict(c),
                       "target": pipe.target.name, "max_new_tokens": max_new_tokens, "replay": True, "turns": turns[c.key],
                       **({"modeled_step_ms": cost.verify(1),
                           "cost_model": {k: cost.identity.get(k) for k in ("dtype", "threads", "machine")}}
                          if cost is not None else {}),
                       "output_sha1": _sha1([t["token_ids"] for t in turns[c.key]])}
                append_line(sink, rec)
                records.append(rec)
    return records
