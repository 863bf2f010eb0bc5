"""Training data: prompts from ../shared/prompts, responses written by the target itself.

Responses are generated in batches (left-padded, one KV cache) with the target's tapped layers and
its final normed state captured by forward hooks during generation, so no second forward is
needed. Each batch becomes one shard (safetensors):

- ``tokens`` int32 [sum L]: prompt + response of every sequence, concatenated;
- ``offsets`` int64 [n+1], ``prompt_lens`` int32 [n];
- ``features`` fp16 [sum (L-1), m*H]: tapped target states of positions 0..L-2 (the drafter context);
- ``teacher`` fp16 [sum (L-1), H]: the target's final normed state there (its next-token logits
  are ``lm_head(teacher)``, the distillation target).

Shards are written atomically and skipped when present, so generation resumes where it stopped.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import DartreeError
from ..prompts import code_prompt, instruction_prompt, math_prompt

MBPP_TRAIN_IDS = set(range(511, 975)) | set(range(1, 11))  # 11..510 is MBPP's test split


def training_prompts(prompts_dir: str | Path, seed: int = 0) -> list[str]:
    """All training prompts, formatted like the evaluation prompts, shuffled deterministically."""
    d = Path(prompts_dir)
    if not d.is_dir():
        raise DartreeError(f"prompts directory {str(d)!r} does not exist (expected ../shared/prompts)")
    out: list[str] = []
    with open(d / "gsm8k_train.jsonl") as f:
        out += [math_prompt(json.loads(line)["question"]) for line in f if line.strip()]
    for name in ("alpaca_train_2000.json", "dolly_train_2000.json"):
        out += [instruction_prompt(r["instruction"], r.get("input", "")) for r in json.loads((d / name).read_text())]
    with open(d / "mbpp_full.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row["task_id"] in MBPP_TRAIN_IDS:
                out.append(row["text"])
                tests = "\n".join(row["test_list"])
                out.append(code_prompt(f'"""\n{row["text"]}\n{tests}\n"""\n'))
    random.Random(seed).shuffle(out)
    return out


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] prompt + response
    prompt_len: int
    features: torch.Tensor  # [L-1, m*H]
    teacher: torch.Tensor  # [L-1, H]


class _Capture:
    """Forward hooks on the tapped layers and on the final norm, collecting every forward's outputs."""

    def __init__(self, model, tapped: list[int]):
        layers = model.model.layers
        self.tapped = tapped
        self.outputs: dict[str, torch.Tensor] = {}
        self.hooks = [layers[i].register_forward_hook(self._hook(str(i))) for i in tapped]
        self.hooks.append(model.model.norm.register_forward_hook(self._hook("final")))

    def _hook(self, key):
        def hook(_m, _i, output):
            self.outputs[key] = output[0] if isinstance(output, tuple) else output

        return hook

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.cat([self.outputs[str(i)] for i in self.tapped], dim=-1)
        final = self.outputs["final"]
        self.outputs.clear()
        return feats.to(torch.float16), final.to(torch.float16)

    def close(self):
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def generate_batch(model, tapped: list[int], prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   stop_ids: set[int], pad_id: int, generator: torch.Generator) -> list[Sequence]:
    from transformers import StaticCache

    device, cpu = next(model.parameters()).device, torch.device("cpu")
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((n, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        attn[i, width - len(p):] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cap = _Capture(model, tapped)
    try:
        # Preallocated: a growing cache would copy every layer's K/V at every step.
        cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        feats, finals = [], []
        f, h = cap.pop()
        feats.append(f)
        finals.append(h)
        responses = [[] for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool, device=cpu)
        for step in range(max_new_tokens):
            if temperature > 0:  # sampled on the CPU with a CPU generator: the same data on any device
                probs = (logits.float() / temperature).softmax(-1).cpu()
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(device)
            else:
                nxt = logits.argmax(-1)
            picked = nxt.tolist()
            for i in torch.nonzero(~done).flatten().tolist():
                responses[i].append(picked[i])
                if picked[i] in stop_ids:
                    done[i] = True
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            attn = torch.cat([attn, torch.ones(n, 1, dtype=torch.long, device=device)], dim=1)
            pos = pos[:, -1:] + 1
            logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
            f, h = cap.pop()
            feats.append(f)
            finals.append(h)
    finally:
        cap.close()
    feats_all, finals_all = torch.cat(feats, dim=1).to(cpu), torch.cat(finals, dim=1).to(cpu)
    out = []
    for i, p in enumerate(prompts):
        length = len(p) + len(responses[i])
        rows = torch.arange(width - len(p), width - len(p) + length - 1, device=cpu)  # positions 0..L-2 of this sequence
        out.append(Sequence(torch.tensor(p + responses[i], dtype=torch.int32, device=cpu), len(p), feats_all[i, rows], finals_all[i, rows]))
    return out


def save_shard(path: Path, seqs: list[Sequence], meta: dict) -> None:
    from safetensors.torch import save_file

    lengths = torch.tensor([s.tokens.numel() for s in seqs])
    tensors = {
        "tokens": torch.cat([s.tokens for s in seqs]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),
        "features": torch.cat([s.features for s in seqs]).contiguous(),
        "teacher": torch.cat([s.teacher for s in seqs]).contiguous(),
    }
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    tmp.rename(path)


def load_shard(path: Path) -> list[Sequence]:
    from safetensors.torch import load_file

    t = load_file(str(path))
    seqs, frow = [], 0
    offsets = t["offsets"].tolist()
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        n_feat = b - a - 1
        seqs.append(Sequence(t["tokens"][a:b].long(), int(t["prompt_lens"][i]), t["features"][frow:frow + n_feat], t["teacher"][frow:frow + n_feat]))
        frow += n_feat
    return seqs


def generate_data(model, tokenizer, tapped: list[int], prompts_dir, out_dir, num_prompts: int, batch_size: int = 32,
                  max_new_tokens: int = 256, sample_fraction: float = 0.25, seed: int = 0, max_minutes: float | None = None) -> None:
    """Write shards of target-written responses until ``num_prompts`` are covered (resumable)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = training_prompts(prompts_dir, seed)[:num_prompts]
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True) for t in texts]
    encoded = [e["input_ids"] if hasattr(e, "keys") else e for e in encoded]
    encoded = [e[-512:] for e in encoded]  # keep prompts short enough for a CPU
    stop = {tokenizer.eos_token_id}
    shards = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    t0 = time.perf_counter()
    bar = tqdm(range(len(shards)), desc="generating responses", unit="shard")
    for k in bar:
        path = out_dir / f"shard-{k:05d}.safetensors"
        if path.exists():
            continue
        if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes:
            bar.write(f"stopping after {max_minutes} minutes; run again to resume at shard {k}")
            break
        temperature = 1.0 if random.Random(seed * 100_003 + k).random() < sample_fraction else 0.0
        gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
        batch = sorted(shards[k], key=len)
        ts = time.perf_counter()
        seqs = generate_batch(model, tapped, batch, max_new_tokens, temperature, stop, tokenizer.eos_token_id, gen)
        new = sum(s.tokens.numel() - s.prompt_len for s in seqs)
        save_shard(path, seqs, {"temperature": temperature, "tapped": tapped, "shard": k})
        bar.set_postfix(tok_s=f"{new / (time.perf_counter() - ts):.0f}", T=temperature)
