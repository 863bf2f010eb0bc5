"""One settings object for a generation: the method, its tree settings and the sampling settings.

It travels from the command line or the Python API through ``Pipeline.generate``, the benchmark
and the records, and it is validated before any model is loaded. Defaults live here and in
``TreeSettings`` only; every parser and signature derives them from these classes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from .errors import DartreeError
from .trees import BUILDERS, TreeBuilder, TreeSettings, builder_class
from .verify import Sampler

DEFAULT_METHOD = "dartree"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationSettings:
    method: str = DEFAULT_METHOD
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = 0
    sampling_top_k: int | None = None  # top-k of the target's distribution (temperature > 0)
    top_p: float | None = None  # nucleus of the target's distribution (temperature > 0)
    tree: TreeSettings = field(default_factory=TreeSettings)

    @classmethod
    def from_kwargs(cls, base: "GenerationSettings | None" = None, **kwargs) -> "GenerationSettings":
        """``base`` (default: the defaults) with any of its own fields or the tree's fields replaced;
        None values keep the base's. Unknown names are an error."""
        base = base or cls()
        own = {f.name for f in fields(cls)} - {"tree"}
        tree_names = set(TreeSettings.__dataclass_fields__)
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
        Sampler.check(self.temperature, self.sampling_top_k, self.top_p)
        self.tree.validate()
        return self

    def builder(self) -> TreeBuilder:
        return BUILDERS[self.method](self.tree)

    def sampler(self, device="cpu") -> Sampler:
        return Sampler(self.temperature, self.sampling_top_k, self.top_p, self.seed, device=device)

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
