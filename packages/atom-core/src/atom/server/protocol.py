"""Request bodies of the OpenAI API (the subset the server implements).

Unknown fields are refused with a 400 that names them: a misspelt or unsupported option
must not be silently ignored. Fields that exist in SamplingParams carry the same meaning
there; vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, return_token_ids, chat_template_kwargs) are accepted too, as the openai
client's `extra_body`. A null field means its default, except `max_tokens: null`, which
(as in vLLM) means "up to the context length".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from atom.sampling_params import SamplingParams
from atom.server.guided_protocol import GuidedFields
from atom.server.json_schema import schema_problem

# The largest top-logprobs count a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20

# OpenAI and vLLM fields that atom serve knows but does not implement; a request that sets
# one (to anything but null or empty) gets a 400 saying so, not "unknown field".
UNSUPPORTED_FIELDS = (
    "functions", "function_call", "suffix", "prompt_logprobs", "audio", "modalities",
    "prediction",
)  # fmt: skip
MAX_LOGIT_BIAS = 100  # OpenAI's bound on a logit_bias value
# The roles OpenAI's chat API accepts; it refuses any other with a 400, and so does atom serve.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]

_SHARED_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
}  # fmt: skip


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingRequest(GuidedFields, StrictModel):
    """Fields common to completions and chat; None means the SamplingParams default."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: accepted, unused
    return_token_ids: bool | None = False
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        None
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in logit_bias or {}:
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids written as strings, got {key!r}")
        return logit_bias

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_fields(self, defaults: dict, *extra: str) -> dict:
        """The SamplingParams arguments this request sets; unset ones take `defaults` (the
        server's, --generation-config), then SamplingParams' own."""
        fields = self.model_dump(include=_SHARED_SAMPLING_FIELDS | set(extra), exclude_none=True)
        # max_tokens has a default of its own per endpoint: each sampling_params applies it.
        fields = {**{k: v for k, v in defaults.items() if k != "max_tokens"}, **fields}
        if self.logit_bias:
            fields["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return fields


class CompletionRequest(SamplingRequest):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: text, token ids, or a list of either."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def sampling_params(self, defaults: dict) -> SamplingParams:
        # Omitted, max_tokens is 16; null means the server's default (--generation-config's
        # max_new_tokens), else no limit but the context length.
        fields = self.sampling_fields(defaults, "logprobs")
        max_tokens = self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens")
        return SamplingParams(**fields, max_tokens=max_tokens)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True, exclude={"content"})
        return {**message, "content": self.text}


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        # OpenAI refuses a malformed schema whatever tool_choice says; without this, with
        # tool_choice "auto", it would only mislead the model through the chat template.
        problem = None if parameters is None else schema_problem(parameters)
        if problem is not None:
            raise ValueError(f"not a valid JSON schema: {problem}")
        return parameters


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; several calls are always parsed
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top_logprobs

    def sampling_params(self, defaults: dict) -> SamplingParams:
        # Chat's default length limit is the server's (--generation-config's max_new_tokens),
        # else none: it runs to max_model_len unless told otherwise.
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        return SamplingParams(
            **self.sampling_fields(defaults),
            max_tokens=max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[StrictInt]
