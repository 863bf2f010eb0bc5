"""The draft tree: node i has row i + 1 in the verification batch, row 0 is the root (the bonus token);
parents always come before their children."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DartreeError


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, row index of the parent (0 = root)
    depths: torch.Tensor  # [N] long, 1..D
    # Optional, from the builders that rank their nodes (dartree): the drafter's path log-probability
    # of each node and the nodes best first, such that every prefix of the ranking is a valid tree.
    log_probs: torch.Tensor | None = None  # [N]
    rank: torch.Tensor | None = None  # [N] node indices

    def to(self, device) -> "DraftTree":
        """The same tree on ``device`` (a proposer's tree is built on the CPU; the target may be elsewhere)."""
        if self.tokens.device == torch.device(device):
            return self
        move = (lambda t: None if t is None else t.to(device))
        return DraftTree(move(self.tokens), move(self.parents), move(self.depths), move(self.log_probs), move(self.rank))

    def prefix(self, budget: int) -> "DraftTree":
        """The tree of the ``budget`` best-ranked nodes (parents always rank before their children)."""
        if self.rank is None:
            raise DartreeError("this tree carries no ranking; only ranked trees (dartree) can be cut to a prefix")
        if budget >= len(self):
            return self
        best = self.rank[:budget]
        if budget > 0 and int(best.max()) == budget - 1:
            # The best nodes are the first ``budget`` (distinct indices, the largest budget - 1): a tree
            # numbered best first, as the compiled grower's and the n-gram proposer's are. Their parents
            # are among them, so the prefix is their slices, rows unchanged (what ``restricted`` gives,
            # without its dozen small tensor ops: a round's cut of a free tree is most of its overhead).
            return DraftTree(self.tokens[:budget], self.parents[:budget], self.depths[:budget],
                             None if self.log_probs is None else self.log_probs[:budget], best)
        return self.restricted(best.sort().values)

    def restricted(self, keep: torch.Tensor) -> "DraftTree":
        """The tree of the sorted, ancestor-closed node set ``keep``, with the kept nodes' scores and,
        for a ranked tree, their ranking in its order."""
        cut = subtree(self.tokens, self.parents, self.depths, keep)
        cut.log_probs = self.log_probs[keep] if self.log_probs is not None else None
        if self.rank is not None:
            positions = torch.full((len(self),), -1, dtype=torch.long, device=keep.device)
            positions[keep] = torch.arange(keep.numel(), device=keep.device)
            ranked = positions[self.rank]
            cut.rank = ranked[ranked >= 0]
        return cut

    def __len__(self) -> int:
        return self.tokens.numel()

    def node_paths(self) -> list[tuple[int, ...]]:
        """Each node's root-to-node token path, in node order."""
        found: list[tuple[int, ...]] = []
        for p, t in zip(self.parents.tolist(), self.tokens.tolist()):
            found.append((found[p - 1] if p > 0 else ()) + (t,))
        return found

    def paths(self) -> set[tuple[int, ...]]:
        """Root-to-node token paths: a numbering-free description of the tree."""
        return set(self.node_paths())

    def rows(self, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and depths of the verification batch: row 0 is the root (depth 0), row i+1 node i."""
        device = self.tokens.device
        tokens = torch.cat([torch.tensor([root], dtype=torch.long, device=device), self.tokens])
        depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), self.depths])
        return tokens, depths

    @classmethod
    def empty(cls, device="cpu") -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.clone())

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "DraftTree":
        n = tokens.numel()
        ar = torch.arange(n, device=tokens.device)
        return cls(tokens.long(), ar, ar + 1)

    @classmethod
    def from_lists(cls, tokens, parents, depths, device="cpu") -> "DraftTree":
        mk = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(mk(tokens), mk(parents), mk(depths))


def subtree(tokens, parents, depths, keep: torch.Tensor) -> DraftTree:
    """Restrict a tree to an ancestor-closed, sorted node set, renumbering parent rows."""
    row_map = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=tokens.device)
    row_map[keep + 1] = torch.arange(1, keep.numel() + 1, device=tokens.device)
    return DraftTree(tokens[keep], row_map[parents[keep]], depths[keep])
