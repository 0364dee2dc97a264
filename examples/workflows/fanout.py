"""Fan-out and fan-in: answer every question of a list in parallel (two at a time).

omniflow workflow register examples/workflows/fanout.py
omniflow run fanout --input questions='["what is RoPE?", "what is GQA?"]'
"""

from omniflow.dsl import Graph, VType, Workflow

fanout = Workflow("fanout", description="one llm call per question, then the list of answers")
questions = fanout.input("questions", VType.LIST)


def answer(g: Graph) -> dict:
    a = g.call("answer", "llm", "generate", prompt=g.input("item"), params={"max_tokens": 16})
    return {"answer": a["text"]}


each = fanout.map("each", over=questions, body=answer, max_parallel=2)
fanout.output("answers", each["answer"])
