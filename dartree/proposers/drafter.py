"""The drafter as a proposer: the block-diffusion drafter (``dartree.drafter``) run once per round,
its draft read by the tree methods with its correction head."""

from __future__ import annotations

import torch
from torch import nn

from ..drafter import DrafterCache, DrafterModel, DraftOutput
from ..errors import require
from ..lean_drafter import lean_draft_forward, lean_drafter_reason, lean_logits, lean_weights_of, up_to_date
from ..targets.lean import KVStore
from .base import register


@register
class DraftProposer:
    """One request's drafter: its own drafter cache and the tapped target states it has not read
    yet; the drafter's weights, the target's frozen embedding and output layer (or the drafter's
    own reduced-vocabulary output layer) are shared."""

    name = "drafter"
    reads_tapped_states = True

    def __init__(self, model: DrafterModel, embed_tokens: nn.Embedding, lm_head: nn.Module):
        self.model = model
        self.head = model.head
        self.embed_tokens = embed_tokens
        self.lm_head = model.lm_head if model.lm_head is not None else lm_head
        # on a CPU in float32 the drafter runs on the lean kernels (``lean_drafter``), its context
        # K/V in a store of its own; elsewhere ``DrafterModel.forward`` on a ``DrafterCache``
        self.lean = lean_weights_of(model, self.lm_head) if lean_drafter_reason(model) is None else None
        self.store = KVStore(self.lean, slots=1, capacity=256) if self.lean is not None else None
        self.cache = DrafterCache(model.config.num_hidden_layers)
        self.unread: list[torch.Tensor] = []  # tapped states the drafter has not read yet
        self.depth_limit: int | None = None  # the depths the next draft need reach (None: every depth)
        cfg = model.config
        if model.mask_embedding is None:
            require(
                cfg.mask_token_id < embed_tokens.num_embeddings,
                f"mask_token_id {cfg.mask_token_id} is outside the target embedding ({embed_tokens.num_embeddings} rows) "
                "and the drafter has no mask_embedding weight",
            )

    @classmethod
    def create(cls, pipeline) -> "DraftProposer":
        require(pipeline.drafter is not None, "this method needs a drafter; load the pipeline with drafter=...")
        return cls(pipeline.drafter, pipeline.target.embed_tokens, pipeline.target.lm_head)

    @property
    def num_depths(self) -> int:
        return self.model.config.num_draft_depths

    @property
    def batch_key(self) -> object:
        return self.model

    @property
    def context_length(self) -> int:
        """Positions of the target's context the drafter has read (its context K/V)."""
        return self.store.lengths[0] if self.store is not None else self.cache.length

    def reset(self) -> None:
        self.cache = DrafterCache(self.model.config.num_hidden_layers)
        if self.store is not None:
            self.store.lengths[0] = 0
        self.unread = []

    def observe(self, tokens: torch.Tensor, tapped_states: torch.Tensor | None) -> None:
        if tapped_states is not None:
            self.unread.append(tapped_states)

    @classmethod
    @torch.no_grad()
    def propose_batch(cls, proposers: list["DraftProposer"], bonuses: list[int], positions: list[int]) -> list[DraftOutput]:
        """ONE drafter call for every request, each on its own cache with the states it has not read."""
        states = [torch.cat(p.unread) if len(p.unread) > 1 else p.unread[0] for p in proposers]
        drafts = draft_batch(proposers, bonuses, states, positions)
        for p in proposers:  # read only once the call succeeded: a failed batch is retried request by request
            p.unread = []
        return drafts

    @torch.no_grad()
    def draft(self, bonus: int, new_tapped_states: torch.Tensor, start: int) -> DraftOutput:
        """One call on given states: ``new_tapped_states`` [C, m*H] of positions cache_len..start-1."""
        return draft_batch([self], [bonus], [new_tapped_states], [start])[0]


def block_length(cfg, depth_limits: list[int | None]) -> int:
    """The block positions a call runs: enough for the deepest limit of its requests (every position
    where one has none). A shorter block is a different, still deterministic draft: the positions
    attend to each other within the block."""
    depths = cfg.num_draft_depths
    if depth_limits and all(d is not None for d in depth_limits):
        depths = max(1, min(depths, max(depth_limits)))
    return depths if cfg.shift_label else depths + 1


@torch.no_grad()
def draft_batch(proposers: list[DraftProposer], bonuses: list[int], tapped_states: list[torch.Tensor],
                starts: list[int]) -> list[DraftOutput]:
    """One drafter call for many requests (the round's speculating requests), each with its own
    drafter cache: the blocks run as one batch whose new context rows and cached keys are padded to
    the longest, with a mask that shows each block only its own request's keys. The weights, the
    drafter's output layer included, are read once for the whole batch; one request runs on its own
    cache as it is (``DraftProposer.draft``). The block is as long as the proposers' ``depth_limit``
    asks (``block_length``)."""
    first = proposers[0]
    model, cfg = first.model, first.model.config
    require(all(p.model is model and p.embed_tokens is first.embed_tokens for p in proposers),
            "a batched draft call needs proposers of one drafter")
    device, b = tapped_states[0].device, len(proposers)
    q = block_length(cfg, [p.depth_limit for p in proposers])
    cached = [p.context_length for p in proposers]
    new = [f.shape[0] for f in tapped_states]
    require(all(c + n == s for c, n, s in zip(cached, new, starts)), "drafter context out of step with the target")
    if first.lean is not None:
        lean = up_to_date(first.lean, first.lm_head)  # the drafter's weights may have changed since (training's evaluation)
        for p in proposers:  # (their context K/V, from the old weights, stays until a reset: a new prompt)
            p.lean = lean
        embeds = model.block_embeddings(first.embed_tokens, torch.tensor(bonuses, device=device), q)
        hidden = lean_draft_forward(lean, [p.store for p in proposers], embeds, tapped_states, starts)
        if not cfg.shift_label:
            hidden = hidden[:, 1:]  # block position 0 only restates the bonus token
        logits = lean_logits(lean, hidden)
        return [DraftOutput(bonus=bonus, hidden=hidden[i], base_logits=logits[i], d2t=model.d2t)
                for i, bonus in enumerate(bonuses)]
    block_pos = torch.stack([s + torch.arange(q, device=device) for s in starts])
    if b == 1:  # alone: straight on its own cache, nothing to pad or hide
        tapped, cache, mask = tapped_states[0][None], first.cache, None
        ctx_pos, block_pos = torch.arange(cached[0], starts[0], device=device), block_pos[0]
    else:
        longest_cache, longest_new = max(cached), max(new)
        tapped = tapped_states[0].new_zeros(b, longest_new, tapped_states[0].shape[-1])
        for i, f in enumerate(tapped_states):
            tapped[i, : f.shape[0]] = f
        steps = torch.arange(longest_new, device=device)
        ctx_pos = torch.stack([c + steps for c in cached])  # padded rows get positions too; the mask hides them
        # keys a block sees, in order: [cached (padded to the longest), new context (padded), its own block]
        mask = torch.zeros(b, 1, q, longest_cache + longest_new + q, dtype=torch.bool, device=device)
        for i, (c, n) in enumerate(zip(cached, new)):
            mask[i, :, :, :c] = True
            mask[i, :, :, longest_cache:longest_cache + n] = True
        mask[:, :, :, longest_cache + longest_new:] = True
        cache = DrafterCache(cfg.num_hidden_layers)
        if longest_cache:
            shape = (b, cfg.num_key_value_heads, longest_cache, cfg.head_dim)
            for layer in range(cfg.num_hidden_layers):
                keys, values = tapped.new_zeros(shape), tapped.new_zeros(shape)
                for i, p in enumerate(proposers):
                    if cached[i]:
                        keys[i, :, : cached[i]] = p.cache.keys[layer][0]
                        values[i, :, : cached[i]] = p.cache.values[layer][0]
                cache.keys[layer], cache.values[layer] = keys, values
    embeds = model.block_embeddings(first.embed_tokens, torch.tensor(bonuses, device=device), q)
    hidden = model(embeds, tapped, ctx_pos, block_pos, cache=cache, attn_mask=mask)  # [b, Q, H]
    if b == 1:
        first.cache.crop(starts[0])  # keep the context K/V, drop the block's
    else:
        for i, p in enumerate(proposers):  # each request keeps its new context K/V (the blocks' never stay)
            rows = slice(longest_cache, longest_cache + new[i])
            for layer in range(cfg.num_hidden_layers):
                p.cache.append(layer, cache.keys[layer][i:i + 1, :, rows], cache.values[layer][i:i + 1, :, rows])
    if not cfg.shift_label:
        hidden = hidden[:, 1:]  # block position 0 only restates the bonus token
    logits = first.lm_head(hidden.reshape(-1, hidden.shape[-1])).reshape(b, hidden.shape[1], -1)
    return [DraftOutput(bonus=bonus, hidden=hidden[i], base_logits=logits[i], d2t=model.d2t)
            for i, bonus in enumerate(bonuses)]
