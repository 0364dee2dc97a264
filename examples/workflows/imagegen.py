"""The image pipeline: a prompt → the llm rewrites it → diffusion on the same backbone → PNG.

1. ``detail`` (a loop, at most 3 rounds): the llm rewrites the request as an image prompt;
   a rewrite of too few tokens "needs more detail" and goes back to the llm, which
   elaborates on its own last answer.
2. ``refusal`` (a switch): when the rewriter refuses or says nothing (a small chat model
   often answers "I'm sorry, I can't create images"), the user's own words are drawn.
3. ``prefill``: the final prompt is prefilled on an llm worker with ``prefill_only``: its
   reply comes once the prompt's full KV pages are stored in that node's kv-agent, and it
   returns them as ``pages`` (namespace, block hashes, token ids).
4. ``draw``: ``diffusion.generate_image`` on the same backbone pulls those pages instead of
   recomputing the prompt. Its Pick carries the pages' block hashes, so ``kv_aware`` places
   it on the diffusion worker whose node already holds them (a pull within the node, from
   the agent's shared memory, not across nodes).

    omniflow workflow register examples/workflows/imagegen.py
    omniflow run imagegen --input prompt="a lighthouse at dusk" --input steps=4

Through the gateway: ``POST /v1/images/generations`` with ``"model": "workflow:imagegen"``.
``build()`` makes variants for benchmarks (another placement, or no page reuse).
"""

from omniflow.dsl import Graph, Retry, VType, Workflow

REWRITER = (
    "You write prompts for an image generator. Rewrite the request as one vivid sentence "
    "naming the subject, the setting, the light and the style. Reply with the prompt only."
)
# A rewrite this short (in tokens) needs more detail: the llm is asked again.
MIN_REWRITE_TOKENS = 12
DETAIL_ROUNDS = 3
REFUSALS = ("sorry", "Sorry", "I cannot", "I can't", "I can\u2019t", "I'm unable", "I am unable")


def build(
    name: str = "imagegen", *, placement: str = "kv_aware", reuse_pages: bool = True
) -> Workflow:
    """The imagegen workflow; ``placement``: the draw call's routing strategy;
    ``reuse_pages=False``: the diffusion worker prefills the prompt itself (no prefill_only
    call), for comparison."""
    wf = Workflow(name, description="prompt → llm rewrite → diffusion on its pages → PNG",
                  deadline_ms=300_000)  # fmt: skip
    prompt = wf.input("prompt", VType.TEXT, description="what to draw")
    width = wf.input("width", VType.INT, optional=True, description="pixels (default: model's)")
    height = wf.input("height", VType.INT, optional=True, description="pixels")
    steps = wf.input("steps", VType.INT, optional=True, description="denoising steps")
    seed = wf.input("seed", VType.INT, optional=True, description="noise seed")

    def rewrite(g: Graph) -> dict:
        step = g.call(
            "rewrite",
            "llm",
            "generate",
            prompt=g.input("text"),
            params={"chat": True, "system": REWRITER, "max_tokens": 48, "temperature": 0.0},
            retry=Retry(3),
            timeout_ms=60_000,
        )
        return {"text": step["text"], "tokens": step["completion_tokens"]}

    detail = wf.loop(
        "detail",
        body=rewrite,
        until=lambda out: out["tokens"].greater(MIN_REWRITE_TOKENS - 1),
        max_iterations=DETAIL_ROUNDS,
        text=prompt,
    )

    def own_words(g: Graph) -> dict:
        return {"prompt": g.input("asked")}

    def rewritten(g: Graph) -> dict:
        return {"prompt": g.input("text")}

    cases = [("empty", detail["text"].equals(""), own_words)]
    for i, words in enumerate(REFUSALS):
        cases.append((f"refused_{i}", detail["text"].contains(words), own_words))
    final = wf.switch(
        "refusal",
        cases=cases,
        default=rewritten,
        outputs={"prompt": VType.TEXT},
        text=detail["text"],
        asked=prompt,
    )
    size = {"width": width, "height": height, "steps": steps, "seed": seed}
    if reuse_pages:
        prefill = wf.call(
            "prefill",
            "llm",
            "generate",
            prompt=final["prompt"],
            params={"chat": True, "prefill_only": True},
            retry=Retry(3),
            timeout_ms=60_000,
        )
        draw = wf.call("draw", "diffusion", "generate_image", pages=prefill["pages"],
                       strategy=placement, retry=Retry(2), timeout_ms=240_000, **size)  # fmt: skip
    else:
        draw = wf.call("draw", "diffusion", "generate_image", prompt=final["prompt"],
                       strategy=placement, retry=Retry(2), timeout_ms=240_000, **size)  # fmt: skip
    wf.output("image", draw["image"], VType.BYTES)
    wf.output("prompt_used", final["prompt"])
    wf.output("width", draw["width"])
    wf.output("height", draw["height"])
    wf.output("prompt_tokens", draw["prompt_tokens"])
    wf.output("cached_prompt_tokens", draw["cached_prompt_tokens"])
    return wf


imagegen = build()
WORKFLOWS = [imagegen]
