"""A GGUF file a user brings, timed from a fresh cache: three fresh processes ``dartree.load(FILE)`` and a
64-token answer (the pipeline's default method: ``ngram``, no drafter), the first of which reads the file's config
and tokenizer into the cache. FILE is the bundled file hard-linked under another name; this machine's kernel
builds and cost model are copied into the fresh cache, so the first load times what a new file costs, not a
kernel build.

    .venv/bin/python scripts/gguf_target_load.py > docs/results/<folder>/gguf-target/load.txt
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dartree.default_model import gguf_path
from dartree.hardware import describe_machine

print(describe_machine())
tmp = Path(tempfile.mkdtemp())
copy = tmp / "My-Model.Q4_1.gguf"
os.link(gguf_path(), copy)
code = r'''
import time, sys, json
t0 = time.perf_counter()
import dartree
t1 = time.perf_counter()
p = dartree.load(sys.argv[1])
t2 = time.perf_counter()
r = p.generate("Name three rivers in Europe.", max_new_tokens=64)
rss = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")][0] / 1024
print(json.dumps({"import": round(t1 - t0, 2), "load": round(t2 - t1, 2), "method": p.default_method,
                  "tokens_per_second": round(r.stats.tokens_per_second, 1), "tau": round(r.stats.mean_acceptance, 2), "rss_mb": round(rss)}))
'''
env = dict(os.environ, DARTREE_CACHE=str(tmp / "cache"))
# the cost model of this machine, so that the first load measures only what a new file costs
[shutil.copytree(Path(".cache") / d, tmp / "cache" / d) for d in ("costmodel", "kernels", "quant_kernels", "forward_kernels", "tree_kernels")]
for run in ("first", "second", "third"):
    out = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, env=env)
    print(run, out.stdout.strip(), "|", " ".join(l for l in out.stderr.splitlines() if "first run" in l))
shutil.rmtree(tmp)
