"""The OpenAI request and response shapes the gateway serves (pydantic models).

Requests forbid unknown fields: a field the gateway does not implement is a 400 that names
it, never silently ignored. Responses follow OpenAI's objects field for field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from omniflow.sampling import FIELDS, SamplingParams, StructuredOutput


class RequestShape(BaseModel):
    """A request body: an unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class ResponseShape(BaseModel):
    """A response object: fields beyond the declared ones pass through."""

    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- requests


class ImageURL(RequestShape):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(RequestShape):
    type: Literal["text"]
    text: str


class ImagePart(RequestShape):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(RequestShape):
    data: str  # the audio file, base64
    format: Literal["wav", "mp3"]


class AudioPart(RequestShape):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


class AudioRef(RequestShape):
    """An earlier answer's audio, by the id it came with (OpenAI's multi-turn form)."""

    id: str


class FunctionCall(RequestShape):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(RequestShape):
    """A call an earlier assistant turn made (sent back in the history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestShape):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    audio: AudioRef | None = None  # assistant messages only
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call answered
    refusal: str | None = None  # an assistant message sent back as the SDK returned it


class FunctionDef(RequestShape):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(RequestShape):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(RequestShape):
    name: str


class NamedToolChoice(RequestShape):
    type: Literal["function"]
    function: ToolChoiceFunction


class AudioOutput(RequestShape):
    """``audio`` of a chat request: the voice and format of a spoken answer. Formats are
    checked by the handler, so that the error names what this server serves."""

    voice: str
    format: str


class StreamOptions(RequestShape):
    include_usage: bool = False


class JSONSchemaFormat(RequestShape):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestShape):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(RequestShape):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(RequestShape):
    """The sampling fields of OpenAI and vLLM, typed only: their ranges and defaults are
    the contract's (``omniflow.sampling``), applied by ``to_sampling_params``."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    def _contract(
        self,
        max_tokens: int | None,
        logprobs: bool,
        top_logprobs: int,
        structured: StructuredOutput | None,
    ) -> SamplingParams:
        """The contract of this request (``SamplingError`` naming a bad field): every field
        declared here that the contract has by the same name, and the four each request type
        computes from its own fields."""
        given = {name: getattr(self, name) for name in _SHARED_FIELDS}
        return SamplingParams.build(
            **given,
            max_tokens=max_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            structured=structured,
        )


#: The sampling fields a request carries as they are (same name, same meaning).
_SHARED_FIELDS = tuple(name for name in _Sampling.model_fields if name in FIELDS)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # unset or null: up to the context
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutput | None = None

    def to_sampling_params(self, structured: StructuredOutput | None = None) -> SamplingParams:
        """The one sampling contract of this request (``SamplingError`` naming a bad field);
        ``max_completion_tokens`` wins over ``max_tokens``."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._contract(max_tokens, self.logprobs, self.top_logprobs or 0, structured)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # vLLM's and OpenAI's default, null too (as vLLM 0.32)
    logprobs: int | None = None
    echo: bool = False  # the prompt before the text; with max_tokens 0, the prompt alone
    best_of: int | None = Field(None, ge=1, le=1)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def to_sampling_params(self, structured: StructuredOutput | None = None) -> SamplingParams:
        """The one sampling contract of this request (``SamplingError`` naming a bad field);
        ``logprobs`` N asks for N alternatives per token."""
        lp = self.logprobs
        # vLLM's echo without generation: one token is generated and not shown.
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._contract(max_tokens, lp is not None, lp or 0, structured)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens(cls, data: Any) -> Any:
        """``max_tokens: null`` is the default, 16, as in vLLM 0.32's completions."""
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": cls.model_fields["max_tokens"].default}
        return data


class ImageRequest(RequestShape):
    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1)
    size: str = "256x256"
    response_format: Literal["b64_json"] = "b64_json"
    seed: int | None = Field(None, ge=0, lt=2**63)
    user: str | None = None


class SpeechRequest(RequestShape):
    model: str
    input: str = Field(min_length=1)
    voice: str = ""  # OpenAI's names (alloy, ...) are the talker's own voice
    response_format: Literal["wav", "pcm"] = "wav"
    speed: float = Field(1.0, ge=1.0, le=1.0)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(ResponseShape):
    cached_tokens: int = 0


class Usage(ResponseShape):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(ResponseShape):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(ResponseShape):
    content: list[TokenLogprob] | None = None


class _SetFieldsOnly(ResponseShape):
    """Serialized with only the fields it carries, as OpenAI's deltas are."""

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionAudio(ResponseShape):
    """A spoken answer: base64 audio in the requested format, and what it says."""

    id: str
    data: str
    expires_at: int
    transcript: str


class FunctionCallOut(ResponseShape):
    name: str
    arguments: str


class ToolCallOut(ResponseShape):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(ResponseShape):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    audio: ChatCompletionAudio | None = None
    tool_calls: list[ToolCallOut] | None = None


class DeltaFunction(_SetFieldsOnly):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_SetFieldsOnly):
    """A piece of a streamed call: its first carries id, type and name; later ones more of
    its arguments (the ``openai`` SDK joins them by ``index``)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class DeltaAudio(_SetFieldsOnly):
    """A piece of a streamed spoken answer: its id, base64 audio, transcript text, or (on
    the last) only its expiry."""

    id: str | None = None
    data: str | None = None
    transcript: str | None = None
    expires_at: int | None = None


class Delta(_SetFieldsOnly):
    """A chunk's delta: only the fields it carries (``{}`` on the last one), as OpenAI's."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: DeltaAudio | None = None
    tool_calls: list[DeltaToolCall] | None = None


class _Choice(ResponseShape):
    index: int
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatChoice(_Choice):
    message: AssistantMessage


class ChunkChoice(_Choice):
    delta: Delta


class _Object(ResponseShape):
    """The envelope of a completion object or chunk."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class ChatCompletion(_Object):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Object):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class CompletionLogprobs(ResponseShape):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseShape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Object):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(ResponseShape):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omniflow"


class ModelList(ResponseShape):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ImageData(ResponseShape):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(ResponseShape):
    created: int
    data: list[ImageData]


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
