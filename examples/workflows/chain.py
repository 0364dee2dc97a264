"""A static chain: draft an answer, then rewrite the draft while it is still streaming.

omniflow workflow register examples/workflows/chain.py
omniflow run chain --input question="What is a KV cache?"
"""

from omniflow.dsl import Retry, VType, Workflow

chain = Workflow("chain", description="draft, then polish (streaming edge)", deadline_ms=60_000)
question = chain.input("question", VType.TEXT, description="the user's question")
draft = chain.call(
    "draft",
    "llm",
    "generate",
    prompt=question,
    params={"max_tokens": 32, "temperature": 0.0},
    retry=Retry(max_attempts=3),
    timeout_ms=30_000,
)
# The polish step starts on the draft's first chunk instead of waiting for all of it.
polish = chain.call(
    "polish",
    "llm",
    "generate",
    prompt=draft["text"].stream(),
    params={"max_tokens": 64},
    retry=Retry(max_attempts=3),
)
chain.output("draft", draft["text"])
chain.output("answer", polish["text"])
