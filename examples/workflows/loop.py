"""A loop: keep refining the text until it is long enough (or 4 rounds ran).

Each round feeds the previous output back as the next prompt; ``iteration`` counts
rounds. With a real model the exit condition would be a judge's verdict; here it is the
number of generated tokens, which every model reports.

    omniflow workflow register examples/workflows/loop.py
    omniflow run refine --input text="a haiku about caches"
"""

from omniflow.dsl import Graph, Retry, VType, Workflow

refine = Workflow("refine", description="refine until long enough", deadline_ms=120_000)
text = refine.input("text", VType.TEXT)


def round_(g: Graph) -> dict:
    step = g.call(
        "rewrite",
        "llm",
        "generate",
        prompt=g.input("text"),
        params={"max_tokens": 64},
        retry=Retry(3),
    )
    return {"text": step["text"], "tokens": step["completion_tokens"]}


loop = refine.loop(
    "rounds",
    body=round_,
    until=lambda out: out["tokens"].greater(9),
    max_iterations=4,
    text=text,
)
refine.output("text", loop["text"])
refine.output("tokens", loop["tokens"])
