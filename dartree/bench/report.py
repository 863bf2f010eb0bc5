"""Metrics and the markdown + PNG report, rebuilt from the JSONL records alone."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import ROUND_STAGES
from ..errors import DartreeError
from ..trees import METHODS
from .llama_cpp import LLAMA_PEERS
from .runner import PEERS, RunConfig, read_records


@dataclass
class Summary:
    dataset: str
    config: RunConfig
    samples: int = 0
    tau_macro: float = 0.0  # mean over samples of each sample's mean acceptance length
    tau_micro: float = 0.0  # committed tokens / rounds over all samples
    tokens_per_second: float = 0.0  # total new tokens / total decode time
    speedup_vs_ar: float | None = None
    speedup_vs_hf: float | None = None
    speedup_vs_llama: float | None = None  # against llama.cpp on the same fp32 weights (the llama.cpp-f32 peer)
    new_tokens: int = 0
    decode_seconds: float = 0.0
    same_as_ar: int | None = None  # a peer: samples whose tokens equal ar's (T = 0; measured, not promised)
    speedup_vs_ar_float32: float | None = None  # a 16-bit configuration against float32 ar (the exact CPU default)
    modeled_speedup: float | None = None  # replay with a cost model: new tokens per modeled ms over ar's (one per step)
    matches_ar_float32: int = 0  # samples whose tokens equal float32 ar's (T = 0, other dtypes)
    stage_ms_per_round: dict = field(default_factory=dict)
    histogram: dict = field(default_factory=dict)
    mismatches: int = 0

    key = property(lambda self: self.config.key)
    method = property(lambda self: self.config.method)
    temperature = property(lambda self: self.config.temperature)
    budget = property(lambda self: self.config.budget)
    width = property(lambda self: self.config.width)
    beta = property(lambda self: self.config.beta)


def summarise(records: list[dict]) -> list[Summary]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["dataset"], r["key"])].append(r)
    out = []
    for (dataset, key), rs in groups.items():
        r0 = rs[0]
        s = Summary(dataset, RunConfig.from_record(r0))
        s.samples = len(rs)
        per_sample, tokens, rounds, decode, new = [], 0, 0, 0.0, 0
        stages, hist = Counter(), Counter()
        modeled_ms = modeled_ar_ms = 0.0
        for r in rs:
            acc = [a for t in r["turns"] for a in t["acceptance_lengths"]]
            if acc:
                per_sample.append(sum(acc) / len(acc))
            tokens += sum(acc)
            rounds += len(acc)
            hist.update(acc)
            for t in r["turns"]:
                decode += t["decode_seconds"]
                new += t["new_tokens"]
                if "modeled_ms" in t and "modeled_step_ms" in r:
                    modeled_ms += t["modeled_ms"]
                    modeled_ar_ms += t["new_tokens"] * r["modeled_step_ms"]  # ar: one token per one-row step
                for k, v in (t.get("stage_ms") or {}).items():
                    stages[k] += v
            s.mismatches += int(r.get("matches_ar") is False)
            if "same_as_ar" in r:
                s.same_as_ar = (s.same_as_ar or 0) + int(r["same_as_ar"])
            s.matches_ar_float32 += int(r.get("matches_ar_float32") is True)
        s.tau_macro = sum(per_sample) / len(per_sample) if per_sample else 0.0
        s.tau_micro = tokens / rounds if rounds else 0.0
        s.tokens_per_second = new / decode if decode > 0 else 0.0
        s.new_tokens, s.decode_seconds = new, decode
        s.modeled_speedup = modeled_ar_ms / modeled_ms if modeled_ms > 0 else None
        s.stage_ms_per_round = {k: stages[k] / rounds for k in ROUND_STAGES if rounds}
        s.histogram = dict(sorted(hist.items()))
        out.append(s)
    by = {(s.dataset, s.temperature, s.method, s.config.dtype): s for s in out if s.method in ("ar", "hf-generate", LLAMA_F32)}
    for s in out:
        ar = by.get((s.dataset, s.temperature, "ar", s.config.dtype))  # ar in the same dtype
        ar32 = by.get((s.dataset, s.temperature, "ar", "float32"))
        hf = by.get((s.dataset, 0.0, "hf-generate", "float32"))  # what a user would otherwise run
        if ar and ar.tokens_per_second:
            s.speedup_vs_ar = s.tokens_per_second / ar.tokens_per_second
        if s.config.dtype != "float32" and ar32 and ar32.tokens_per_second:
            s.speedup_vs_ar_float32 = s.tokens_per_second / ar32.tokens_per_second
        if hf and hf.tokens_per_second:
            s.speedup_vs_hf = s.tokens_per_second / hf.tokens_per_second
        llama = by.get((s.dataset, 0.0, LLAMA_F32, "float32"))
        if llama and llama.tokens_per_second:
            s.speedup_vs_llama = s.tokens_per_second / llama.tokens_per_second
    return out


def totals(summaries: list[Summary], temperature: float) -> list[tuple[str, float, float | None, float | None, float | None]]:
    """Per configuration at ``temperature``, over every dataset it ran: total new tokens over total
    decode time, that over ar's and over llama.cpp F32's totals (on the datasets both ran), and the
    mean of the per-dataset ratios to ar. Rows: (label, tokens/s, x ar, x llama.cpp F32, mean of
    per-dataset x ar)."""
    rows = [s for s in summaries if s.temperature == temperature and s.decode_seconds > 0]
    by_label: dict[str, list[Summary]] = defaultdict(list)
    for s in sorted(rows, key=_order):
        by_label[_label(s)].append(s)

    def rate(group: list[Summary], datasets: set[str]) -> float | None:
        chosen = [s for s in group if s.dataset in datasets]
        seconds = sum(s.decode_seconds for s in chosen)
        return sum(s.new_tokens for s in chosen) / seconds if seconds > 0 else None

    ar = next((g for label, g in by_label.items() if g[0].method == "ar" and g[0].config.dtype == "float32"), [])
    llama = next((g for g in by_label.values() if g[0].method == LLAMA_F32), [])
    out = []
    for label, group in by_label.items():
        datasets = {s.dataset for s in group}
        mine = rate(group, datasets)
        vs_ar = vs_llama = None
        if ar:
            shared = datasets & {s.dataset for s in ar}
            theirs = rate(ar, shared)
            vs_ar = rate(group, shared) / theirs if theirs else None
        if llama:
            shared = datasets & {s.dataset for s in llama}
            theirs = rate(llama, shared)
            vs_llama = rate(group, shared) / theirs if theirs else None
        ratios = [s.speedup_vs_ar for s in group if s.speedup_vs_ar]
        out.append((label, mine, vs_ar, vs_llama, sum(ratios) / len(ratios) if ratios else None))
    return out


LLAMA_F32 = LLAMA_PEERS[0]  # the peer every speed is also set against: llama.cpp on the same fp32 weights
METHOD_ORDER = ("ar", *PEERS, *(m for m in METHODS if m != "ar"))  # the registry's order, peers beside ar


def _label(s: Summary) -> str:
    return s.config.label


def _order(s: Summary) -> tuple:
    rank = METHOD_ORDER.index(s.method) if s.method in METHOD_ORDER else len(METHOD_ORDER)
    budget = 10**9 if s.budget == "auto" else (s.budget or 0)  # the per-round budget after the fixed ones
    return (rank, budget, s.width or 0, -(s.beta or 0.0))


def markdown(summaries: list[Summary], title: str = "dartree benchmark") -> str:
    lines = [f"# {title}", ""]
    datasets = sorted({s.dataset for s in summaries})
    for temp in sorted({s.temperature for s in summaries}):
        rows = [s for s in summaries if s.temperature == temp]
        keys = list(dict.fromkeys(_label(s) for s in sorted(rows, key=_order)))
        cell = {(s.dataset, _label(s)): s for s in rows}
        timed = any(s.speedup_vs_ar for s in rows)  # replay records carry no wall-clock time
        modeled = not timed and any(s.modeled_speedup for s in rows)
        lines += [f"## Temperature {temp:g}: τ (macro)" + (" / speedup over ar" if timed else "")
                  + (" / speedup over ar modeled on the cost model (a prediction, not a measurement)" if modeled else ""), "",
                  "| method | " + " | ".join(datasets) + " | mean |", "|---|" + "---:|" * (len(datasets) + 1)]
        for k in keys:
            vals, taus, sps = [], [], []
            for d in datasets:
                s = cell.get((d, k))
                if s is None:
                    vals.append("")
                    continue
                speed = s.speedup_vs_ar if timed else s.modeled_speedup
                sp = f"{speed:.2f}x" if speed else "n/a"
                tau = f"{s.tau_macro:.2f}" if s.tau_macro else "–"
                vals.append(f"{tau} / {sp}" if timed or modeled else tau)
                if s.tau_macro:
                    taus.append(s.tau_macro)
                if speed:
                    sps.append(speed)
            mean = f"{sum(taus) / len(taus):.2f}" if taus else "–"
            if timed or modeled:
                mean += " / " + (f"{sum(sps) / len(sps):.2f}x" if sps else "n/a")
            lines.append(f"| {k} | " + " | ".join(vals) + f" | {mean} |")
        if timed:
            lines += ["", f"### Totals at temperature {temp:g}: total new tokens over total decode time, all datasets", "",
                      "| method | tokens/s | x ar | x llama.cpp F32 | mean of per-dataset x ar |", "|---|---:|---:|---:|---:|"]
            g = lambda x, unit="x": f"{x:.2f}{unit}" if x else "n/a"  # noqa: E731
            for label, rate, vs_ar, vs_llama, mean_ratio in totals(summaries, temp):
                lines.append(f"| {label} | {rate:.1f} | {g(vs_ar)} | {g(vs_llama)} | {g(mean_ratio)} |")
        # A run that crosses dtypes also compares each 16-bit configuration with float32 ar: its speed
        # and how many samples reproduce float32 ar's tokens.
        crossed = any(s.config.dtype != "float32" for s in rows)
        extra = " vs fp32 ar | same tokens as fp32 ar |" if crossed else ""
        lines += ["", f"### Details at temperature {temp:g}", "",
                  "| dataset | method | samples | τ macro | τ micro | tokens/s | vs ar (same dtype) | vs HF generate | vs llama.cpp F32 | "
                  + "".join(f"{stage} ms/round | " for stage in ROUND_STAGES) + "T=0 mismatches |" + extra,
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(ROUND_STAGES) + 1) + ("---:|---:|" if crossed else "")]
        for s in sorted(rows, key=lambda s: (s.dataset, _order(s))):
            st = s.stage_ms_per_round
            f = lambda x: f"{x:.2f}x" if x else "n/a"  # noqa: E731
            tau = lambda x: f"{x:.2f}" if x else "–"  # noqa: E731  (peers such as HF generate have no rounds)
            # Replay records time only the tree build: every stage they did not measure is "–".
            stage = lambda k: f"{st[k]:.1f}" if k in st and (k == "tree" or s.tokens_per_second) else "–"  # noqa: E731
            lines.append(
                f"| {s.dataset} | {_label(s)} | {s.samples} | {tau(s.tau_macro)} | {tau(s.tau_micro)} | "
                f"{f'{s.tokens_per_second:.1f}' if s.tokens_per_second else '–'} | "
                f"{f(s.speedup_vs_ar)} | {f(s.speedup_vs_hf)} | {f(s.speedup_vs_llama)} | "
                + " | ".join(stage(k) for k in ROUND_STAGES)
                + (f" | {s.mismatches} |" if s.same_as_ar is None else f" | – ({s.same_as_ar}/{s.samples} same tokens as ar) |")
                + ((f" {f(s.speedup_vs_ar_float32)} | " + (f"{s.matches_ar_float32}/{s.samples} |" if s.config.dtype != "float32" else "– |"))
                   if crossed else "")
            )
        lines.append("")
    return "\n".join(lines)


def plots(summaries: list[Summary], out_dir: Path) -> list[Path]:
    """The report's PNG plots of the temperature-0 configurations (those there is data for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = [s for s in summaries if s.temperature == 0 and s.tau_macro]
    if not t0:
        return []
    methods = list(dict.fromkeys(s.method for s in sorted(t0, key=_order)))
    made = [_plot_tau_by_method(plt, t0, methods, out_dir)]
    # speedup against budget; tau against budget (the budget ablation)
    made.append(_plot_against_budget(plt, t0, methods, lambda s: s.speedup_vs_ar, (None, -0.2, 0.0), 1,
                                     "speedup over ar (mean over datasets)", "Speedup against budget (T=0)",
                                     out_dir / "speedup_vs_budget.png"))
    made.append(_plot_against_budget(plt, t0, methods, lambda s: s.tau_macro, (None, -0.2), 2, "τ (mean over datasets)",
                                     "Acceptance length against budget (T=0)", out_dir / "tau_vs_budget.png"))
    made.append(_plot_width_ablation(plt, t0, out_dir))
    made.append(_plot_beta_ablation(plt, t0, out_dir))
    made.append(_plot_latency_breakdown(plt, t0, out_dir))
    return [path for path in made if path is not None]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_tau_by_method(plt, t0: list[Summary], methods: list[str], out_dir: Path) -> Path:
    """τ by method and dataset (each method's best setting: the fastest; in replay records, with no
    timings, the longest acceptance)."""
    datasets = sorted({s.dataset for s in t0})
    best: dict[tuple, Summary] = {}
    for s in t0:
        k = (s.dataset, s.method)
        if k not in best or (s.speedup_vs_ar or 0, s.tau_macro) > (best[k].speedup_vs_ar or 0, best[k].tau_macro):
            best[k] = s
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) * len(datasets) / 2), 4))
    w = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = [j + i * w for j in range(len(datasets))]
        ax.bar(xs, [best[(d, m)].tau_macro if (d, m) in best else 0 for d in datasets], w, label=m)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(datasets))], datasets)
    ax.set_ylabel("τ (accepted + bonus per round)")
    ax.set_title("Acceptance length by method (T=0, best setting)")
    ax.margins(y=0.12)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: it never hides a bar
    return _save(plt, fig, out_dir / "tau_by_method.png")


def _plot_against_budget(plt, t0: list[Summary], methods: list[str], value, betas, min_points: int, ylabel: str,
                         title: str, path: Path) -> Path | None:
    """One line per method: mean ``value`` by budget (W = 12 and the given betas only); None where no
    method has ``min_points`` budgets with a value (replay records have no speedups)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        pts = defaultdict(list)
        for s in t0:
            v = value(s)
            if s.method == m and isinstance(s.budget, int) and v and s.width in (None, 12) and s.beta in betas:
                pts[s.budget].append(v)
        if len(pts) >= min_points:
            bs = sorted(pts)
            ax.plot(bs, [sum(pts[b]) / len(pts[b]) for b in bs], marker="o", label=m)
    if not ax.get_lines():
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget B")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _plot_width_ablation(plt, t0: list[Summary], out_dir: Path) -> Path | None:
    """dartree's τ by width W (None with fewer than two widths)."""
    widths = defaultdict(list)
    for s in t0:
        if s.method == "dartree" and s.width is not None:
            widths[s.width].append(s.tau_macro)
    if len(widths) <= 1:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ws = sorted(widths)
    ax.plot(ws, [sum(widths[x]) / len(widths[x]) for x in ws], marker="o")
    ax.set_xlabel("width W")
    ax.set_ylabel("τ (mean over datasets and budgets)")
    ax.set_title("dartree width ablation (T=0)")
    return _save(plt, fig, out_dir / "width_ablation.png")


def _plot_beta_ablation(plt, t0: list[Summary], out_dir: Path) -> Path | None:
    """dartree's and heap's τ by depth bonus β at W = 12 (None with fewer than two betas)."""
    betas = defaultdict(list)
    for s in t0:
        if s.method in ("dartree", "heap") and s.beta is not None and s.width in (None, 12):
            betas[(s.method, s.beta)].append(s.tau_macro)
    if len({b for _, b in betas}) <= 1:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in ("dartree", "heap"):
        bs = sorted(b for mm, b in betas if mm == m)
        if bs:
            ax.plot(bs, [sum(betas[(m, b)]) / len(betas[(m, b)]) for b in bs], marker="o", label=m)
    ax.set_xlabel("depth bonus β")
    ax.set_ylabel("τ (mean over datasets and budgets)")
    ax.set_title("β ablation (T=0)")
    ax.legend(fontsize=7)
    return _save(plt, fig, out_dir / "beta_ablation.png")


def _plot_latency_breakdown(plt, t0: list[Summary], out_dir: Path) -> Path | None:
    """Milliseconds per round by stage and configuration (replay records: the tree build alone)."""
    rows = [s for s in t0 if any(s.stage_ms_per_round.values()) and s.method not in ("hf-generate", "hf-prompt-lookup")]
    agg: dict[str, Counter] = defaultdict(Counter)
    cnt = Counter()
    for s in rows:
        agg[_label(s)].update(s.stage_ms_per_round)
        cnt[_label(s)] += 1
    if not agg:
        return None
    labels = list(agg)
    replay_only = not any(s.tokens_per_second for s in rows)  # replay times the tree build alone
    stages = ("tree",) if replay_only else ROUND_STAGES
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    for stage in stages:
        vals = [agg[k][stage] / cnt[k] for k in labels]
        ax.bar(labels, vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per round")
    ax.set_title("Tree-build time per round (T=0, exact replay: no target forwards)" if replay_only
                 else "Latency breakdown per round (T=0)")
    ax.tick_params(axis="x", rotation=70, labelsize=7)
    ax.margins(y=0.08)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(plt, fig, out_dir / "latency_breakdown.png")


def complete_prompts(records: list[dict]) -> set[tuple[str, str]]:
    """The (dataset, sample_id) on which every configuration of the run has a record."""
    keys = {r["key"] for r in records}
    by_prompt = defaultdict(set)
    for r in records:
        by_prompt[(r["dataset"], r["sample_id"])].add(r["key"])
    return {p for p, ks in by_prompt.items() if ks == keys}


def _cost_model_label(record: dict) -> str:
    ident = record.get("cost_model") or {}
    return (f"{ident.get('dtype', '?')}, {ident.get('threads', '?')} thread(s), {ident.get('machine', '?')}, "
            f"one-row step {record['modeled_step_ms']:.1f} ms")


def build_report(run_dir: str | Path, title: str = "dartree benchmark", preamble: str = "") -> Path:
    run_dir = Path(run_dir)
    records = read_records(run_dir / "records.jsonl")
    if not records:
        raise DartreeError(f"no benchmark records in {run_dir / 'records.jsonl'}; run `dartree bench --out {run_dir}` first")
    # A stopped run has prompts only some configurations finished: leave them out, so every
    # configuration is averaged (and compared with ar) over the same prompts.
    complete = complete_prompts(records)
    unfinished = {(r["dataset"], r["sample_id"]) for r in records} - complete
    records = [r for r in records if (r["dataset"], r["sample_id"]) in complete]
    if unfinished:
        preamble = (f"The run is unfinished: {len(unfinished)} prompt(s) that not every configuration has reached "
                    f"are left out; the tables cover the {len(complete)} prompts every configuration finished.\n\n" + preamble)
    if not records:
        raise DartreeError(f"no prompt in {run_dir / 'records.jsonl'} is finished by every configuration yet")
    summaries = summarise(records)
    images = plots(summaries, run_dir)
    text = markdown(summaries, title)
    if any(r.get("replay") for r in records):
        preamble = (
            "τ here comes from exact replay (`dartree bench --replay`): one greedy run and one teacher-forced "
            "target forward per prompt, then every configuration's rounds on the drafter and tree builder alone. "
            "It equals the decoder's acceptance lengths (tested); there are no wall-clock numbers except the "
            "tree-build time, measured on identical drafts for every configuration.\n\n"
            + ("Speedups here are modeled, not measured: every round costs the cost model's drafter call + tree "
               "build + a target forward over the tree's rows (a plain step one row), against ar's one-row step "
               "per token; budget 'auto' ran its policy on the replayed trees. The cost model: "
               + ", ".join(sorted({_cost_model_label(r) for r in records if "modeled_step_ms" in r})) + ".\n\n"
               if any("modeled_step_ms" in r for r in records) else "")
            + preamble
        )
    if preamble:
        text = text.replace("\n\n", "\n\n" + preamble.strip() + "\n\n", 1)
    text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in images) + "\n"
    (run_dir / "report.md").write_text(text)
    return run_dir / "report.md"
