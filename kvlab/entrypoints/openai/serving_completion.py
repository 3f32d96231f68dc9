"""POST /v1/completions (vLLM's entrypoints/openai/serving_completion.py): text or token-id prompts, one or many."""

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvlab.entrypoints.openai.protocol import CompletionRequest
from kvlab.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint of one served model."""

    async def create_completion(self, body: CompletionRequest, request: Request):
        self.check_request(body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_ids, params = self.prepare(body, prompts, body.max_tokens)
        base_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": base_id, "object": "text_completion", "created": created, "model": self.model_name}

        def echoed(i: int) -> str:
            """echo: the prompt's text leads each of its completions (a token-id prompt decoded)."""
            return prompts[i] if isinstance(prompts[i], str) else self.engine.tokenizer.decode(prompt_ids[i])

        if body.stream:
            def chunk(index, delta, reason):
                return {**head, "choices": [{"index": index, "text": delta, "logprobs": None,
                                             "finish_reason": reason}]}

            def usage_chunk(usage):
                return {**head, "choices": [], "usage": usage}

            return StreamingResponse(self.stream(body, prompt_ids, params, base_id, chunk, usage_chunk,
                                                 echoed if body.echo else None),
                                     media_type="text/event-stream")
        kv_params: dict = {}
        finals = await self.until_disconnected(
            request, self.collect(prompt_ids, params, base_id, body.include_stop_str_in_output, kv_params))
        n = params[0].n
        choices = [{"index": i * n + j, "text": (echoed(i) if body.echo else "") + text, "logprobs": None,
                    "finish_reason": reason}
                   for i, rows in enumerate(finals) for j, (text, reason, _) in enumerate(rows)]
        return {**head, "choices": choices, "usage": self.usage(prompt_ids, finals),
                "kv_transfer_params": kv_params.get("kv_transfer_params")}
