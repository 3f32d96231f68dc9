"""Serving under load without waiting for the wall clock: Poisson arrivals replayed against a real engine.

The engine runs for real; only idle time is skipped. A virtual clock advances by each step's measured
time, and requests join when the clock passes their arrival (Poisson, seeded); when nothing runs,
the clock jumps to the next arrival. So every latency below is made of measured step times, and a
sweep over request rates takes as long as the computing it needs, not as long as the arrivals span:

    timings = replay(make_engine, prompts, output_lens, rate=4.0, seed=0)
    normalized_latency(timings)     # kvlab.benchmarks.latency: mean of end-to-end latency / output tokens

A step's time is the CPU time this process spent in it (time.process_time), so other work on the machine
does not inflate it. It is the CPU time of all the process's threads together: run with one torch thread
(torch.set_num_threads(1), OMP_NUM_THREADS=1), or a step on a machine with more cores counts more time.
clock="wall" measures wall time instead, which a GPU run needs (the CPU waits for the device).

Static batching (FasterTransformer-like) is replayed batch by batch: a batch starts when the engine
is free, takes up to batch_size waiting requests, and all of them finish when its longest one does.
"""

import time
from dataclasses import dataclass, field

from kvlab.benchmarks.datasets import poisson_arrivals
from kvlab.benchmarks.latency import LatencyMetrics, latency_metrics
from kvlab.engine.sampling_params import SamplingParams


@dataclass
class RequestTiming:
    """One request's life on the virtual clock (seconds)."""

    arrival: float
    prompt_len: int
    output_len: int
    first_token: float | None = None
    finish: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each step that gave it tokens ended

    def got_tokens(self, now: float, finished: bool = False) -> None:
        """The step that ended at `now` gave this request tokens (its first ones, if it had none)."""
        self.token_times.append(now)
        if self.first_token is None:
            self.first_token = now
        if finished:
            self.finish = now

    def metrics(self) -> LatencyMetrics:
        """TTFT, TPOT, ITL and E2E by the one definition (kvlab.benchmarks.latency)."""
        return latency_metrics(self.arrival, self.token_times, self.output_len)

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        return self.metrics().ttft

    @property
    def itls(self) -> list[float]:
        return list(self.metrics().itl)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _timer(clock):
    """The function that reads the time: "cpu", "wall", or any callable returning seconds (a test's fake clock)."""
    if callable(clock):
        return clock
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)} or a function returning seconds, got {clock!r}")
    return CLOCKS[clock]


def replay_arrivals(engine, prompts, output_lens, arrivals, clock="cpu", max_steps: int = 10**6,
                    spans: list | None = None) -> list[RequestTiming]:
    """Serve prompts[i] arriving at arrivals[i] (seconds, sorted) on engine, on the virtual clock; greedy, each to
    output_lens[i] tokens. spans: a list to which each step's (start, end) on the virtual clock is appended.

    Request i is added, with id str(i), once the clock has reached its arrival (an arrival equal to the clock
    joins the next step); a step advances the clock by its measured duration; every request that got tokens in
    a step gets that step's end time; with nothing unfinished the clock jumps to the next arrival.
    """
    if not len(prompts) == len(output_lens) == len(arrivals):
        raise ValueError(f"prompts, output_lens and arrivals must pair up, got {len(prompts)}, {len(output_lens)} "
                         f"and {len(arrivals)}")
    if any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("arrivals must be sorted")
    timer = _timer(clock)
    timings = [RequestTiming(a, len(p), n) for a, p, n in zip(arrivals, prompts, output_lens)]
    now, nxt, done = 0.0, 0, 0
    for _ in range(max_steps):
        while nxt < len(prompts) and arrivals[nxt] <= now:
            engine.add_request(str(nxt), prompts[nxt], SamplingParams(temperature=0, max_tokens=output_lens[nxt],
                                                                     ignore_eos=True))
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt == len(prompts):
                break
            now = max(now, arrivals[nxt])  # idle: jump to the next arrival
            continue
        start = timer()
        outputs = engine.step()
        began, now = now, now + (timer() - start)
        if spans is not None:
            spans.append((began, now))
        for out in outputs:
            timings[int(out.request_id)].got_tokens(now, out.finished)
            done += out.finished
    if done != len(prompts):
        raise RuntimeError(f"only {done} of {len(prompts)} requests finished within {max_steps} steps")
    return timings


def replay(make_engine, prompts, output_lens, rate: float, seed: int = 0, max_steps: int = 10**6,
           clock: str = "cpu", spans: list | None = None) -> list[RequestTiming]:
    """Replay the requests arriving as a Poisson process at `rate` (seeded) on a fresh engine from make_engine()."""
    return replay_arrivals(make_engine(), prompts, output_lens, poisson_arrivals(len(prompts), rate, seed), clock,
                           max_steps, spans)


def replay_static(static_engine, prompts, output_lens, rate: float, batch_size: int, seed: int = 0,
                  clock: str = "cpu") -> list[RequestTiming]:
    """Static batching at `rate`: batches of up to batch_size waiting requests, each run to its longest member."""
    timer = _timer(clock)
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    timings = [RequestTiming(a, len(p), n) for a, p, n in zip(arrivals, prompts, output_lens)]
    now, nxt = 0.0, 0
    while nxt < len(prompts):
        now = max(now, arrivals[nxt])
        batch = [i for i in range(nxt, len(prompts)) if arrivals[i] <= now][:batch_size]
        start = timer()
        static_engine.generate([prompts[i] for i in batch],
                               [SamplingParams(temperature=0, max_tokens=output_lens[i], ignore_eos=True)
                                for i in batch])
        now += timer() - start
        for i in batch:  # a static batch returns when its longest member is done
            timings[i].got_tokens(now, finished=True)
        nxt = batch[-1] + 1
    return timings
