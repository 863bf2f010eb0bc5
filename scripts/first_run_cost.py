"""What the first use of the bundled model costs: the config folder the default target (the GGUF file as
stored) is built from, against the float32 checkpoint that ``weights="float32"`` needs, each made twice in a
fresh temporary cache (seconds, megabytes written).

    .venv/bin/python scripts/first_run_cost.py
"""

import tempfile
import time
from pathlib import Path

from dartree import default_model

for which in ("config", "float32", "config", "float32"):
    cache = Path(tempfile.mkdtemp())
    default_model.cache_root = lambda: cache  # noqa: E731 - this process's cache, for this measurement only
    t0 = time.perf_counter()
    out = default_model.default_target_config_dir() if which == "config" else default_model.default_target_dir(verbose=False)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"{which}: {time.perf_counter() - t0:.1f} s, {size:.1f} MB written", flush=True)
