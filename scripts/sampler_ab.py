"""The sampler of a git revision (``--base``: ``dartree/verify.py``'s ``Sampler`` there) against the working tree's, in
one process on the default model, taking turns: decode tokens per second at T > 0 and whether both wrote the same
tokens (same seeds), for ``ar`` and the default method.

    .venv/bin/python scripts/sampler_ab.py --base 4be3b07 [--temperature 0.7] [--top-p 0.9] [--top-k K] [--turns 2]
"""

import argparse
import importlib.util
import subprocess
import tempfile
from pathlib import Path

import dartree
import dartree.settings as settings_module
from dartree.hardware import describe_machine
from dartree.verify import Sampler

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
           "Give me three ideas for a birthday party."]


def base_sampler(revision: str):
    source = subprocess.run(["git", "show", f"{revision}:dartree/verify.py"], check=True, capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout
    source = source.replace("from .errors import", "from dartree.errors import").replace("from .trees import", "from dartree.trees import")
    path = Path(tempfile.mkdtemp(prefix="dartree-sampler-base-")) / "base_verify.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_verify", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose sampler is compared")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--turns", type=int, default=2)
    args = ap.parse_args()
    samplers = {"base": base_sampler(args.base), "this": Sampler}
    pipe = dartree.load()
    settings = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens, seed=1)
    print(f"{describe_machine()}; target {pipe.target.name}; {settings}; base = {args.base}")
    for method in ("ar", "dartree"):
        pipe.generate(PROMPTS[0], method=method, **settings)  # warm-up
        speed, texts = {name: [] for name in samplers}, {name: [] for name in samplers}
        try:
            for _ in range(args.turns):
                for name, cls in samplers.items():
                    settings_module.Sampler = cls  # what GenerationSettings.sampler builds
                    tokens = seconds = 0
                    for prompt in PROMPTS:
                        res = pipe.generate(prompt, method=method, **settings)
                        tokens, seconds = tokens + res.stats.new_tokens, seconds + res.stats.decode_seconds
                        texts[name].append(res.token_ids)
                    speed[name].append(round(tokens / seconds, 1))
        finally:
            settings_module.Sampler = Sampler
        print(f"{method}: base {speed['base']} tok/s, this {speed['this']} tok/s; "
              f"the same tokens: {texts['base'] == texts['this']}", flush=True)


if __name__ == "__main__":
    main()
