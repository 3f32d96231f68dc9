"""POST /v1/chat/completions (vLLM's entrypoints/openai/serving_chat.py): messages through the chat template."""

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvlab.entrypoints.openai.chat_template import render_chat
from kvlab.entrypoints.openai.protocol import ChatCompletionRequest
from kvlab.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint of one served model."""

    def __init__(self, async_llm, model_name: str, tokenizer):
        super().__init__(async_llm, model_name)
        self.tokenizer = tokenizer

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        prompt = render_chat([m.model_dump() for m in body.messages], self.tokenizer)
        # Without a limit a chat answer may run to the end of the context, as vLLM's does.
        prompt_ids, params = self.prepare(body, [prompt], body.max_completion_tokens or body.max_tokens)
        base_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": base_id, "created": created, "model": self.model_name}

        if body.stream:
            started: set[int] = set()

            def chunk(index, delta, reason, usage=None):
                base = {**head, "object": "chat.completion.chunk"}
                if usage is not None:
                    return {**base, "choices": [], "usage": usage}
                message = {"content": delta}
                if index not in started:  # the first chunk of a choice names the role, as OpenAI's do
                    started.add(index)
                    message = {"role": "assistant", "content": delta}
                return {**base, "choices": [{"index": index, "delta": message, "logprobs": None,
                                             "finish_reason": reason}]}

            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(prompt_ids, params, base_id, chunk, include_usage),
                                     media_type="text/event-stream")
        finals = await self.until_disconnected(request, self.collect(prompt_ids, params, base_id))
        choices = [{"index": j, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason} for j, (text, reason, _) in enumerate(finals[0])]
        return {**head, "object": "chat.completion", "choices": choices, "usage": self.usage(prompt_ids, finals)}
