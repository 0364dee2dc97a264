"""A static chain: draft an answer, then polish the draft while it is still being written.

omniflow workflow register examples/workflows/chain.py
omniflow run chain --input question="what is a KV cache?"

Both nodes are chat turns (node param ``chat``: the llm renders its model's own chat
template; an untemplated question makes an instruct model like SmolLM2 end at once). The
edge into ``polish`` streams: ``polish`` starts on the draft's first whole phrase, not
after all of it, and runs once per phrase (an llm's prompt is fed phrases, never single
tokens); its answers are joined.
"""

from omniflow.dsl import Retry, VType, Workflow

DRAFT = "You are a helpful assistant. Answer in two or three short sentences."
POLISH = (
    "Rewrite the text the user sends as one clear, correct sentence. "
    "Reply with the rewritten text only."
)

chain = Workflow("chain", description="draft, then polish (streaming edge)", deadline_ms=120_000)
question = chain.input("question", VType.TEXT, description="the user's question")
draft = chain.call(
    "draft",
    "llm",
    "generate",
    prompt=question,
    params={"chat": True, "system": DRAFT, "max_tokens": 48, "temperature": 0.0},
    retry=Retry(max_attempts=3),
    timeout_ms=60_000,
)
# The polish step starts on the draft's first phrase instead of waiting for all of it.
polish = chain.call(
    "polish",
    "llm",
    "generate",
    prompt=draft["text"].stream(),
    params={"chat": True, "system": POLISH, "max_tokens": 48, "temperature": 0.0},
    retry=Retry(max_attempts=3),
    timeout_ms=60_000,
)
chain.output("draft", draft["text"])
chain.output("answer", polish["text"])
