"""The engine thread: HTTP jobs become requests of the batched engine between rounds."""

import queue
import threading
from dataclasses import dataclass, field

import torch

from ..engine import FINISH_CANCELLED, FINISH_ERROR
from ..hardware import hand_over_threads
from ..pipeline import GenerationResult
from ..settings import GenerationSettings
from .protocol import RequestError


@dataclass
class Job:
    input_ids: list[int]
    settings: GenerationSettings
    stop: list[str]
    events: "queue.Queue[tuple[str, object]]" = field(default_factory=queue.Queue)  # ("tokens", list) | ("done", result) | ("error", msg)
    cancelled: threading.Event = field(default_factory=threading.Event)
    constraint: object | None = None  # structured output: the request's grammar state (structured.Constraint)


class EngineWorker:
    """The engine thread: jobs join the batched engine (``engine.Engine``) between rounds, up to
    ``max_batch`` at once, each round ONE target forward over all of them; the rest wait in a bounded
    queue (HTTP 429 beyond it). A job whose client went away (or whose stop string matched) is
    cancelled at the next round and its slot freed; a job that fails gets its own error and the
    others go on."""

    def __init__(self, pipe, max_queue: int = 16, max_batch: int = 1):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.pipe = pipe
        self.batch = pipe.engine(max_batch, measured_costs=True)  # the budget weighs what serving measures
        self.max_batch = self.batch.max_batch
        self.jobs: "queue.Queue[Job]" = queue.Queue(maxsize=max_queue)
        self.registry = CollectorRegistry()
        p = "dartree:"
        self.requests = Counter(p + "requests", "requests served to the end", ["status"], registry=self.registry)
        self.generated = Counter(p + "generation_tokens", "tokens generated", registry=self.registry)
        self.drafts = Counter(p + "spec_decode_num_drafts", "request rounds (a request's share of one target forward)", registry=self.registry)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "tree nodes verified", registry=self.registry)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "draft tokens accepted", registry=self.registry)
        self.accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by depth",
                                    ["position"], registry=self.registry)
        self.mean_acceptance = Gauge(p + "mean_acceptance_length", "committed tokens per round (tau), all requests",
                                     registry=self.registry)
        self.queue_length = Gauge(p + "num_requests_waiting", "requests waiting in the queue", registry=self.registry)
        self.running = Gauge(p + "num_requests_running", "requests in the running batch", registry=self.registry)
        self.cost_scale = Gauge(p + "cost_model_scale", "measured time over the calibration's, per round stage (budget auto weighs it)",
                                ["stage"], registry=self.registry)
        self.batch_size = Histogram(p + "batch_size", "requests per round (one target forward)", registry=self.registry,
                                    buckets=tuple(2 ** i for i in range(7)))
        self.tpot = Histogram(p + "time_per_output_token_seconds", "decode time per output token", registry=self.registry,
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0))
        self._rounds = 0
        self._committed = 0
        hand_over_threads()  # this thread loaded and measured the model; the engine thread computes from now on
        self.thread = threading.Thread(target=self._work, name="dartree-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(f"the server is busy: {self.jobs.maxsize} requests are already waiting; retry later",
                               status=429, kind="rate_limit_error") from None
        self.queue_length.set(self.jobs.qsize())

    def _admit(self, job: Job) -> None:
        """A job becomes a request of the batched engine (it waits there for a free slot)."""
        if job.cancelled.is_set():
            job.events.put(("cancelled", None))
            self.requests.labels("cancelled").inc()
            return
        try:
            request = self.pipe.request(torch.tensor(job.input_ids), job.settings,
                                        on_tokens=lambda new, job=job: job.events.put(("tokens", list(new))),
                                        cancelled=job.cancelled.is_set, alone=False, response_format=job.constraint)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
            job.events.put(("error", f"{type(exc).__name__}: {exc}"))
            self.requests.labels("error").inc()
            return
        request.job = job
        self.batch.submit(request)

    def _work(self) -> None:
        while True:
            # Idle: wait for a job. Busy: take the jobs that arrived, up to the free room, without waiting.
            if not self.batch.busy:
                self._admit(self.jobs.get())
            while len(self.batch.waiting) + len(self.batch.active) < self.max_batch:
                try:
                    self._admit(self.jobs.get_nowait())
                except queue.Empty:
                    break
            self.queue_length.set(self.jobs.qsize() + len(self.batch.waiting))
            try:
                finished = self.batch.step()
            except Exception as exc:  # noqa: BLE001 - the forward itself failed: every request in it gets the error
                finished = self.batch.abort(exc)
            self.running.set(len(self.batch.active))
            if self.batch.batch_sizes:
                self.batch_size.observe(self.batch.batch_sizes[-1])
            if self.batch.costs is not None:
                for stage, scale in self.batch.costs.scales.items():
                    self.cost_scale.labels(stage).set(scale)
            for r in finished:
                self._finish(r)

    def _finish(self, request) -> None:
        job = request.job
        reason = request.stats.finish_reason
        if reason == FINISH_CANCELLED:
            job.events.put(("cancelled", None))
            self.requests.labels("cancelled").inc()
        elif reason == FINISH_ERROR:
            job.events.put(("error", f"{type(request.error).__name__}: {request.error}"))
            self.requests.labels("error").inc()
        else:
            tokenizer = self.pipe.tokenizer
            text = tokenizer.decode(request.output, skip_special_tokens=True) if tokenizer is not None else None
            self._account(request.stats)
            job.events.put(("done", GenerationResult(token_ids=request.output, text=text, stats=request.stats)))
            self.requests.labels("ok").inc()

    def _account(self, stats) -> None:
        self.generated.inc(stats.new_tokens)
        self.drafts.inc(stats.rounds)
        self.draft_tokens.inc(sum(stats.tree_sizes))
        self.accepted.inc(sum(a - 1 for a in stats.acceptance_lengths))
        for a in stats.acceptance_lengths:
            for pos in range(a - 1):
                self.accepted_pos.labels(str(pos)).inc()
        self._rounds += stats.rounds
        self._committed += sum(stats.acceptance_lengths)
        if self._rounds:
            self.mean_acceptance.set(self._committed / self._rounds)
        if stats.new_tokens and stats.decode_seconds > 0:
            self.tpot.observe(stats.decode_seconds / stats.new_tokens)
