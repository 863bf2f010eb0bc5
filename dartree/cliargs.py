"""Command-line pieces every subcommand shares: one-line errors, model and tree arguments, threads."""

from __future__ import annotations

import argparse

from .trees import BUILDERS, TreeSettings


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage mistake is one line on stderr (``dartree generate: error: ...``) and exit status 2,
    not the whole usage text; ``--help`` still prints everything. Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (any Hugging Face causal LM); default: bundled SmolLM2-135M-Instruct")
    p.add_argument("--drafter", help="drafter directory in the DFlash on-disk format; default: the drafter shipped with dartree")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: float32 on a CPU, exact; bfloat16 on a GPU), float32, bfloat16, float16 or float64")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto (a GPU when there is one)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: the physical cores; on a busy machine fewer is faster)")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """--budget/--width/--top-k/--beta, with the defaults and help of ``TreeSettings`` and the methods
    that read each one taken from the registry."""
    g = p.add_argument_group("tree settings")
    defaults = TreeSettings()
    flags = {"budget": ("--budget", "-B"), "width": ("--width", "-W"), "top_k": ("--top-k", "-K"), "beta": ("--beta",),
             "max_budget": ("--max-budget",)}
    types = {"budget": budget_value, "width": int, "top_k": int, "beta": float, "max_budget": int}
    for name, names in flags.items():
        readers = ", ".join(m for m, b in BUILDERS.items() if name in b.reads or (name == "max_budget" and b.ranked))
        default = getattr(defaults, name)
        g.add_argument(*names, dest=name, type=types[name], default=default,
                       help=f"{TreeSettings.HELP[name]} ({readers}; default {default})")


def budget_value(text: str) -> int | str:
    """--budget takes an integer or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def tree_settings(args) -> TreeSettings:
    """The validated TreeSettings of parsed --budget/--width/--top-k/--beta."""
    return TreeSettings(budget=args.budget, width=args.width, top_k=args.top_k, beta=args.beta,
                        max_budget=args.max_budget).validate()


