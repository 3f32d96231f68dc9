"""The OpenAI request bodies kvlab accepts, as pydantic models, with vLLM's rule for what it does not know.

Every field OpenAI's API or vLLM's server accepts is accepted here (vLLM's request models are in
vllm/entrypoints/openai/protocol.py; newer releases split them into completion/protocol.py and
chat_completion/protocol.py). A field is in one of four groups:

  * honoured: the prompt or messages, model, max_tokens / max_completion_tokens, min_tokens, temperature,
    top_p, top_k, n, seed, stop, stop_token_ids, stream, stream_options (include_usage,
    continuous_usage_stats), ignore_eos, include_stop_str_in_output, echo (completions), and user (kept,
    as OpenAI's is, unused);
  * sampling knobs kvlab's sampler does not have (repetition_penalty, min_p, ...): checked for type and
    range as vLLM checks them, then ignored with a logged warning unless they hold the value that changes
    nothing (repetition_penalty 1.0, which `vllm bench serve` always sends);
  * requests for an answer kvlab cannot give (logprobs, beam search, best_of > n, a JSON schema, tool
    calls, a suffix): a 400 naming the field, as vLLM itself answers for what it does not support,
    rather than a reply that silently lacks what was asked for;
  * anything else: accepted and ignored with a logged warning, vLLM's OpenAIBaseModel rule (OpenAI's API
    allows extra fields).

Wrong types and out-of-range values stay 400s, with vLLM's error body (serving_engine.OpenAIError).
"""

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

logger = logging.getLogger("kvlab.entrypoints.openai")

# Content parts a text-only model has no use for (OpenAI's and vLLM's multimodal part types).
MEDIA_PARTS = frozenset({"image_url", "input_image", "image_embeds", "image_pil", "input_audio", "audio_url",
                         "video_url", "file", "input_file"})
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})

# vLLM's sampling knobs kvlab's sampler lacks: the value that changes nothing, and the check vLLM's
# SamplingParams applies to it (so a malformed value is still a 400).
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
           "length_penalty": 1.0, "logit_bias": None, "skip_special_tokens": True,
           "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "allowed_token_ids": None,
           "bad_words": None, "priority": 0}


class FieldError(ValueError):
    """A request check that names the field at fault (it becomes the error body's param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class OpenAIBaseModel(BaseModel):
    """A request body part that keeps the fields it does not know (OpenAI's API allows them) so they can be named."""

    model_config = ConfigDict(extra="allow")

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """The names of the extra fields, here and in nested parts, dotted from the body's top."""
        names = [prefix + name for name in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(item, OpenAIBaseModel):
                    where = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                    names += item.unknown_fields(where)
        return names


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True            # vLLM's default once stream_options is sent at all
    continuous_usage_stats: bool | None = False  # vLLM's extension: usage so far on every chunk


class _SamplingFields(OpenAIBaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)  # vLLM sets no upper bound (OpenAI's is 2)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: no EOS, stop token or stop string before this many tokens
    include_stop_str_in_output: bool = False
    user: str | None = None
    request_id: str | None = None  # vLLM's extension; kvlab names its requests itself
    # vLLM's extension for disaggregated prefill/decode: handed to the KV connector (SamplingParams.extra_args);
    # a non-streaming answer carries the connector's params back (the prefill server's block ids, say).
    kv_transfer_params: dict[str, Any] | None = None

    # Sampling knobs kvlab does not have: checked as vLLM checks them, then ignored with a warning.
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    length_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0

    # Asked-for answers kvlab cannot give: accepted only when they ask for nothing.
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _checks_across_fields(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options can only be given when stream is true", "stream_options")
        limit = self.max_tokens if self.max_tokens is not None else getattr(self, "max_completion_tokens", None)
        if limit is not None and self.min_tokens > limit:
            raise FieldError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({limit})", "min_tokens")
        return self

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every part of the request kvlab cannot answer: each is a 400."""
        out = []
        if self.use_beam_search:
            out.append(("use_beam_search", "kvlab serves sampling only; beam search is LLM.beam_search, offline"))
        if self.prompt_logprobs is not None:
            out.append(("prompt_logprobs", "kvlab's engine does not return log-probabilities"))
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            out.append(("response_format", f"kvlab has no structured output, so response_format {fmt!r} cannot"
                                           " be kept (only 'text')"))
        if self.structured_outputs:
            out.append(("structured_outputs", "kvlab has no structured output"))
        return out

    def ignored(self) -> list[str]:
        """The fields this request sets that kvlab accepts and does not apply: vLLM's extras and unknowns."""
        names = []
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name)
            if value is None or value == neutral or (isinstance(value, (dict, list)) and not value):
                continue
            names.append(f"{name}={value!r}")
        return names + self.unknown_fields()


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        def ids(x):
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if value == "" or value == []:
            raise FieldError("prompt must not be empty", "prompt")
        if not (isinstance(value, str) or ids(value)
                or (isinstance(value, list) and all(isinstance(p, str) and p for p in value))
                or (isinstance(value, list) and all(ids(p) for p in value))):
            raise FieldError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                             f"token ids (none empty), got {type(value).__name__} {str(value)[:60]}", "prompt")
        return value

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs is not None:
            out.append(("logprobs", "kvlab's engine does not return log-probabilities"))
        if self.best_of is not None and self.best_of > self.n:
            out.append(("best_of", f"kvlab does not rank completions: best_of ({self.best_of}) must equal n"
                                   f" ({self.n})"))
        if self.suffix:
            out.append(("suffix", "kvlab does not fill in the middle: suffix is not supported"))
        return out


def part_text(part: Any, where: str) -> str:
    """The text of one content part ({"type": "text", "text": ...}); a media or malformed part is a FieldError."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise FieldError("a content part must be an object with a 'type', such as {'type': 'text', 'text': '...'}",
                         where)
    kind = part["type"]
    if kind in MEDIA_PARTS:
        raise FieldError(f"a content part of type {kind!r}: this model is text-only, so content parts must be text",
                         where)
    if kind not in TEXT_PARTS:
        raise FieldError(f"unknown content part type {kind!r} (this text-only model takes 'text' parts)", where)
    key = "refusal" if kind == "refusal" else "text"
    if not isinstance(part.get(key), str):
        raise FieldError(f"a content part of type {kind!r} needs a {key!r} string", where)
    return part[key]


class ChatMessage(OpenAIBaseModel):
    """One message: content is a string or a list of text parts (OpenAI's typed content), or null for an assistant."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    name: str | None = None
    _text: str = PrivateAttr(default="")

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and self.role != "assistant":  # an assistant turn may hold only tool calls
            raise FieldError(f"a {self.role!r} message needs content", "content")
        if isinstance(self.content, list):
            if not self.content:
                raise FieldError("content must not be an empty list of parts", "content")
            self._text = "\n".join(part_text(p, f"content.{i}") for i, p in enumerate(self.content))
        else:
            self._text = self.content or ""
        return self

    @property
    def text(self) -> str:
        """The message as one string: text parts joined by newlines, as vLLM joins them for a text-only model."""
        return self._text


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs" if self.logprobs else "top_logprobs",
                        "kvlab's engine does not return log-probabilities"))
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice != "none":
            out.append(("tool_choice", "kvlab does not parse tool calls: send no tools, or tool_choice 'none'"))
        if not self.add_generation_prompt:
            out.append(("add_generation_prompt", "kvlab's chat template always ends with the assistant's turn"))
        return out
