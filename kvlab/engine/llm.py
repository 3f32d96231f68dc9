"""Chapter 6's offline entry point with vLLM's shape: `LLM(...).generate(prompts, sampling_params)`.

    from kvlab import LLM, SamplingParams
    llm = LLM(block_size=16, num_blocks=128, max_num_seqs=8)       # the embedded model
    outputs = llm.generate(["OTHELLO.\\n", "HAMLET.\\n"], SamplingParams(temperature=0, max_tokens=40))
    print(outputs[0].outputs[0].text)

LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}) speculates, as vLLM does
("draft_model" uses the course's embedded draft model unless "model" names another).

LLM(kv_cache_dtype="int8") (or "fp8", vLLM's knob) stores the K/V cache in 8 bits, for generate and beam_search alike.
Every keyword argument is a knob of kvlab.engine.config.EngineConfig, the configuration `kvlab serve`
reads from its flags too.

`llm.llm_engine` is the step-by-step engine underneath (add_request, step, has_unfinished_requests,
abort_request), which the notebooks and widgets drive directly.
"""

import dataclasses
import sys
from collections.abc import Sequence

from kvlab.engine.config import EngineConfig
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.request import CompletionOutput, RequestOutput
from kvlab.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """A model plus a continuous-batching engine; model is None (the embedded model), a name or path, or a loaded model.

    dtype and device apply when kvlab loads the model (e.g. LLM("Qwen/Qwen2.5-0.5B-Instruct", dtype=torch.float16,
    device="cuda")); kv_cache_dtype is "auto" (the model's dtype), "int8" or "fp8_e4m3" ("fp8"); every keyword
    argument is an EngineConfig knob (or give config=EngineConfig(...)).
    """

    def __init__(self, model=None, tokenizer=None, config: EngineConfig | None = None, **knobs):
        if isinstance(model, str) or hasattr(model, "__fspath__"):
            knobs.setdefault("model", str(model))
        # Every knob is checked before a model is loaded for nothing.
        config = EngineConfig.from_kwargs(**knobs) if config is None else config.replace(**knobs)
        if model is None or isinstance(model, str) or hasattr(model, "__fspath__"):
            from kvlab.model.loader import load_model

            model_config = config.model_config
            model, loaded_tokenizer = load_model(model, dtype=model_config.torch_dtype, device=model_config.device)
            tokenizer = tokenizer or loaded_tokenizer
        self.model, self.tokenizer = model, tokenizer
        self.llm_engine = LLMEngine(model, tokenizer, config)
        self._counter = 0

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order; prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Offline, only the finished outputs matter: nothing is detokenised along the way (vLLM does the same).
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{self._counter}"
                engine.add_request(rid, prompt, p)
                self._counter += 1
                ids.append(rid)
        except Exception:
            for rid in ids:  # a bad prompt: leave the engine as it was before this call
                engine.abort_request(rid)
            raise
        bar = None
        if use_tqdm:
            # tqdm's text bar, not its widget: a saved notebook keeps the final line, never a stuck 0% widget.
            from tqdm.std import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req", file=sys.stdout, mininterval=0.5)
        done = {}
        while any(rid not in done for rid in ids):
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]

    def get_metrics(self) -> list:
        """The engine's counters and gauges under vLLM's names: objects with name and value (kvlab.engine.metrics)."""
        return self.llm_engine.get_metrics()

    def beam_search(self, prompts, params: BeamSearchParams) -> list[RequestOutput]:
        """Beam search per prompt (Chapter 5's forked, copy-on-write search); outputs hold the beams, best first.

        Like vLLM, beam search runs outside the continuous-batching engine: each prompt is searched on
        its own paged pool, with the engine's block size and kv_cache_dtype.
        """
        from kvlab.decoding.beam_search import beam_search

        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        results = []
        engine = self.llm_engine
        for prompt in prompts:
            text, ids = engine.input_processor.tokenize(prompt)
            beams = beam_search(self.model, ids, params.beam_width, params.max_tokens, params.length_penalty,
                                params.early_stopping, block_size=engine.block_size,
                                kv_cache_dtype=engine.kv_cache_dtype)
            outputs = []
            for i, (tokens, score) in enumerate(beams):
                finish = "stop" if tokens and tokens[-1] in engine.eos_token_ids else "length"
                outputs.append(CompletionOutput(i, engine.output_processor.decode(tokens), tokens, finish,
                                                cumulative_logprob=score))
            results.append(RequestOutput(f"beam-{self._counter}", text, ids, outputs, finished=True))
            self._counter += 1
        return results
