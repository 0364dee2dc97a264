"""Chat templates and prompt preprocessing shared by the gateway, coordinator and workers."""

from omniflow.chat.preprocess import (
    Preprocessor,
    acached_preprocessor,
    cached_preprocessor,
    load_tokenizer,
    read_eos_token_ids,
)
from omniflow.chat.template import MEDIA_PLACEHOLDERS, ChatTemplate, has_media, normalize_messages

__all__ = [
    "MEDIA_PLACEHOLDERS",
    "ChatTemplate",
    "Preprocessor",
    "acached_preprocessor",
    "cached_preprocessor",
    "has_media",
    "load_tokenizer",
    "normalize_messages",
    "read_eos_token_ids",
]
