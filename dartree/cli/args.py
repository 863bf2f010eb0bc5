"""Command-line pieces every subcommand shares: one-line errors, model, generation and tree arguments, threads."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .. import quant
from ..errors import DartreeError
from ..settings import DRAFTER_FREE_METHOD, HEADLESS_DRAFTER_METHOD, GenerationSettings
from ..targets.quantized import FILE_ARCHITECTURES, WEIGHTS
from ..trees import BUILDERS, TreeSettings
from ..trees.base import RETIRED_NOTES


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage mistake is one line on stderr (``dartree generate: error: ...``) and exit status 2,
    not the whole usage text; ``--help`` still prints everything. Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser, dtype_and_device: bool = True) -> None:
    """--target and --drafter; and --dtype and --device, unless the command declares its own (the bench's dtype list)."""
    p.add_argument("--target", help="target model: a Hugging Face causal LM directory, or a GGUF file (run as stored where "
                                    f"it is a {' or '.join(FILE_ARCHITECTURES)} file of {'/'.join(quant.TYPES)} weights); default: bundled "
                                    "SmolLM2-135M-Instruct")
    p.add_argument("--drafter", help="drafter directory in the DFlash on-disk format; default: the drafter shipped with "
                                     "dartree for the bundled model, none for a --target (the n-gram methods need none)")
    p.add_argument("--weights", default="auto", choices=("auto", *WEIGHTS),
                   help="the target's weights: file (a GGUF target as stored, the bundled model's Q4_1 file included, on "
                        "integer products), float32 (its dequantised float32 weights), q8_0 (a float32 target quantised "
                        "at load); auto (default): file for a GGUF target where the integer kernels run and take its "
                        "types, else float32. "
                        "Each is exact: every method reproduces that target's greedy text")
    if not dtype_and_device:
        return
    p.add_argument("--dtype", default="auto",
                   help="auto (default: float32 on a CPU, exact; bfloat16 on a GPU), float32, bfloat16, float16 or float64")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto (a GPU when there is one)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: the physical cores; on a busy machine fewer is faster)")


def add_generation_args(p: argparse.ArgumentParser, names: tuple[str, ...] | None = None, defaults_of: str = "") -> None:
    """The generation settings' arguments (--method, --max-new-tokens, --temperature, ...), as
    ``GenerationSettings`` declares them; ``names``: only these; ``defaults_of``: what the values
    are the defaults of (the server's requests), for the help."""
    for setting in GenerationSettings.declarations():
        if names is not None and setting.name not in names:
            continue
        meta = setting.metadata
        choices = f", one of {', '.join(meta['choices'])}" if meta["choices"] else ""
        shown = 'off' if setting.default is None else setting.default
        default = setting.default
        if setting.name == "method":  # left unset: the loaded pipeline's default (``Pipeline.default_method``)
            default, shown = None, (f"{setting.default}; {HEADLESS_DRAFTER_METHOD} with a drafter that has no correction "
                                    f"head, {DRAFTER_FREE_METHOD} without a drafter")
        p.add_argument(*meta["flags"], dest=setting.name, type=_argument_type(setting), default=default,
                       choices=meta["choices"], metavar=setting.name.upper() if meta["choices"] else None,
                       help=f"{defaults_of}{meta['help']}{choices} (default {shown})")
    add_retired_flags(p, GenerationSettings, names=names)


def generation_settings(args) -> GenerationSettings:
    """The validated GenerationSettings of the parsed generation and tree arguments."""
    own = {s.name: getattr(args, s.name) for s in GenerationSettings.declarations() if hasattr(args, s.name)}
    if own.get("method", "") is None:  # not given: the default until the pipeline says its own (``with_pipeline_method``)
        del own["method"]
    return GenerationSettings(**own, tree=tree_settings(args)).validate()


def with_pipeline_method(settings: GenerationSettings, args, pipe) -> GenerationSettings:
    """``settings`` with the loaded pipeline's default method where --method was not given."""
    if getattr(args, "method", "") is None and settings.method != pipe.default_method:
        return replace(settings, method=pipe.default_method)
    return settings


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """The tree settings' arguments (--budget, --width, ...), as ``TreeSettings`` declares them, with
    the methods that read each one taken from the registry."""
    g = p.add_argument_group("tree settings")
    for setting in TreeSettings.declarations():
        name, meta = setting.name, setting.metadata
        readers = ", ".join(m for m, b in BUILDERS.items() if name in b.settings_read())
        g.add_argument(*meta["flags"], dest=name, type=_argument_type(setting), default=setting.default,
                       help=f"{meta['help']} ({readers}; default {_shown(setting.default)})")
    add_retired_flags(p, TreeSettings)


def retired_flag(name: str, suffix: str = "") -> str:
    """The command-line flag a retired setting name had (``sampling_top_k`` -> ``--sampling-top-k``)."""
    return "--" + name.replace("_", "-") + suffix


class _RetiredFlag(argparse.Action):
    """A flag that was renamed: giving it is a ``DartreeError`` that names the new flag (hidden from --help)."""

    def __init__(self, option_strings, dest, new: str = "", note: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.new, self.note = new, note

    def __call__(self, parser, namespace, values, option_string=None):
        error = DartreeError(f"{option_string} was renamed {self.new}{self.note}")
        error.prog = parser.prog  # the command, for its one-line message (``dartree generate: error: ...``)
        raise error


def add_retired_flags(p: argparse.ArgumentParser, declared, suffix: str = "", extra: dict[str, str] | None = None,
                      names: tuple[str, ...] | None = None) -> None:
    """The retired spellings of ``declared``'s settings (``declared.retired``: old name -> new name, e.g.
    ``GenerationSettings``' ``sampling_top_k`` -> ``top_k``) as flags that are an error naming the new flag:
    ``--sampling-top-k`` -> ``--top-k`` (``suffix``: the bench's list flags, ``--top-ks`` -> ``--tree-top-ks``;
    ``extra``: more old flag -> new name; ``names``: only the settings the command has). An old flag that names
    a setting of the command now (``--top-k`` is sampling top-k in ``dartree generate``, whose generation
    arguments are added before the tree's) is left to it."""
    flags = {retired_flag(old, suffix): new for old, new in declared.retired.items()} | (extra or {})
    for old_flag, new in flags.items():
        if names is not None and new not in names:
            continue
        old = next(old for old, n in declared.retired.items() if n == new)
        new_flag = declared.__dataclass_fields__[new].metadata["flags"][0] + suffix
        try:
            p.add_argument(old_flag, action=_RetiredFlag, dest=f"retired_{old_flag.lstrip('-')}", new=new_flag,
                           note=RETIRED_NOTES.get(old, ""))
        except argparse.ArgumentError:  # the flag belongs to a current setting of this command
            continue


def _shown(value) -> str:
    """A default as the command line writes it (a switch: on/off)."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _argument_type(setting):
    def read(text: str):
        try:
            return setting.metadata["parse"](text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {setting.metadata['expects']}, got {text!r}") from None
    read.__name__ = setting.name
    return read


def tree_settings(args) -> TreeSettings:
    """The validated TreeSettings of the parsed tree arguments."""
    return TreeSettings(**{s.name: getattr(args, s.name) for s in TreeSettings.declarations()}).validate()
