"""Workloads of the KV-aware routing bench: seeded, whole conversations known in advance.

The echo worker's reply to a prompt is deterministic (``"echo: " + prompt``, cut at
``max_tokens`` words), so every turn's prompt — the whole history: system prompt,
earlier turns and replies, the new message — is fixed by the seed before the run. That
lets the bench size the caches against the workload's distinct blocks, and lets every
strategy serve exactly the same requests.

- ``chat``: sessions arrive as a Poisson process; each picks one of a few system prompts
  (apps), opens with a message, then asks 2-6 turns with exponential think time.
- ``docs``: the same, but sessions come in groups that share a long document (the
  prefix after a short system prompt); group sizes follow a Zipf law, so one document
  is popular and piling its sessions on one worker has a price.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from omniflow.kv.blocks import block_hashes
from omniflow_services.worker.echo.engine import ECHO_LAYOUT

WORDS = (
    "cache page token image voice layer head block route batch prefix query tensor "
    "model shard queue drain spill tier agent index lease epoch graph node edge loop"
).split()


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: str
    max_tokens: int
    think_s: float  # pause before sending this turn


@dataclass(frozen=True, slots=True)
class Session:
    key: str
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def distinct_blocks(self) -> int:
        seen: set[bytes] = set()
        for s in self.sessions:
            for t in s.turns:
                data = list(t.prompt.encode())
                seen.update(block_hashes(ECHO_LAYOUT.namespace, data, ECHO_LAYOUT.page_size))
        return len(seen)

    def prompt_bytes(self) -> int:
        return sum(len(t.prompt.encode()) for s in self.sessions for t in s.turns)


def _text(rng: random.Random, mean: float) -> str:
    """Random words, about ``mean`` bytes (log-normal, so lengths vary realistically)."""
    n = max(int(rng.lognormvariate(0, 0.5) * mean / 1.13), 8)
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def _reply(prompt: str, max_tokens: int) -> str:
    return " ".join(f"echo: {prompt}".split(" ")[:max_tokens])


def _conversation(
    rng: random.Random, head: str, n_turns: int, first_mean: float, think_mean_s: float
) -> tuple[Turn, ...]:
    history = head
    turns = []
    for t in range(n_turns):
        ask = _text(rng, first_mean if t == 0 else 300)
        history += f"\nuser: {ask}\nassistant:"
        max_tokens = rng.randint(8, 32)
        think = 0.0 if t == 0 else rng.expovariate(1 / think_mean_s)
        turns.append(Turn(history, max_tokens, think))
        history += " " + _reply(history, max_tokens)
    return tuple(turns)


def chat(seed: int, sessions: int, rate: float, think_s: float, apps: int = 3) -> Workload:
    """Multi-turn chat: ``sessions`` arriving at ``rate`` per second over ``apps`` system
    prompts; each turn resends the whole history."""
    rng = random.Random(seed)
    systems = [f"[app {a}] " + _text(rng, 1200) for a in range(apps)]
    out = []
    clock = 0.0
    for i in range(sessions):
        clock += rng.expovariate(rate)
        head = rng.choice(systems)
        turns = _conversation(rng, head, rng.randint(2, 6), 600, think_s)
        out.append(Session(f"chat-{seed}-{i}", clock, turns))
    return Workload("chat", tuple(out))


def docs(seed: int, sessions: int, rate: float, think_s: float, documents: int = 6) -> Workload:
    """Sessions in groups over ``documents`` long documents (Zipf popularity), each turn
    resending system prompt + document + the conversation so far."""
    rng = random.Random(seed + 10_000)
    system = "[reader] " + _text(rng, 400)
    texts = [f"<doc {d}> " + _text(rng, 10_000) for d in range(documents)]
    popularity = [1 / (d + 1) for d in range(documents)]
    out = []
    clock = 0.0
    for i in range(sessions):
        clock += rng.expovariate(rate)
        d = rng.choices(range(documents), weights=popularity)[0]
        turns = _conversation(rng, f"{system}\n{texts[d]}", rng.randint(2, 4), 200, think_s)
        out.append(Session(f"doc-session-{seed}-{i}", clock, turns))
    return Workload("docs", tuple(out))
