"""Causal correction heads: make each draft depth depend on the path drafted before it.

Both heads sit behind one small interface so that no tree builder knows which one it uses:

- ``initial_state(bonus)``: the state of the root (the path holding only the bonus token);
- ``advance(states, tokens)``: the states of a batch of paths, each extended by one token (draft ids:
  with a reduced draft vocabulary the head maps them to target ids itself);
- ``logits(round, depth, states, candidates)``: corrected logits of candidate tokens at one depth
  index (0-based: index d drafts the token at tree depth d + 1), for a batch of path states.

A "round" object (``start_round``) holds what every call of one round shares (the drafter states
and their base logits, plus per-head precomputation).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn

def to_target_ids(d2t: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """Target ids of draft ids under a reduced draft vocabulary (target id = draft id + d2t[draft id]);
    without one (``d2t`` None) draft ids are target ids."""
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


@dataclass
class HeadRound:
    hidden: torch.Tensor  # [D, H] drafter states z_d
    base_logits: torch.Tensor  # [D, V]
    hidden_proj: torch.Tensor | None = None  # Domino: W_z z_d for every depth, [D, R]


class CorrectionHead(nn.Module):
    uncorrected_depths: int = 0

    def __init__(self):
        super().__init__()
        self._embed: nn.Embedding | None = None
        self._d2t: torch.Tensor | None = None

    def bind(self, embed_tokens: nn.Embedding, d2t: torch.Tensor | None = None) -> None:
        """Give the head the target's frozen token embedding and the drafter's draft-to-target id
        offsets (neither is saved with the head)."""
        object.__setattr__(self, "_embed", embed_tokens)
        object.__setattr__(self, "_d2t", d2t)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return to_target_ids(self._d2t, draft_ids)

    def start_round(self, hidden: torch.Tensor, base_logits: torch.Tensor) -> HeadRound:
        return HeadRound(hidden=hidden, base_logits=base_logits)

    def initial_state(self, bonus: int) -> torch.Tensor:
        raise NotImplementedError

    def advance(self, states: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """States of paths extended by one token: child i extends states[rows[i]] (rows None: row i)."""
        raise NotImplementedError

    def delta(self, rnd: HeadRound, depth: int, states: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
        """Correction [N, C] given the output-projection rows [C, R] of the candidates."""
        raise NotImplementedError

    def output_rows(self, candidates: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, rnd: HeadRound, depth: int, states: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
        """Corrected logits [N, C] at depth index ``depth`` (tree depth depth + 1); candidates None = full vocabulary."""
        base = rnd.base_logits[depth]
        if candidates is not None:
            base = base[candidates]
        if depth < self.uncorrected_depths:
            return base.expand(states.shape[0], -1)
        return base + self.delta(rnd, depth, states, self.output_rows(candidates))

    def logits_batch(self, rounds: list[HeadRound], depth: int, states: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``logits`` for the branches of many requests at once: request i owns the i-th of
        ``len(rounds)`` equal groups of rows of ``states`` and has candidates ``candidates[i]``
        ([R, C]). The products over the states run once for all; returns [N, C]."""
        per = states.shape[0] // len(rounds)
        base = torch.stack([r.base_logits[depth] for r in rounds]).gather(1, candidates)  # [R, C]
        base = base.repeat_interleave(per, dim=0)
        if depth < self.uncorrected_depths:
            return base
        return base + self.delta_batch(rounds, depth, states, candidates)

    def delta_batch(self, rounds: list[HeadRound], depth: int, states: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        per = states.shape[0] // len(rounds)
        return torch.cat([self.delta(r, depth, states[i * per:(i + 1) * per], self.output_rows(candidates[i]))
                          for i, r in enumerate(rounds)])

    # ------------------------------------------------------------- training (teacher forcing)
    def block_logits(self, hidden: torch.Tensor, base_logits: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced corrected logits for whole blocks.

        hidden [N, Q, H], base_logits [N, Q, V], prev_tokens [N, Q]: the tokens (target ids) each block position conditions on
        (position k has seen prev_tokens[:, :k+1]). Returns [N, Q, V].
        """
        raise NotImplementedError


class DominoHead(CorrectionHead):
    """GRU over the target's token embeddings + low-rank residual on the logits (bias-free)."""

    def __init__(self, hidden_size: int, gru_hidden: int, rank: int, vocab_size: int, pure_prefix: int):
        super().__init__()
        self.prefix_gru = nn.GRU(hidden_size, gru_hidden, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden_size + gru_hidden, rank, bias=False), nn.SiLU(), nn.Linear(rank, vocab_size, bias=False)
        )
        self.hidden_size = hidden_size
        self.uncorrected_depths = pure_prefix

    def start_round(self, hidden, base_logits):
        w1 = self.embed_proj[0].weight
        return HeadRound(hidden, base_logits, hidden_proj=hidden @ w1[:, : self.hidden_size].T)

    def _gru_step(self, states: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        # PyTorch GRU gate order (r, z, n), no biases. The input projection depends only on the
        # token and the hidden projection only on the parent, so a batch computes each once:
        # beams concentrate on a few parents and repeat tokens across parents.
        if tokens.numel() > 1:
            uniq_tokens, token_of = tokens.unique(return_inverse=True)
            gi = (self._embed(uniq_tokens) @ self.prefix_gru.weight_ih_l0.T)[token_of]
        else:
            gi = self._embed(tokens) @ self.prefix_gru.weight_ih_l0.T
        if rows is not None and rows.numel() > 1:
            uniq_rows, row_of = rows.unique(return_inverse=True)
            parent_states = states[uniq_rows]
            gh = (parent_states @ self.prefix_gru.weight_hh_l0.T)[row_of]
            states = parent_states[row_of]
        else:
            if rows is not None:
                states = states[rows]
            gh = states @ self.prefix_gru.weight_hh_l0.T
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * states

    def initial_state(self, bonus: int) -> torch.Tensor:
        # the GRU's step from the zero state: its hidden projection is zero, so the step is
        # (1 - z) * n with z = sigmoid(i_z), n = tanh(i_n) (the same values, a third of the work)
        w = self.prefix_gru.weight_ih_l0
        gi = self._embed(torch.tensor([bonus], device=w.device)) @ w.T
        _, i_z, i_n = gi.chunk(3, dim=-1)
        return (1 - torch.sigmoid(i_z)) * torch.tanh(i_n)

    def advance(self, states, tokens, rows=None):
        return self._gru_step(states, self.target_ids(tokens), rows)

    def output_rows(self, candidates):
        w2 = self.embed_proj[2].weight
        return w2 if candidates is None else w2[candidates]

    def delta(self, rnd, depth, states, out_rows):
        w_s = self.embed_proj[0].weight[:, self.hidden_size :]
        return F.silu(rnd.hidden_proj[depth] + states @ w_s.T) @ out_rows.T

    def delta_batch(self, rounds, depth, states, candidates):
        # the state projection for every request's branches in one product, then each request's
        # candidates' output rows: [R, per, rank] x [R, rank, C]
        w_s = self.embed_proj[0].weight[:, self.hidden_size :]
        per = states.shape[0] // len(rounds)
        hidden = torch.stack([r.hidden_proj[depth] for r in rounds])  # [R, rank]
        act = F.silu(hidden.repeat_interleave(per, dim=0) + states @ w_s.T).view(len(rounds), per, -1)
        return torch.bmm(act, self.output_rows(candidates).transpose(1, 2)).reshape(states.shape[0], -1)

    def block_logits(self, hidden, base_logits, prev_tokens):
        states, _ = self.prefix_gru(self._embed(prev_tokens))
        delta = self.embed_proj(torch.cat([hidden, states], dim=-1))
        p = self.uncorrected_depths
        return torch.cat([base_logits[:, :p], base_logits[:, p:] + delta[:, p:]], dim=1)


class MarkovHead(CorrectionHead):
    """DSpark's Markov head: a rank-r bias W2 · W1[previous token]; the state is W1[last token].

    W1 is indexed by target ids (the previous token may be any target token, the bonus included);
    W2 has one row per output (draft) id."""

    def __init__(self, vocab_size: int, rank: int, output_size: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, output_size or vocab_size, bias=False)

    def initial_state(self, bonus):
        return self.markov_w1.weight[bonus][None]

    def advance(self, states, tokens, rows=None):
        return self.markov_w1(self.target_ids(tokens))

    def output_rows(self, candidates):
        w2 = self.markov_w2.weight
        return w2 if candidates is None else w2[candidates]

    def delta(self, rnd, depth, states, out_rows):
        return states @ out_rows.T

    def delta_batch(self, rounds, depth, states, candidates):
        per = states.shape[0] // len(rounds)
        out = torch.bmm(states.view(len(rounds), per, -1), self.output_rows(candidates).transpose(1, 2))
        return out.reshape(states.shape[0], -1)

    def block_logits(self, hidden, base_logits, prev_tokens):
        return base_logits + self.markov_w2(self.markov_w1(prev_tokens))
