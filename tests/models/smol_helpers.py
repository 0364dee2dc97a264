"""Shared by the model tests: the converted SmolLM2 pair and a run-to-end engine loop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Smol:
    """The wheel's GGUF file and our conversion of it."""

    gguf: Path
    converted: Path


def run_to_end(engine, request):  # type: ignore[no-untyped-def]
    """Step ``engine`` until ``request`` finishes; its tokens and logits rows."""
    import torch

    engine.add_request(request)
    tokens: list[int] = []
    rows = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if out.logits is not None:
                rows.append(out.logits)
    else:
        raise AssertionError("engine did not finish")
    return tokens, torch.cat(rows) if rows else None
