"""Run-time routing: the branch taken depends on what the first model produced.

If the draft is long, a second call summarises it; otherwise the draft is the answer.
An optional ``style`` input, when given, adds a restyling step (presence check).

    omniflow workflow register examples/workflows/switch.py
    omniflow run route --input question="Explain paged attention" --input style=terse
"""

from omniflow.dsl import Graph, Retry, VType, Workflow

route = Workflow("route", description="summarise long drafts; restyle on request")
question = route.input("question", VType.TEXT)
style = route.input("style", VType.TEXT, optional=True)
draft = route.call(
    "draft", "llm", "generate", prompt=question, params={"max_tokens": 48}, retry=Retry(3)
)


def summarise(g: Graph) -> dict:
    short = g.call("summarise", "llm", "generate", prompt=g.input("text"), params={"max_tokens": 8})
    return {"answer": short["text"]}


def keep(g: Graph) -> dict:
    return {"answer": g.input("text")}


length = route.switch(
    "by_length",
    cases=[("long", draft["completion_tokens"].greater(6), summarise)],
    default=keep,
    outputs={"answer": VType.TEXT},
    text=draft["text"],
)


def restyle(g: Graph) -> dict:
    styled = g.call("restyle", "llm", "generate", prompt=g.input("text"), params={"max_tokens": 16})
    return {"answer": styled["text"]}


styled = route.switch(
    "by_style",
    cases=[("styled", style.present(), restyle)],
    default=keep,
    outputs={"answer": VType.TEXT},
    text=length["answer"],
)
route.output("answer", styled["answer"])
