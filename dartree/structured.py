"""Structured output: a JSON schema, a regex, a choice list or a grammar holds at every committed token.

The grammar engine is llguidance (what vLLM, SGLang and llama.cpp use; picked over xgrammar on this
project's CPUs: a mask on the default model's 49k vocabulary costs ~17-25 us against xgrammar's ~3 us,
both well under 1 % of a round, and llguidance needs no other package while xgrammar brings Triton's
1 GB; both roll back). A format is compiled once per tokenizer and text and cached; each request gets
its own matcher.

Exactness: the target's distribution at every position the walk chooses a token is the masked one
(tokens the grammar forbids there get probability 0) whatever tree the method built: a tree row's
mask is the grammar's state after the committed text and the row's path (``Constraint.mask``), so at
T = 0 every method writes exactly constrained ``ar``'s tokens and at T > 0 a sample of the constrained
distribution. A drafted node whose token the grammar forbids can never be on the accepted path; the
tree methods' proposals need not know the grammar for the output to be right (``Constraint.prune``
removes such nodes before the forward, so they cost no row), and where the grammar forces the next
tokens they join the tree at probability 1 (``Constraint.shape``). Before a tree is built, the drafter's
base logits are steered (``Constraint.steer``) at the depths whose grammar state every branch shares: the
forced run, then the tokens the grammar allows after it, so the tree spends its nodes beyond the forced run
on tokens that can be accepted.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy
import torch

from .errors import DartreeError, require
from .trees.common import merge_ranked
from .trees.tree import DraftTree

FORMAT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")  # a bare schema's "type"
# How far a steered draft's forbidden tokens fall below the allowed ones: far more than a correction head
# moves a logit, so no branch through a forbidden token outranks one through an allowed token.
STEER_PENALTY = 1e4
# JSON without whitespace between tokens: the model's own answers follow the template, and a single
# allowed next token (a quote, a colon, a key) is then certain.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class OutputFormat:
    """What the output must match: ``kind`` (``FORMAT_KINDS``) and its text (a schema as JSON, a regex,
    the choices as a JSON list, a Lark or GBNF grammar)."""

    kind: str
    text: str

    @classmethod
    def parse(cls, spec) -> "OutputFormat | None":
        """An ``OutputFormat`` from what users pass: None; an ``OutputFormat``; a Pydantic model class;
        a dict ``{"type": "json_schema", "json_schema": {"schema": ...}}`` / ``{"type": "json_object"}``
        (OpenAI's ``response_format``) or ``{"json_schema": ...}`` / ``{"regex": ...}`` /
        ``{"choice": [...]}`` / ``{"grammar": ...}`` (vLLM's names); or a plain JSON schema dict."""
        if spec is None or isinstance(spec, OutputFormat):
            return spec
        if isinstance(spec, type) and hasattr(spec, "model_json_schema"):  # a Pydantic model class
            return cls("json_schema", json.dumps(spec.model_json_schema()))
        require(isinstance(spec, dict), f"response_format must be a dict, a Pydantic model class or None, got {type(spec).__name__}")
        kind = spec.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object", json.dumps({"type": "object"}))
        if kind == "json_schema":
            inner = spec.get("json_schema")
            require(isinstance(inner, dict), "response_format json_schema needs a 'json_schema' object")
            schema = inner.get("schema", inner if "schema" not in inner and "name" not in inner else None)
            require(isinstance(schema, (dict, bool)), "response_format json_schema needs json_schema.schema (a JSON schema object)")
            return cls("json_schema", json.dumps(schema))
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if spec.get(k) is not None]
        if not given:  # a bare JSON schema ({"type": "object", ...})
            require(kind is None or kind in JSON_TYPES,
                    f"unsupported response_format type {kind!r}; supported: text, json_object, json_schema (or a JSON schema)")
            return cls("json_schema", json.dumps(spec))
        require(len(given) == 1, f"give one structured output format, got {', '.join(given)}")
        key, value = given[0], spec[given[0]]
        if key == "json_schema":
            require(isinstance(value, (dict, str)), "json_schema must be a JSON schema (an object or its JSON text)")
            return cls("json_schema", value if isinstance(value, str) else json.dumps(value))
        if key == "choice":
            require(isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
                    "choice must be a non-empty list of non-empty strings")
            return cls("choice", json.dumps(value))
        require(isinstance(value, str) and value.strip(), f"{key} must be a non-empty string")
        return cls(key, value)

    def grammar(self) -> str:
        """The llguidance grammar of this format (not yet checked: ``Grammars.compile`` checks it)."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise DartreeError(f"the JSON schema is not valid JSON: {exc}") from None
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
            except ValueError as exc:
                raise DartreeError(f"invalid JSON schema: {exc}") from None
        if self.kind == "regex":
            try:
                re.compile(self.text)
            except re.error as exc:
                raise DartreeError(f"the regex does not compile: {exc}") from None
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(self.text)))
        text = self.text
        if "::=" in text:  # GBNF (llama.cpp's grammar format)
            try:
                text = llguidance.gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter raises several kinds; the message is what matters
                raise DartreeError(f"the GBNF grammar does not parse: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(text)


class Grammars:
    """Compiled formats for one tokenizer: the llguidance tokenizer made once (~0.3 s on the default
    model) and each format's checked grammar kept (least recently used out), so a request only copies
    a matcher."""

    def __init__(self, tokenizer, vocab_size: int, capacity: int = 64):
        import llguidance
        import llguidance.hf

        require(tokenizer is not None, "structured output needs the target's tokenizer; this pipeline has none")
        # a Hugging Face tokenizer, or an llguidance one made by the caller (the tests' tiny vocabularies)
        self.tokenizer = tokenizer if isinstance(tokenizer, llguidance.LLTokenizer) else llguidance.hf.from_tokenizer(tokenizer)
        self.vocab_size = vocab_size  # the target's logits width (may exceed the tokenizer's)
        self.capacity = capacity
        self.compiled: OrderedDict[OutputFormat, object] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles in its request threads

    def compile(self, fmt: OutputFormat):
        """A fresh matcher at the start of ``fmt``; ``DartreeError`` naming the problem where the
        format is invalid or matches nothing."""
        import llguidance

        with self._lock:
            return self._compiled(fmt, llguidance).deep_copy()

    def _compiled(self, fmt: OutputFormat, llguidance):
        if fmt not in self.compiled:
            grammar = fmt.grammar()
            problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            require(not problem or problem.startswith("WARNING"), f"invalid {fmt.kind.replace('_', ' ')}: {problem}")
            matcher = llguidance.LLMatcher(self.tokenizer, grammar)
            require(not matcher.is_error(), f"invalid {fmt.kind.replace('_', ' ')}: {matcher.get_error()}")
            require(not matcher.is_stopped(), f"the {fmt.kind.replace('_', ' ')} matches only the empty text")
            self.compiled[fmt] = matcher
            if len(self.compiled) > self.capacity:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(fmt)
        return self.compiled[fmt]


class Constraint:
    """One request's grammar state: advanced by every committed token (``advance``); the masks of tree
    rows are the state after each row's path, computed by consuming the path and rolling it back."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.torch as llt

        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = llt.allocate_token_bitmask(1, vocab_size)
        self._fill = llt.fill_next_token_bitmask
        self._forced: list[int] | None = None  # the forced run after the committed text (None: not asked yet)
        # the allowed tokens after each path asked about since the last commit (None: the path leaves the grammar)
        self._after: dict[tuple[int, ...], torch.Tensor | None] = {}

    def _allowed(self) -> torch.Tensor:
        """The tokens the grammar allows now, [V] bool (bit k of the mask's byte j is token 8j + k; numpy
        unpacks the bits several times faster than torch's indexing does)."""
        self._fill(self.matcher, self._bitmask, 0)
        bits = torch.from_numpy(numpy.unpackbits(self._bitmask.numpy().view(numpy.uint8), bitorder="little")).bool()
        if bits.numel() < self.vocab_size:  # logits wider than the tokenizer: the extra ids are never allowed
            bits = torch.cat([bits, bits.new_zeros(self.vocab_size - bits.numel())])
        return bits[:self.vocab_size]

    def _allowed_after(self, paths: list[tuple[int, ...]]) -> list[torch.Tensor | None]:
        """The tokens the grammar allows after each path ([V] bool), None where the path leaves the grammar;
        each path's mask computed once between two commits (``decided`` and ``mask`` of a round share them)."""
        held: list[int] = []  # the tokens consumed beyond the committed text, as the walk's rows share prefixes
        for path in paths:
            if path in self._after:
                continue
            shared = 0
            while shared < min(len(held), len(path)) and held[shared] == path[shared]:
                shared += 1
            if len(held) > shared:
                self.matcher.rollback(len(held) - shared)
                del held[shared:]
            rest = list(path[shared:])
            taken = self.matcher.try_consume_tokens(rest) if rest else 0
            held += rest[:taken]
            self._after[path] = self._allowed() if taken == len(rest) else None
        if held:
            self.matcher.rollback(len(held))
        return [self._after[path] for path in paths]

    def decided(self, paths: list[tuple[int, ...]]) -> list[int | None]:
        """Per path, the one token the grammar allows after it, or None (several allowed, or the path leaves
        the grammar). Where the grammar allows one token the target's choice is that token, whatever its
        logits and at any temperature (every other token has probability 0): the round skips the output
        layer's row there (``engine``)."""
        out: list[int | None] = []
        for allowed in self._allowed_after(paths):
            if allowed is None or int(torch.count_nonzero(allowed)) != 1:
                out.append(None)
            else:
                out.append(int(allowed.nonzero()[0, 0]))
        return out

    def mask(self, logits: torch.Tensor, paths: list[tuple[int, ...]]) -> torch.Tensor:
        """``logits`` [n, V] with the tokens the grammar forbids after each row's path at -inf. A row
        whose path leaves the grammar is never on an accepted path (every committed token was allowed),
        so its logits are left as they are."""
        allowed = torch.ones(logits.shape, dtype=torch.bool)
        for i, after in enumerate(self._allowed_after(paths)):
            if after is not None:
                allowed[i] = after
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def forced(self) -> list[int]:
        """The tokens the grammar forces after the committed text (llguidance's fast-forward tokens: the
        bytes are certain; another tokenization of them may be allowed too), kept until the next commit."""
        if self._forced is None:
            self._forced = list(self.matcher.compute_ff_tokens())
        return self._forced

    def steer(self, proposal):
        """The proposal with its draft's base logits (``DraftOutput``: [D, V_d] over draft ids, ``d2t`` to
        target ids; or a proposal holding one as ``.draft``) steered to the grammar where its state does not
        depend on the branch: at the depths of the forced run only the forced token keeps its logit, and at
        the depth after it only the tokens the grammar allows there; the others lose ``STEER_PENALTY``. The
        steering stops where the drafter's vocabulary lacks a forced token (no branch of it reaches past).
        Proposals without a draft (an n-gram tree) are returned as they are. The output never depends on
        it: only which tokens the tree tries does."""
        if hasattr(proposal, "draft"):
            return replace(proposal, draft=self.steer(proposal.draft))
        base = getattr(proposal, "base_logits", None)
        if base is None or not base.shape[0]:
            return proposal
        depths, width = base.shape
        ids = proposal.to_target(torch.arange(width, device=base.device))  # each draft id's target id
        steered: list[torch.Tensor] = []  # per depth from the first: the draft ids the grammar allows there
        forced = self.forced()
        for token in forced[:depths]:
            allowed = ids == token
            if not bool(allowed.any()):
                break
            steered.append(allowed)
        else:
            if len(steered) < depths:
                if forced:
                    self.matcher.consume_tokens(forced)
                try:
                    allowed = self._allowed().to(base.device)  # the grammar's mask is built on the CPU
                finally:
                    if forced:
                        self.matcher.rollback(len(forced))
                in_target = ids < allowed.numel()
                allowed = in_target & allowed[ids.clamp(max=allowed.numel() - 1)]
                if bool(allowed.any()) and not bool(allowed.all()):
                    steered.append(allowed)
        if not steered:
            return proposal
        base = base.clone()
        for depth, allowed in enumerate(steered):
            base[depth] -= STEER_PENALTY * (~allowed).to(base.dtype)
        return replace(proposal, base_logits=base)

    def prune(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes whose path the grammar forbids after the committed text: they could
        never be accepted, so they get no row of the forward (a ranked tree stays ranked)."""
        if not len(tree):
            return tree
        valid = [self.matcher.validate_tokens(list(path)) == len(path) for path in tree.node_paths()]
        if all(valid):
            return tree
        keep = torch.tensor([i for i, ok in enumerate(valid) if ok], dtype=torch.long, device=tree.tokens.device)
        return tree.restricted(keep)  # valid paths are closed under prefixes

    def shape(self, tree: DraftTree, force: bool = True, beta: float = 0.0) -> DraftTree:
        """The round's tree under the grammar: pruned (``prune``), and where the grammar allows exactly
        one continuation of the committed text (a key, a quote, a brace), that forced run enters at
        probability 1: merged into a ranked tree (best first, so no budget cut drops it), or as the
        tree of a round that proposed nothing. A tree without scores (a drafter's chain) is only pruned,
        and so is every tree with ``force`` off. ``beta``: the method's depth bonus, with which the merged
        tree is ranked as its builder ranked it."""
        tree = self.prune(tree)
        forced = self.forced() if force else []
        if not forced or (len(tree) and tree.log_probs is None):
            return tree
        chain = DraftTree.chain(torch.tensor(forced, dtype=torch.long, device=tree.tokens.device))
        chain.log_probs = torch.zeros(len(chain), dtype=torch.float64, device=tree.tokens.device)
        chain.rank = torch.arange(len(chain), device=tree.tokens.device)
        return merge_ranked([chain, tree] if len(tree) else [chain], len(tree) + len(chain), beta)

    def advance(self, tokens: list[int]) -> list[int]:
        """Committed tokens (each was allowed when chosen), up to where the structure is complete: the
        ones a round verified past that point are dropped, as ``ar`` would never have written them."""
        self._forced = None
        self._after.clear()
        for i, token in enumerate(tokens):
            if self.done:
                return tokens[:i]
            if not self.matcher.consume_token(token):
                raise DartreeError(f"structured output: the grammar refused a committed token ({self.matcher.get_error()})")
        return tokens

    @property
    def done(self) -> bool:
        """The structure is complete and nothing may follow it (only the end of the text)."""
        return self.matcher.is_stopped()
