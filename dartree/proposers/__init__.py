"""Proposers: what speculates for a request, behind one contract (``base.Proposer``)."""

from .base import PROPOSERS, Proposer, make_proposer, register
from .drafter import DraftProposer, draft_batch
from .ngram import NgramChainProposer, NgramProposer
from .combined import DraftAndNgramProposer

__all__ = ["PROPOSERS", "Proposer", "make_proposer", "register", "DraftProposer", "draft_batch", "NgramProposer",
           "NgramChainProposer", "DraftAndNgramProposer"]
