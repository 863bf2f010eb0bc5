"""One settings object for a generation: the method, its tree settings and the sampling settings.

It travels from the command line or the Python API through ``Pipeline.generate``, the benchmark
and the records, and it is validated before any model is loaded. Defaults live here and in
``TreeSettings`` only; every parser and signature derives them from these classes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from .errors import DartreeError
from .trees import BUILDERS, TreeBuilder, TreeSettings, builder_class
from .trees.base import check_retired, refuse_retired
from .verify import Sampler

DEFAULT_METHOD = "dartree"
# The default of a pipeline without a drafter (a target the user brings, no drafter trained for it): the
# speculative method that needs none; with a drafter but no correction head (a DFlash drafter): DDTree's tree
# (``Pipeline.default_method``)
DRAFTER_FREE_METHOD = "ngram"
HEADLESS_DRAFTER_METHOD = "ddtree"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _setting(default, help: str, flags: tuple[str, ...], request: str, parse, *, low=None, high=None, low_open=False,
             off: tuple = (), aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None, dartree_only=False):
    """One generation setting's declaration, as ``trees.base._setting`` declares a tree setting: its
    default, its help, its command-line flags, its field in a request body of ``dartree serve`` (with
    the range a request may give, request values that mean "off" as in vLLM's OpenAI server, other
    field names that take precedence, and whether the field is dartree's own rather than OpenAI's)
    and how to read it from text. The CLI arguments and the server's request fields derive from these."""
    expects = {int: "an integer", float: "a number", str: "a name"}[parse]
    return field(default=default, metadata={
        "help": help, "flags": flags, "request": request, "parse": parse, "expects": expects, "low": low, "high": high,
        "low_open": low_open, "off": off, "aliases": aliases, "choices": choices, "dartree_only": dartree_only})


@refuse_retired(sampling_top_k="top_k")
@dataclass(frozen=True)
class GenerationSettings:
    method: str = _setting(DEFAULT_METHOD, "decoding method", ("--method", "-m"), "method", str,
                           choices=tuple(BUILDERS), dartree_only=True)
    max_new_tokens: int = _setting(256, "most tokens to generate", ("--max-new-tokens", "-n"), "max_tokens", int, low=1,
                                   aliases=("max_completion_tokens",))
    temperature: float = _setting(0.0, "0 = greedy; > 0 samples from the target's distribution", ("--temperature", "-t"),
                                  "temperature", float, low=0, high=2)
    seed: int | None = _setting(0, "seed of the request's own sampler (temperature > 0)", ("--seed",), "seed", int)
    # top-k of the target's distribution, as in Hugging Face and vLLM (DARTree's K is the tree's "tree_top_k")
    top_k: int | None = _setting(None, "top-k sampling on the target (temperature > 0)", ("--top-k",), "top_k", int,
                                 low=-1, off=(-1, 0))
    top_p: float | None = _setting(None, "nucleus sampling on the target (temperature > 0)", ("--top-p",), "top_p", float,
                                   low=0, high=1, low_open=True, off=(1,))
    tree: TreeSettings = field(default_factory=TreeSettings)

    @classmethod
    def declarations(cls):
        """The generation settings' dataclass fields (the tree's own are ``TreeSettings.declarations``),
        each with its ``metadata``."""
        return tuple(f for f in fields(cls) if f.name != "tree")

    @classmethod
    def from_kwargs(cls, base: "GenerationSettings | None" = None, **kwargs) -> "GenerationSettings":
        """``base`` (default: the defaults) with any of its own fields or the tree's fields replaced;
        None values keep the base's. Unknown names are an error; a retired spelling (``sampling_top_k``)
        one that names the new spelling."""
        base = base or cls()
        own = {f.name for f in cls.declarations()}
        tree_names = set(TreeSettings.__dataclass_fields__)
        check_retired(cls.__name__, cls.retired, kwargs)
        unknown = set(kwargs) - own - tree_names
        if unknown:
            raise DartreeError(f"unknown generation setting(s) {', '.join(sorted(unknown))}; "
                               f"known: {', '.join(sorted(own | tree_names))}")
        top = {k: v for k, v in kwargs.items() if k in own and v is not None}
        tree = {k: v for k, v in kwargs.items() if k in tree_names and v is not None}
        return replace(base, tree=replace(base.tree, **tree), **top)

    def validate(self) -> "GenerationSettings":
        builder_class(self.method)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise DartreeError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise DartreeError(f"seed must be an integer or None, got {self.seed!r}")
        Sampler.check(self.temperature, self.top_k, self.top_p)
        self.tree.validate()
        return self

    def builder(self) -> TreeBuilder:
        return BUILDERS[self.method](self.tree)

    def sampler(self, device="cpu") -> Sampler:
        return Sampler(self.temperature, self.top_k, self.top_p, self.seed, device=device)

    def used_tree_settings(self) -> dict:
        """The tree settings this method actually reads (what a record needs to be reproduced)."""
        return {name: getattr(self.tree, name) for name in BUILDERS[self.method].settings_read(self.tree.budget)}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tree"] = asdict(self.tree)
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "GenerationSettings":
        raw = dict(raw)
        tree = TreeSettings(**raw.pop("tree", {}))
        return cls(tree=tree, **raw)
