"""Get a drafter training run onto a lent GPU machine and its drafter back (the `device` tool).

The device tool sends this checkout (tracked files, untracked files git does not ignore, and the
ignored paths a call names in `carry`), at most 64 MiB a call, and returns at most 8 files of at most
16 MiB each. This checkout's tracked files are far larger (the data shards, the shipped drafters and
the benchmark records: about 120 MiB), and the default model's GGUF (94 MiB) and the training
prompts are not in it at all. So:

    python scripts/device_kit.py pack      # .device-kit/call1 and call2 (git-ignored), each under the limit
    python scripts/device_kit.py hide      # the bulky tracked folders leave the index (files stay on disk)
    python scripts/device_kit.py size      # what a call would send now, with each call folder carried
    # device run 1: carry [".device-kit/call1"], command "bash scripts/device_train.sh stash"
    # device run 2 (at once: the machine stays warm for 30 s): carry [".device-kit/call2"],
    #               command "bash scripts/device_train.sh train"   (env MINUTES=..., LAYERS=..., see there)
    python scripts/device_kit.py restore   # the index as it was (always: before any commit)
    python scripts/device_kit.py unpack /work/.device/...   # the returned pieces -> runs/device-drafter

`hide` only removes the folders from git's index and lists them in .git/info/exclude between marker
lines; `restore` undoes both from HEAD. Never commit while hidden (the commit would delete them);
`status` says whether they are hidden. `python scripts/device_kit.py selftest` runs the whole path
here on the CPU, a few steps long, in a scratch copy of what a call would send.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / ".device-kit"
LIMIT = 64 * 2**20  # what one call may send
RETURN_PIECE = 15 * 2**20  # a returned file must stay under 16 MiB
# Tracked folders the training run does not need on the device (it trains from scratch and returns
# its drafter; the data shards travel compressed in call 1).
HIDDEN = ("data", "docs/results", "docs/training", "dartree/assets")
MARK_BEGIN, MARK_END = "# device_kit hide: begin", "# device_kit hide: end"
SHARED = ROOT.parent / "shared"


def git(*args: str, capture: bool = True) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, text=True,
                          capture_output=capture).stdout if capture else ""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def travelling_files(as_hidden: bool = False) -> list[Path]:
    """What a call sends before its carried paths: tracked files present on disk and untracked files
    git does not ignore; ``as_hidden``: as it will be once ``hide`` has run (HIDDEN left out)."""
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    skip = tuple(h + "/" for h in HIDDEN) if as_hidden else ()
    return [ROOT / n for n in names if n and not (skip and n.startswith(skip)) and (ROOT / n).is_file()]


def tree_bytes(as_hidden: bool = False) -> int:
    return sum(p.stat().st_size for p in travelling_files(as_hidden))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def is_hidden() -> bool:
    exclude = ROOT / ".git" / "info" / "exclude"
    return exclude.is_file() and MARK_BEGIN in exclude.read_text()


def add_tar(out: Path, members: list[tuple[Path, str]]) -> None:
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for path, name in members:
            tar.add(path, arcname=name)


def pack(args) -> int:
    from dartree.default_model import default_target_dir, gguf_path

    if KIT.exists():
        shutil.rmtree(KIT)
    call1, call2 = KIT / "call1", KIT / "call2"
    call1.mkdir(parents=True), call2.mkdir()
    gguf = gguf_path()
    size = gguf.stat().st_size
    half = size // 2
    with open(gguf, "rb") as f:
        (call1 / "gguf.part1").write_bytes(f.read(half))
        (call2 / "gguf.part2").write_bytes(f.read())
    print(f"GGUF {gguf.name}: {size / 2**20:.1f} MiB in two parts")
    data = [(d, f"data/{d.name}") for d in sorted((ROOT / "data").iterdir()) if d.is_dir()]
    add_tar(call1 / "data.tar.xz", data)
    shared = [(SHARED / "prompts", "shared/prompts"), (SHARED / "benchmarks", "shared/benchmarks")]
    missing = [str(p) for p, _ in shared if not p.is_dir()]
    if missing:
        raise SystemExit(f"missing: {', '.join(missing)}")
    add_tar(call2 / "shared.tar.xz", shared)
    # The tokenizer and config as converted here: the device's transformers may be another version,
    # so only the weights are converted there (and checked against these hashes).
    target = default_target_dir()
    tok = [(p, f"target/{p.name}") for p in sorted(target.iterdir()) if p.is_file() and p.suffix != ".safetensors"]
    add_tar(call2 / "target-files.tar.xz", tok)
    wheels = call2 / "wheels"
    wheels.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
                    "gguf==0.19.0"], check=True)
    manifest = {
        "gguf_name": gguf.name, "gguf_sha256": sha256(gguf),
        "weights_sha256": weights_digest(target),
        "data_shards": {d.name: len(list(d.glob("shard-*.safetensors"))) for d, _ in data},
        "head": git("rev-parse", "HEAD").strip(),
    }
    (call2 / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    tree = tree_bytes(as_hidden=True)
    for call in (call1, call2):
        total = folder_bytes(call) + tree
        print(f"{call.relative_to(ROOT)}: {folder_bytes(call) / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB (hidden) "
              f"= {total / 2**20:.1f} MiB of {LIMIT / 2**20:.0f}")
        if total > LIMIT:
            raise SystemExit(f"{call} would send more than 64 MiB")
    print("next: python scripts/device_kit.py hide, then the two device runs (see --help)")
    return 0


def weights_digest(target_dir: Path) -> str:
    """sha256 over the target's tensors in name order (name, dtype, shape, bytes): equal whatever
    the safetensors file's layout or metadata."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name).contiguous()
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def hide(args) -> int:
    if is_hidden():
        print("already hidden")
        return 0
    if git("diff", "--cached", "--name-only").strip():
        raise SystemExit("the index has staged changes; commit or unstage them first")
    for folder in HIDDEN:
        git("rm", "-r", "-q", "--cached", "--", folder)
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a") as f:
        f.write("\n".join([MARK_BEGIN, *(f"/{h}/" for h in HIDDEN), MARK_END]) + "\n")
    print(f"hidden from the index (files untouched): {', '.join(HIDDEN)}; the tree now sends {tree_bytes() / 2**20:.1f} MiB")
    print("run `python scripts/device_kit.py restore` before any commit")
    return 0


def restore(args) -> int:
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.is_file():
        lines, keep, inside = exclude.read_text().splitlines(), [], False
        for line in lines:
            if line == MARK_BEGIN:
                inside = True
            elif line == MARK_END:
                inside = False
            elif not inside:
                keep.append(line)
        exclude.write_text("\n".join(keep) + ("\n" if keep else ""))
    git("reset", "-q", "--", *HIDDEN)
    left = [line for line in git("status", "--porcelain", "--", *HIDDEN).splitlines() if line[:1] == "D"]
    if left:
        raise SystemExit(f"still staged as deleted: {left[:3]}")
    print(f"restored: {', '.join(HIDDEN)} are tracked again")
    return 0


def size(args) -> int:
    tree = tree_bytes()
    print(f"the tree sends {tree / 2**20:.1f} MiB ({'hidden' if is_hidden() else 'not hidden'})")
    for call in sorted(KIT.glob("call*")):
        total = tree + folder_bytes(call)
        print(f"  with {call.relative_to(ROOT)} carried: {total / 2**20:.1f} MiB {'ok' if total <= LIMIT else 'OVER 64 MiB'}")
    return 0


def status(args) -> int:
    print("hidden" if is_hidden() else "not hidden")
    return 0


def unpack(args) -> int:
    """Join the returned drafter pieces (model.safetensors.part-*) and check the recorded hash."""
    src, dest = Path(args.returned), Path(args.out)
    record = json.loads((src / "returned.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / "model.safetensors", "wb") as out:
        for piece in record["pieces"]:
            out.write((src / piece).read_bytes())
    if sha256(dest / "model.safetensors") != record["model_sha256"]:
        raise SystemExit("the joined model.safetensors does not match the hash recorded on the device")
    for name in record["files"]:
        shutil.copy(src / name, dest / name)
    print(f"{dest}: the drafter as trained on the device ({record.get('steps')} steps); replay it with "
          f"scripts/heldout_replay.py --drafter {dest}")
    return 0


def selftest(args) -> int:
    """The whole path on this CPU, a few steps: a scratch copy of what the two calls would send,
    device_train.sh stash then train (DEVICE=cpu), then unpack."""
    import tempfile

    if not (KIT / "call2" / "manifest.json").is_file():
        raise SystemExit("run `python scripts/device_kit.py pack` first")
    with tempfile.TemporaryDirectory(prefix="device-kit-selftest-") as scratch:
        scratch = Path(scratch)
        repo = scratch / "repo"
        for p in travelling_files(as_hidden=True):
            rel = str(p.relative_to(ROOT))
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, repo / rel)
        out, env = scratch / "out", dict(os.environ)
        env.update(KIT_STASH=str(scratch / "stash"), DEVICE="cpu", ANCHORS="16", LAYERS="1", VOCAB="4096",
                   OUT=str(out), PYTHON=str(ROOT / ".venv" / "bin" / "python"))
        # --calibrate: the schedule sized by timing steps, as on the device; one held-out sequence a
        # category keeps the evaluations (each run folder's first, on the CPU) to about a minute
        env.update(CALIBRATE="1", CAL_STEPS="8", MINUTES="2", EXTRA="--heldout-per-category 1") if args.calibrate else env.update(CALIBRATE="0", STEPS=str(args.steps))
        for call, verb in (("call1", "stash"), ("call2", "train")):
            shutil.rmtree(repo / ".device-kit", ignore_errors=True)
            shutil.copytree(KIT / call, repo / ".device-kit" / call)
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            subprocess.run(["bash", "scripts/device_train.sh", verb], cwd=repo, env=env, check=True)
        returned = sorted(p.name for p in out.iterdir())
        print("returned:", returned)
        if len(returned) > 8 or any(p.stat().st_size > 16 * 2**20 for p in out.iterdir()):
            raise SystemExit("the returned files break the tool's limits (8 files, 16 MiB each)")
        unpack(argparse.Namespace(returned=str(out), out=str(scratch / "drafter")))
        from dartree.loading import load_drafter

        drafter = load_drafter(scratch / "drafter")
        print(f"selftest ok: a {drafter.config.num_hidden_layers}-layer drafter with "
              f"{drafter.config.output_vocab_size} draft tokens came back and loads")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("pack", help="build .device-kit/call1 and call2").set_defaults(fn=pack)
    verbs.add_parser("hide", help="take the bulky tracked folders out of the index").set_defaults(fn=hide)
    verbs.add_parser("restore", help="put them back (before any commit)").set_defaults(fn=restore)
    verbs.add_parser("size", help="what a call would send now").set_defaults(fn=size)
    verbs.add_parser("status", help="hidden or not").set_defaults(fn=status)
    u = verbs.add_parser("unpack", help="join the drafter pieces a device run returned")
    u.add_argument("returned", help="the folder the run's files came back to (files_at)")
    u.add_argument("--out", default=str(ROOT / "runs" / "device-drafter"))
    u.set_defaults(fn=unpack)
    t = verbs.add_parser("selftest", help="the whole path here on the CPU, a few steps")
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--calibrate", action="store_true", help="size the run by timing steps first (as on the device)")
    t.set_defaults(fn=selftest)
    args = parser.parse_args()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
