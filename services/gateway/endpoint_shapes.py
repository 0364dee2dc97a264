"""Request and response shapes of the embeddings, audio transcription and utility endpoints
(pydantic), as OpenAI and vLLM define them, and reading a JSON body into one.

As in ``protocol``: requests forbid unknown fields (a 400 naming the field), responses
follow the reference's objects field for field.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omniflow_services.gateway.errors import bad_request, from_validation
from omniflow_services.gateway.protocol import ChatMessage

M = TypeVar("M", bound=BaseModel)


async def parse_json(request: Request, cls: type[M]) -> M:
    """The JSON body as ``cls``: OpenAI's 400 naming the bad field, or saying it is not JSON."""
    body = await request.body()
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise bad_request("the request body is not valid JSON") from None
        raise from_validation(exc) from None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- embeddings


class EmbeddingRequest(_Request):
    """OpenAI's ``POST /v1/embeddings``."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class Embedding(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------- audio

AudioFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]


class TranscriptionRequest(_Request):
    """OpenAI's ``POST /v1/audio/transcriptions`` (multipart/form-data fields)."""

    file: bytes = Field(description="the audio file (WAV, FLAC, OGG, MP3, ...)")
    model: str
    language: str | None = None
    prompt: str | None = None
    response_format: AudioFormat = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(
        default=None, alias="timestamp_granularities[]"
    )
    stream: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TranslationRequest(_Request):
    """OpenAI's ``POST /v1/audio/translations``: speech in, English text out."""

    file: bytes = Field(description="the audio file (WAV, FLAC, OGG, MP3, ...)")
    model: str
    prompt: str | None = None
    response_format: AudioFormat = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)


class TranscriptionSegment(_Response):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class DurationUsage(_Response):
    type: Literal["duration"] = "duration"
    seconds: int


class Transcription(_Response):
    text: str
    usage: DurationUsage | None = None


class TranscriptionVerbose(_Response):
    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: DurationUsage | None = None


# ---------------------------------------------------------------- tokenizer and version


class TokenizeCompletionRequest(_Request):
    """vLLM's ``POST /tokenize`` of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """vLLM's ``POST /tokenize`` of chat messages, rendered with the model's template."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
