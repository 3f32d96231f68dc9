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

    def __init__(self, async_llm, model_names, tokenizer):
        super().__init__(async_llm, model_names)
        self.tokenizer = tokenizer

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        self.check_request(body)
        # Content given as text parts arrives here as one string per message (ChatMessage.text).
        prompt = render_chat([{"role": m.role, "content": m.text} for m in body.messages], self.tokenizer)
        # Without a limit a chat answer may run to the end of the context, as vLLM's does.
        prompt_ids, params = self.prepare(body, [prompt], body.max_completion_tokens or body.max_tokens)
        base_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": base_id, "created": created, "model": self.model_name}

        if body.stream:
            started: set[int] = set()

            def chunk(index, delta, reason):
                message = {"content": delta}
                if index not in started:  # the first chunk of a choice names the role, as OpenAI's do
                    started.add(index)
                    message = {"role": "assistant", "content": delta}
                return {**head, "object": "chat.completion.chunk",
                        "choices": [{"index": index, "delta": message, "logprobs": None, "finish_reason": reason}]}

            def usage_chunk(usage):
                return {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}

            return StreamingResponse(self.stream(body, prompt_ids, params, base_id, chunk, usage_chunk),
                                     media_type="text/event-stream")
        kv_params: dict = {}
        finals = await self.until_disconnected(
            request, self.collect(prompt_ids, params, base_id, body.include_stop_str_in_output, kv_params))
        choices = [{"index": j, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason} for j, (text, reason, _) in enumerate(finals[0])]
        return {**head, "object": "chat.completion", "choices": choices, "usage": self.usage(prompt_ids, finals),
                "kv_transfer_params": kv_params.get("kv_transfer_params")}
