"""Tiny random targets and drafters, saved to disk in the real formats.

The tests' fixtures: a Llama or Qwen3 causal LM with a few layers and a small
vocabulary, a word-level tokenizer, and a DFlash-format drafter (optionally with a Domino or Markov
head) that loads through the same code path as a published checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dartree.drafter import DrafterConfig, DrafterModel
from dartree.loading import save_drafter


def make_tiny_target(
    directory: str | Path,
    family: str = "llama",
    vocab_size: int = 32,
    hidden_size: int = 32,
    num_layers: int = 4,
    seed: int = 0,
    max_positions: int = 512,
    logit_scale: float = 1.0,
) -> Path:
    """Save a random causal LM. ``logit_scale`` sharpens its next-token distributions."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    directory = Path(directory)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":
        config = LlamaConfig(**common)
    elif family == "qwen3":
        config = Qwen3Config(head_dim=hidden_size // 4, **common)
    else:
        raise ValueError(f"family must be 'llama' or 'qwen3', got {family!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(directory)
    _save_word_tokenizer(directory, vocab_size)
    return directory


def _save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(directory)


def make_tiny_drafter(
    directory: str | Path,
    target_dir: str | Path,
    head: str | None = None,
    block_size: int = 5,
    num_layers: int = 1,
    tapped: list[int] | None = None,
    shift_label: bool | None = None,
    seed: int = 0,
    use_mask_embedding: bool = False,
    weight_std: float = 0.3,
    draft_vocab: int | None = None,
) -> Path:
    """A random drafter in the published format; ``draft_vocab`` gives it a reduced output vocabulary
    (its own lm_head over a random subset of that many target ids, with d2t)."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(target_dir)
    h = tcfg.hidden_size
    if tapped is None:
        tapped = [0, tcfg.num_hidden_layers - 1]
    cfg = DrafterConfig(
        hidden_size=h,
        intermediate_size=2 * h,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=h // 4,
        vocab_size=tcfg.vocab_size,
        block_size=block_size,
        num_target_layers=tcfg.num_hidden_layers,
        mask_token_id=tcfg.vocab_size if use_mask_embedding else tcfg.vocab_size - 1,
        target_layer_ids=list(tapped),
        shift_label=(head is not None) if shift_label is None else shift_label,
        projector_type=head,
        pure_draft_prefix_len=1,
        emb_dim=16,
        gru_hidden_dim=24,
        markov_rank=16 if head == "markov" else 0,
        draft_vocab_size=draft_vocab,
    )
    model = DrafterModel(cfg)
    if use_mask_embedding:
        model.mask_embedding = torch.nn.Parameter(torch.zeros(h))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * weight_std)
        if draft_vocab:
            ids = torch.randperm(tcfg.vocab_size, generator=gen)[:draft_vocab].sort().values
            model.d2t.copy_(ids - torch.arange(draft_vocab))
    save_drafter(model, directory)
    return Path(directory)


def byte_grammars(tokens: list[bytes]):
    """Structured output's compiled formats (``structured.Grammars``) for a tiny vocabulary whose token
    i is ``tokens[i]`` and token 0 ends the text: the tiny targets' word-level tokenizer has no bytes
    the grammar engine could read."""
    import llguidance

    from dartree.structured import Grammars

    class Vocabulary:  # what llguidance needs of a tokenizer: each token's bytes, the end token, an encoder
        eos_token_id, bos_token_id, special_token_ids = 0, None, [0]

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text) -> list[int]:  # bytes outside the vocabulary are dropped
            return [tokens.index(bytes([c])) for c in text if bytes([c]) in tokens]

    return Grammars(llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary())), len(tokens))
