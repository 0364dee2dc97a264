"""Request and response shapes of the embeddings, audio transcription and utility endpoints
(pydantic), as OpenAI and vLLM define them.

On ``protocol``'s bases: requests forbid unknown fields (a 400 naming the field), responses
follow the reference's objects field for field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from omniflow_services.gateway.protocol import ChatMessage, RequestShape, ResponseShape

# ---------------------------------------------------------------- embeddings


class EmbeddingRequest(RequestShape):
    """OpenAI's ``POST /v1/embeddings``."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class Embedding(ResponseShape):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(ResponseShape):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(ResponseShape):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------- audio

AudioFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]


class TranscriptionRequest(RequestShape):
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


class TranslationRequest(RequestShape):
    """OpenAI's ``POST /v1/audio/translations``: speech in, English text out."""

    file: bytes = Field(description="the audio file (WAV, FLAC, OGG, MP3, ...)")
    model: str
    prompt: str | None = None
    response_format: AudioFormat = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)


class TranscriptionSegment(ResponseShape):
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


class DurationUsage(ResponseShape):
    type: Literal["duration"] = "duration"
    seconds: int


class Transcription(ResponseShape):
    text: str
    usage: DurationUsage | None = None


class TranscriptionVerbose(ResponseShape):
    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: DurationUsage | None = None


# ---------------------------------------------------------------- tokenizer and version


class TokenizeCompletionRequest(RequestShape):
    """vLLM's ``POST /tokenize`` of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestShape):
    """vLLM's ``POST /tokenize`` of chat messages, rendered with the model's template."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(ResponseShape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestShape):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseShape):
    prompt: str


class VersionResponse(ResponseShape):
    version: str
