"""What one step costs: the model's forward pass time against the tokens it carries, measured and fitted.

A step of the engine is one forward pass over every scheduled token (kvlab.cache.ragged_batch.forward_batch,
the pass the model runner makes). Three kinds of pass, each with T tokens in all:

    prefill   one sequence, T prompt tokens from position 0
    decode    T sequences, one new token each, after `context` cached tokens
    verify    one sequence, T new tokens after `context` cached tokens (speculative decoding's check of
              T - 1 drafts; a prefill chunk that follows a prefix-cache hit looks the same)

Each pass runs on kvlab's paged cache with the engine's attention backend and keeps only the logits the
engine keeps (one row per sequence, or every row of a verify pass). Timing pins torch to one thread
(with two threads on a shared 2-core CPU a tiny model's pass spin-waits and its time depends on the
machine, not the model), runs every case once per round and takes the median over rounds, so a slow
moment of the machine falls on all cases alike. `fit_line` fits t = a + b*T by least squares.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch

PASS_KINDS = ("prefill", "decode", "verify")
TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (16, 128, 240)
VERIFY_CONTEXT = 120
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class PassCase:
    """One forward pass to time: `num_seqs` sequences, each bringing `new_tokens` after `context` cached ones."""

    kind: str
    num_seqs: int
    new_tokens: int
    context: int

    @property
    def tokens(self) -> int:
        """Tokens the pass carries (the rows of its input), T."""
        return self.num_seqs * self.new_tokens

    @property
    def kv_reads(self) -> int:
        """Cached K/V positions the pass's queries read, R: new token i of a sequence attends over context + i + 1."""
        return self.num_seqs * (self.new_tokens * self.context + self.new_tokens * (self.new_tokens + 1) // 2)

    @property
    def label(self) -> str:
        return f"{self.kind} T={self.tokens} context={self.context}"


def pass_cases(max_len: int, token_counts=TOKEN_COUNTS, decode_contexts=DECODE_CONTEXTS,
               verify_context: int = VERIFY_CONTEXT) -> list[PassCase]:
    """Every case that fits a context of max_len tokens: prefills, decodes at each context, verifies."""
    cases = [PassCase("prefill", 1, n, 0) for n in token_counts if n <= max_len]
    for context in decode_contexts:
        if context + 1 > max_len:
            raise ValueError(f"decode context {context} leaves no room for a new token in {max_len} positions")
        cases += [PassCase("decode", n, 1, context) for n in token_counts]
    cases += [PassCase("verify", 1, n, verify_context) for n in token_counts if verify_context + n <= max_len]
    return cases


@contextmanager
def torch_threads(n: int):
    """torch runs on n intra-op threads inside the block, then on as many as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _PassRunner:
    """Block tables for every case laid out once in one pool, and the pass each case makes."""

    def __init__(self, model, cases: list[PassCase], attention_backend: str):
        blocks_per_seq = {c: math.ceil((c.context + c.new_tokens) / BLOCK_SIZE) for c in cases}
        num_blocks = max(c.num_seqs * blocks_per_seq[c] for c in cases)
        self.cache = PagedKVCache.for_model(model, num_blocks, BLOCK_SIZE, attention_backend=attention_backend)
        self.model = model
        vocab = int(model.config.vocab_size)
        self.work = {}
        for case in cases:
            per_seq = blocks_per_seq[case]
            chunks = [SequenceChunk([(7 * s + i) % vocab for i in range(case.new_tokens)], case.context,
                                    list(range(s * per_seq, (s + 1) * per_seq)))
                      for s in range(case.num_seqs)]
            # The engine keeps one row per sequence, and every row of a pass that verifies drafts.
            keep = list(range(case.tokens)) if case.kind == "verify" else \
                [(s + 1) * case.new_tokens - 1 for s in range(case.num_seqs)]
            self.work[case] = (chunks, keep)

    def seconds(self, case: PassCase) -> float:
        chunks, keep = self.work[case]
        # A GPU runs the pass after the call returns: wait for it, so the time is the step's, launches included.
        cuda = self.cache.k_pools[0].is_cuda
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        forward_batch(self.model, self.cache, chunks, keep)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def measure_passes(model, cases: list[PassCase] | None = None, rounds: int = 7, threads: int = 1,
                   attention_backend: str = "auto", progress=None) -> dict[PassCase, list[float]]:
    """Seconds of each case's forward pass, `rounds` times each (every case once per round, after a warm-up).

    progress: called with (round, rounds) after each round, or None.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if cases is None:
        cases = pass_cases(int(model.config.max_position_embeddings))
    with torch_threads(threads):
        runner = _PassRunner(model, cases, attention_backend)
        for case in cases:  # warm-up: allocator, dispatch caches
            runner.seconds(case)
        times: dict[PassCase, list[float]] = {case: [] for case in cases}
        for r in range(rounds):
            for case in cases:
                times[case].append(runner.seconds(case))
            if progress is not None:
                progress(r + 1, rounds)
    return times


@dataclass(frozen=True, slots=True)
class CostFit:
    """t = a + b*T (+ c*R) fitted by least squares over measured passes.

    a: seconds per pass, b: seconds per token carried (T), c: seconds per cached K/V position that the
    pass's queries read (R, `PassCase.kv_reads`), 0 when the fit leaves R out.
    """

    a: float
    b: float
    c: float
    r2: float
    residuals: list[float]          # measured - fitted, seconds, in the order of the points
    max_relative_residual: float    # largest |measured - fitted| / fitted over the points

    def predict(self, tokens: float, kv_reads: float = 0.0) -> float:
        """The fitted seconds of a pass carrying `tokens` tokens whose queries read `kv_reads` K/V positions."""
        return self.a + self.b * tokens + self.c * kv_reads

    @property
    def break_even_tokens(self) -> float:
        """T at which the tokens cost as much as the pass itself (a / b)."""
        return self.a / self.b if self.b > 0 else math.inf


def fit_cost(tokens: list[float], seconds: list[float], kv_reads: list[float] | None = None) -> CostFit:
    """Least-squares t = a + b*T, or t = a + b*T + c*R when kv_reads (R per point) is given."""
    if len(tokens) != len(seconds) or (kv_reads is not None and len(kv_reads) != len(seconds)):
        raise ValueError(f"one time per point: {len(tokens)} token counts, {len(seconds)} times"
                         + ("" if kv_reads is None else f", {len(kv_reads)} K/V reads"))
    columns = [[1.0] * len(tokens), [float(t) for t in tokens]]
    if kv_reads is not None:
        columns.append([float(r) for r in kv_reads])
    if len(set(tokens)) < 2 or len(tokens) < len(columns) + 1:
        raise ValueError(f"{len(tokens)} points at {len(set(tokens))} token counts cannot fit "
                         f"{len(columns)} coefficients and leave a residual")
    x = torch.tensor(columns, dtype=torch.float64).T
    y = torch.tensor(seconds, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(x, y, driver="gelsd").solution[:, 0].tolist()
    fitted = (x @ torch.tensor(coef, dtype=torch.float64)).tolist()
    residuals = [t - f for t, f in zip(seconds, fitted)]
    mean = statistics.fmean(seconds)
    ss_tot = sum((t - mean) ** 2 for t in seconds)
    r2 = 1.0 - sum(e * e for e in residuals) / ss_tot if ss_tot > 0 else 1.0
    max_rel = max(abs(e) / f for e, f in zip(residuals, fitted))
    return CostFit(coef[0], coef[1], coef[2] if kv_reads is not None else 0.0, r2, residuals, max_rel)


def fits(medians: dict[PassCase, float]) -> dict[str, CostFit]:
    """The fits the benchmark reports, by name, over the median seconds of each case.

    "prefill", "verify": t = a + b*T over that kind; "decode, context C": the same over decodes at one context;
    "decode": t = a + b*T + c*R over every decode; "all": t = a + b*T + c*R over every case.
    """
    def fit(group, reads):
        return fit_cost([c.tokens for c in group], [medians[c] for c in group],
                        [c.kv_reads for c in group] if reads else None)

    out = {}
    for kind in ("prefill", "verify"):
        group = [c for c in medians if c.kind == kind]
        if len({c.tokens for c in group}) >= 3:
            out[kind] = fit(group, False)
    decodes = [c for c in medians if c.kind == "decode"]
    for context in sorted({c.context for c in decodes}):
        group = [c for c in decodes if c.context == context]
        if len({c.tokens for c in group}) >= 3:
            out[f"decode, context {context}"] = fit(group, False)
    if len(decodes) >= 4 and len({c.context for c in decodes}) >= 2:
        out["decode"] = fit(decodes, True)
    if len(medians) >= 4:
        out["all"] = fit(list(medians), True)
    return out
