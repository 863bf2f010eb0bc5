"""Public API: ``dartree.load(...)`` and ``Pipeline.generate(...)``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .budget import BudgetPolicy
from .calibration import load_or_measure
from .costmodel import CostModel, MeasuredCostModel
from . import kernels, quant
from .default_model import check_gguf_file, default_drafter_dir, gguf_checkpoint_dir, gguf_config_dir, gguf_path, is_gguf_file
from .drafter import DrafterModel
from .engine import Engine, GenerationStats, Request, run_alone
from .errors import DartreeError, require
from .hardware import release_freed_memory, set_threads
from .lean_drafter import release_float_weights
from .loading import check_pair, cpu_products, load_drafter, load_target, load_tokenizer, parse_dtype, resolve_device
from .prompts import chat_token_ids
from .settings import DEFAULT_METHOD, DRAFTER_FREE_METHOD, HEADLESS_DRAFTER_METHOD, GenerationSettings
from .proposers import Proposer, make_proposer
from .proposers.suffix_cache import SuffixCache
from .structured import Constraint, Grammars, OutputFormat
from .trees.grow_kernel import head_tables
from .targets import WEIGHTS, check_context_length, make_target
from .targets.quantized import GGUFTensors, file_target_reason, model_from_gguf
from .trees import available_methods


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


class Pipeline:
    """A target, an optional drafter (with its correction head) and a tokenizer, ready to generate.

    ``target_model`` is the Hugging Face model; ``target`` what every round drives (``targets.make_target``:
    its lean forward, or the Hugging Face one); ``proposer`` runs the drafter for a request alone
    (``generate``), ``head`` (the drafter's) corrects its drafts.

    ``cost_model``: what budget "auto" weighs each round with. "auto" (default): this machine's,
    measured from the target, drafter and head once and cached (``calibration.load_or_measure``;
    a few seconds the first time), here, so that no ``generate`` call ever starts a calibration;
    a ``CostModel`` (e.g. another machine's, ``CostModel.from_json``) to use that one; None for none
    (budget "auto" is then refused until ``calibrate`` or ``use_cost_model``).

    ``lean_products``: "exact" (default; the row-invariant kernels every exactness claim rests on) or
    "bfloat16" (bf16 weight products on the lean forward, for work that need not be exact: the
    drafter's training data; see ``lean.PRODUCTS``)."""

    def __init__(self, target_model, drafter: DrafterModel | None = None, tokenizer=None, lean: bool | str = "auto",
                 cost_model: CostModel | str | None = "auto", lean_products: str = "exact", weights: str = "float32",
                 gguf=None):
        self.target_model = target_model
        self.drafter = drafter
        self.tokenizer = tokenizer
        if drafter is not None:
            check_pair(target_model, drafter)
        self.target = make_target(target_model, drafter.config.target_layer_ids if drafter else (), lean, lean_products,
                                  weights, gguf)
        self.proposer = None
        self.head = None
        self._cost_model: CostModel | None = None
        self._policies: dict[tuple, BudgetPolicy] = {}
        self._proposal_depths: dict[str, int] = {}
        self.suffix_cache: SuffixCache | None = None  # earlier answers for the n-gram proposer (use_suffix_cache)
        self._grammars: Grammars | None = None  # structured output's compiled formats (made on first use)
        if drafter is not None:
            self.head = drafter.head
            if self.head is not None:
                self.head.bind(self.target.embed_tokens, drafter.d2t)
                head_tables(self.head)  # the compiled tree grower's tables, made at load, not in the first round
            self.proposer = make_proposer("drafter", self)
        # "auto": measured (or read from the cache) now with a drafter; without one (the forwards
        # alone, for budget auto of drafter-free methods) when a request first needs it
        self._calibrate_on_use = cost_model == "auto" and drafter is None
        if cost_model == "auto":
            if drafter is not None:
                self.calibrate()
        elif cost_model is not None:
            require(isinstance(cost_model, CostModel), f"cost_model must be 'auto', a CostModel or None, got {cost_model!r}")
            self.use_cost_model(cost_model)

    def use_suffix_cache(self, megabytes: float | None) -> "SuffixCache | None":
        """Share earlier answers with the n-gram proposer of every later request (``ngram``, ``ngram-chain``
        and ``dartree`` with ``ngram`` on): a cache of about ``megabytes`` MB, least recently used out;
        None or 0 turns it off. The output is unchanged (lossless); the acceptance, and so a request's
        speed, then depends on what earlier requests answered."""
        self.suffix_cache = SuffixCache(megabytes) if megabytes else None
        return self.suffix_cache

    def check_request(self, ids: torch.Tensor, settings: GenerationSettings) -> None:
        """The checks a validated ``settings`` still needs against this pipeline: the method is
        available here, and prompt + max_new_tokens + one draft block fit the target's context."""
        require(
            settings.method in self.methods,
            f"method {settings.method!r} needs a drafter{' with a correction head' if self.drafter else ''}; "
            f"this pipeline supports: {', '.join(self.methods)}",
        )
        block = self.drafter.config.block_size if self.drafter is not None else 1
        check_context_length(self.target_model.config, ids.numel(), settings.max_new_tokens, block)

    def calibrate(self, remeasure: bool = False, progress: bool = True) -> CostModel:
        """This machine's cost model of this pipeline's target, drafter and head, read from the cache
        or measured (``remeasure``: measured again), and used from now on."""
        return self.use_cost_model(load_or_measure(self.target, self.proposer, self.head, remeasure=remeasure, progress=progress))

    def use_cost_model(self, cost: CostModel) -> CostModel:
        """Weigh budget "auto" with ``cost`` from now on (the policies start afresh on it)."""
        self._cost_model = cost
        self._policies.clear()
        return cost

    def cost_model(self) -> CostModel:
        """The cost model budget "auto" uses (see ``cost_model=`` of the constructor)."""
        if self._cost_model is None and self._calibrate_on_use:
            self._calibrate_on_use = False
            self.calibrate()
        require(self._cost_model is not None,
                "budget 'auto' needs a cost model: this pipeline was made with cost_model=None; call pipe.calibrate() "
                "(this machine's, measured once and cached) or pipe.use_cost_model(CostModel.from_json(...))")
        return self._cost_model

    def budget_policy(self, settings: GenerationSettings) -> BudgetPolicy:
        """The per-round budget policy of one method and its settings; its acceptance calibration
        carries over from one generate call to the next."""
        key = (settings.method, settings.tree, settings.temperature > 0)
        if key not in self._policies:
            proposer = settings.builder().proposer
            self._policies[key] = BudgetPolicy(self.cost_model().for_proposer(proposer), max_depth=self.proposal_depth(proposer))
        return self._policies[key]

    def proposal_depth(self, proposer: str) -> int:
        """How deep the proposals of proposer ``proposer`` (a registered name) reach: the budget policy's depth."""
        if proposer not in self._proposal_depths:  # a proposer made once to read it (its depth is fixed at load)
            self._proposal_depths[proposer] = self.proposer.num_depths if proposer == "drafter" else \
                make_proposer(proposer, self).num_depths
        return self._proposal_depths[proposer]

    def constraint(self, response_format) -> Constraint | None:
        """The grammar state of a new request of ``response_format`` (``structured.OutputFormat.parse``:
        a JSON schema dict or Pydantic model class, OpenAI's ``response_format``, vLLM's
        ``{"regex": ...}`` / ``{"choice": [...]}`` / ``{"grammar": ...}``), or None for none. An invalid
        format is a ``DartreeError`` that names the problem, before any decoding."""
        if isinstance(response_format, Constraint):  # compiled already (the server compiles as a request arrives)
            return response_format
        fmt = OutputFormat.parse(response_format)
        if fmt is None:
            return None
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.target_model.config.vocab_size)
        return Constraint(self._grammars.compile(fmt), self._grammars.vocab_size)

    def request(self, ids: torch.Tensor, settings: GenerationSettings, stop_token_ids: list[int] | None = None,
                on_tokens=None, cancelled=None, alone: bool = True, response_format=None) -> Request:
        """A request of ``settings`` (validated, and checked with ``check_request``) for the round.

        ``alone``: the request runs by itself (``generate``), so it uses the pipeline's drafter
        cache and budget policy; else (the batched engine) it gets its own drafter cache and its own
        copy of the policy, whose acceptance calibration starts from the pipeline's. ``response_format``:
        structured output (``constraint``)."""
        constraint = self.constraint(response_format)
        builder = settings.builder()
        policy = None
        if builder.cut_per_round:
            policy = self.budget_policy(settings)
            if not alone:
                policy = policy.fork()
        proposer: Proposer | None = None
        if builder.proposer is not None:
            shared = self.proposer if builder.proposer == "drafter" else None
            proposer = shared if alone and shared is not None else make_proposer(builder.proposer, self)
        stop = set(stop_token_ids) if stop_token_ids is not None else self.default_stop_ids()
        return Request(ids, builder, settings.sampler(self.device), settings.max_new_tokens, stop, policy=policy,
                       proposer=proposer, on_tokens=on_tokens, cancelled=cancelled, constraint=constraint)

    def engine(self, max_batch: int, measured_costs: bool = False) -> Engine:
        """A batched engine over this pipeline's target: up to ``max_batch`` requests per round
        (the Hugging Face forward holds one; the lean forward any number). ``measured_costs``: budget
        "auto" weighs the cost model scaled by what the engine's rounds measure
        (``costmodel.MeasuredCostModel``; the server's choice), not the calibration alone."""
        base = self.cost_model() if measured_costs and self._calibrate_on_use else self._cost_model
        costs = MeasuredCostModel.following(base) if measured_costs and base is not None else None
        return Engine(self.target, max_batch, costs=costs)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def default_method(self) -> str:
        """The method a generation runs when none is named: ``dartree`` with a drafter and its head, DDTree with a
        drafter alone, else the speculative method that needs no drafter (``settings.DRAFTER_FREE_METHOD``)."""
        for method in (DEFAULT_METHOD, HEADLESS_DRAFTER_METHOD):
            if method in self.methods:
                return method
        return DRAFTER_FREE_METHOD

    @property
    def methods(self) -> tuple[str, ...]:
        return available_methods(self.drafter is not None, self.head is not None)

    # ------------------------------------------------------------- inputs
    def encode(self, prompt=None, messages=None, input_ids=None) -> torch.Tensor:
        given = [x is not None for x in (prompt, messages, input_ids)]
        require(sum(given) == 1, "pass exactly one of prompt=, messages= or input_ids=")
        if input_ids is not None:
            ids = list(input_ids.flatten().tolist()) if isinstance(input_ids, torch.Tensor) else list(input_ids)
            require(len(ids) > 0, "input_ids is empty; give at least one token")
            vocab = self.target_model.get_input_embeddings().num_embeddings
            require(
                all(isinstance(t, int) and 0 <= t < vocab for t in ids),
                f"input_ids must be integers in [0, {vocab}) for this target",
            )
        else:
            require(self.tokenizer is not None, "this target has no tokenizer; pass input_ids= instead of text")
            if prompt is not None:
                require(isinstance(prompt, str) and prompt.strip() != "", "the prompt is empty; give some text")
                messages = [{"role": "user", "content": prompt}] if self.tokenizer.chat_template else None
                if messages is None:
                    ids = self.tokenizer(prompt)["input_ids"]
            if messages is not None:
                require(
                    isinstance(messages, list) and len(messages) > 0 and all(isinstance(m, dict) and "content" in m for m in messages),
                    "messages must be a non-empty list of {'role': ..., 'content': ...} dicts",
                )
                require(any(str(m["content"]).strip() for m in messages), "the messages are empty; give some text")
                ids = chat_token_ids(self.tokenizer, messages)
            require(len(ids) > 0, "the prompt encodes to no tokens")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def default_stop_ids(self) -> set[int]:
        stop = set()
        for source in (getattr(self.target_model, "generation_config", None), self.target_model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is None:
                continue
            stop.update([eos] if isinstance(eos, int) else list(eos))
        return stop

    # ------------------------------------------------------------- generate
    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        input_ids=None,
        settings: GenerationSettings | None = None,
        method: str | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        budget: int | None = None,
        width: int | None = None,
        tree_top_k: int | None = None,
        beta: float | None = None,
        max_budget: int | None = None,
        ngram: bool | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_token_ids: list[int] | None = None,
        streamer=None,
        response_format=None,
        **retired,
    ) -> GenerationResult:
        """Generate with one method.

        ``settings`` (a ``GenerationSettings``, default: the defaults) holds the method, tree and
        sampling settings; any keyword given here replaces its field (None keeps it). ``tree_top_k`` is
        DARTree's K (candidates per depth); ``ngram`` merges the n-gram proposer's tree into ``dartree``'s;
        ``top_k`` / ``top_p`` restrict sampling of the target's
        distribution (temperature > 0 only), as in Hugging Face. ``top_k`` was DARTree's K before it
        became ``tree_top_k``; a retired spelling (``sampling_top_k=``) or any other unknown keyword is
        a ``DartreeError`` that names the setting to use.

        ``streamer``: a Hugging Face-style streamer (``put(tensor)``, ``end()``), e.g.
        ``transformers.TextStreamer(pipe.tokenizer, skip_prompt=True)``. As in HF ``generate`` it gets
        the prompt first, then each round's verified tokens as soon as the round ends.

        ``response_format``: structured output, every method exact under it: a JSON schema (a dict, or a
        Pydantic model class), ``{"type": "json_object"}``, OpenAI's ``{"type": "json_schema",
        "json_schema": {"schema": ...}}``, or ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar":
        LARK_OR_GBNF}``. The target's distribution at every position is the one the grammar allows;
        a structure cut by ``max_new_tokens`` ends with finish reason ``length``."""
        if settings is None and method is None:  # a pipeline without a drafter runs the method that needs none
            method = self.default_method
        settings = GenerationSettings.from_kwargs(
            settings, method=method, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, budget=budget,
            width=width, tree_top_k=tree_top_k, beta=beta, max_budget=max_budget, ngram=ngram, top_k=top_k, top_p=top_p,
            **retired,
        ).validate()
        ids = self.encode(prompt, messages, input_ids)
        self.check_request(ids, settings)
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        on_tokens = None
        if streamer is not None:
            require(callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None)),
                    "streamer must have put(tensor) and end() methods, like transformers.TextStreamer")
            streamer.put(ids[None].cpu())
            on_tokens = lambda new: streamer.put(torch.tensor(new))  # noqa: E731
        request = run_alone(self.target, self.request(ids, settings, stop_token_ids, on_tokens, response_format=response_format))
        tokens, stats = request.output, request.stats
        if streamer is not None:
            streamer.end()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(token_ids=tokens, text=text, stats=stats)


def load(target: str | Path | None = None, drafter: str | Path | None = None, dtype="auto", device="cpu",
         threads: int | None = None, lean: bool | str = "auto", cost_model: CostModel | str | None = "auto",
         weights: str = "auto", keep_drafter_weights: bool = False) -> Pipeline:
    """Load a target (any HF causal LM directory, or a GGUF file) and a DFlash-format drafter.

    With no arguments: the bundled default model (SmolLM2-135M-Instruct) with the drafter shipped
    in this repository, fully offline. ``target`` a ``.gguf`` file: that file as the bundled one is run
    (its config and tokenizer read once from its own fields into the cache), with no drafter unless
    ``drafter`` names one trained for it (``ar`` and the n-gram methods need none). ``threads``: CPU threads for torch; it sets torch's
    process-wide thread count (default: the count chosen earlier in the process, e.g. by the command
    line's --threads, else $OMP_NUM_THREADS, else the physical cores; ``hardware.set_threads``). ``dtype="auto"``: float32 on a CPU (exact),
    bfloat16 on a GPU. ``lean``: run the target on the lean forward (``lean.py``: Llama/Qwen3 on a
    CPU in float32/float64, row-invariant, so every method is token-exact by construction); "auto"
    (default) wherever it can run, True to insist, False for the Hugging Face forward.
    ``cost_model``: as ``Pipeline``'s ("auto": this machine's, read from the cache or measured now,
    with a drafter only). ``weights``: "file" runs a GGUF target as stored (the bundled model's Q4_1
    blocks and Q8_0 output layer; a Llama or Qwen3 file of the types in ``quant.TYPES`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), mixed
    within a layer as llama.cpp's Q4_K_M mixes them) on integer
    products; "float32" its dequantised float32 weights (the reference); "q8_0" any float32 Llama/Qwen3
    target quantised to Q8_0 at load; "auto" (default): "file" for a GGUF target where the lean forward and
    its integer kernels run and the file's types are ones they take (else "float32", and a line says why).
    Every weights choice is exact in its own right: each method reproduces that target's greedy decoding.
    Where the drafter runs on the lean forward (a CPU, float32) its float32 Linear weights are dropped once
    their lean copies are made (``lean_drafter.release_float_weights``: 38 MB for the bundled drafter);
    ``keep_drafter_weights=True`` keeps them, for running its Hugging Face forward or changing its weights.
    """
    device = resolve_device(device)
    dtype = parse_dtype(dtype, device)
    set_threads(threads)
    require(weights in ("auto", *WEIGHTS), f"weights must be auto, {', '.join(WEIGHTS)}; got {weights!r}")
    gguf, model = None, None
    if target is None or is_gguf_file(target):  # the bundled GGUF file, or one the user brings
        bundled = target is None
        gguf = gguf_path() if bundled else check_gguf_file(Path(target))
        if bundled and drafter is None:
            drafter = default_drafter_dir()
        float32_cpu = torch.device(device).type == "cpu" and dtype == torch.float32
        source = GGUFTensors(gguf)  # the file's tensor index (a corrupt or truncated file fails here, before any long work)
        reason = file_target_reason(source)  # why it cannot run as stored (None: it can)
        if weights == "auto":  # the file as stored wherever the lean forward and its integer kernels run
            runs = float32_cpu and lean is not False and kernels.available() and quant.available()
            if runs and reason is not None:
                gb = 4 * source.parameter_count() / 1e9
                print(f"dartree: {gguf.name} runs dequantised to float32 (a {gb:.1f} GB checkpoint in the cache on first "
                      f"use): {reason}", file=sys.stderr)
            weights = "file" if runs and reason is None else "float32"
        if weights == "file":  # built straight from the file: no float32 checkpoint is made or read
            require(float32_cpu, f"weights='file' runs the GGUF file on the CPU with float32 activations; got dtype "
                                 f"{dtype} on {device}: use weights='float32' for another dtype or device")
            require(reason is None, f"{gguf.name} cannot run as stored: {reason}; load it with weights='float32'")
            target = gguf_config_dir(gguf)
            model, gguf = model_from_gguf(target, source), source
        else:
            require("rope_freqs.weight" not in source.tensors,
                    f"{gguf.name} scales its RoPE frequencies (a rope_freqs tensor, as Llama 3.1+ files do), which "
                    "transformers' GGUF reader drops: its float32 checkpoint would not be this model; run it as stored "
                    "(weights='file', on the CPU in float32)")
            target = gguf_checkpoint_dir(gguf)
    elif weights == "file":
        raise DartreeError("weights='file' runs a GGUF file as stored (the bundled model's, or a .gguf target); for a "
                           "Hugging Face checkpoint use weights='q8_0' (its float32 weights quantised at load) or 'float32'")
    if model is None:
        model = load_target(target, dtype, device)
    if weights == "auto":
        weights = "float32"
    draft_model = load_drafter(drafter, dtype=dtype, device=device) if drafter is not None else None
    if draft_model is not None:
        # fp32/fp64 CPU only; training loads drafters without it. The drafter's products are over a
        # draft block's few rows, where the lean kernels read the weights fastest.
        cpu_products(draft_model, lean=True)
    pipeline = Pipeline(model, draft_model, load_tokenizer(target), lean=lean, cost_model=cost_model, weights=weights,
                        gguf=gguf)
    if pipeline.proposer is not None and pipeline.proposer.lean is not None and not keep_drafter_weights:
        release_float_weights(draft_model, pipeline.proposer.lm_head)
    release_freed_memory()  # what loading made and dropped (raw blocks once packed, the drafter's file) back to the system
    return pipeline
