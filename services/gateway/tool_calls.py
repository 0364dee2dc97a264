"""Tool calls on chat completions: what a request's ``tools`` and ``tool_choice`` make of
the prompt and the answer, and the answer's calls as OpenAI's ``message.tool_calls`` and
streamed ``delta.tool_calls``.

The tool format of the model (``OMNIFLOW_GATEWAY_TOOL_FORMATS``, ``omniflow.chat.tools``)
decides how tools reach the template and how ``auto`` answers are parsed. ``required``
and a named function constrain the answer with a JSON schema (as vLLM does), so their
calls always parse and their arguments validate against the function's ``parameters``.
A choice that made calls ends with ``finish_reason: tool_calls``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from omniflow.chat.tools import (
    CallStream,
    ToolCall,
    check_tools,
    forced_calls,
    forced_schema,
    new_call_id,
)
from omniflow.errors import InvalidArgument
from omniflow.sampling import StructuredOutput
from omniflow_services.gateway.errors import bad_request
from omniflow_services.gateway.protocol import (
    ChatCompletionRequest,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from omniflow_services.gateway.structured import Constraint


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools: what the template gets, the choice, and its constraint."""

    tools: list[dict[str, Any]]
    choice: str  # none | auto | required | function:<name>
    constraint: Constraint | None
    parallel: bool = True  # parallel_tool_calls: false keeps an auto answer's first call


def plan_tools(req: ChatCompletionRequest, tool_format: str) -> ToolPlan | None:
    """The plan of a request with ``tools`` (None without); 400s naming the field."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if tool_format == "none":
        raise bad_request(
            f"model {req.model!r} takes no tools here (OMNIFLOW_GATEWAY_TOOL_FORMATS)", "tools"
        )
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    choice_in = req.tool_choice
    raw = (
        choice_in.model_dump()
        if choice_in is not None and not isinstance(choice_in, str)
        else choice_in
    )
    try:
        choice = check_tools(tools, raw)
    except InvalidArgument as exc:
        raise bad_request(
            str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools"
        ) from None
    schema = forced_schema(tools, choice, req.parallel_tool_calls)
    constraint = None
    if schema is not None:
        constraint = Constraint(StructuredOutput("json", json.dumps(schema)), "tool_choice")
    return ToolPlan(tools, choice, constraint, req.parallel_tool_calls)


def _out_of(d: DeltaToolCall) -> ToolCallOut:
    fn = d.function or DeltaFunction()
    return ToolCallOut(
        id=d.id or "", function=FunctionCallOut(name=fn.name or "", arguments=fn.arguments or "")
    )


def _out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments)
    )


def whole_answer(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCallOut]]:
    """The content and the calls of a whole answer."""
    if plan.choice == "none":
        return text, []
    if plan.constraint is not None:
        calls = forced_calls(text, plan.choice)
        return (None, [_out(c) for c in calls]) if calls else (text, [])
    stream = StreamedCalls(plan)
    deltas = stream.feed(text) + stream.end()
    calls = [_out_of(c) for d in deltas for c in d.tool_calls or ()]
    if not calls:
        return text, []
    content = "".join(d.content or "" for d in deltas)
    return (content if content.strip() else None), calls


@dataclass(slots=True)
class StreamedCalls:
    """One streamed choice's deltas under a tool plan: content as it comes, a call as a
    delta holding its id, name and arguments (a named function's arguments in fragments,
    as they are written)."""

    plan: ToolPlan
    parser: CallStream = field(default_factory=CallStream)
    held: list[str] = field(default_factory=list)
    calls: int = 0
    named_id: str = ""

    def feed(self, text: str) -> list[Delta]:
        choice = self.plan.choice
        if choice == "none":
            return [Delta(content=text)] if text else []
        if choice.startswith("function:"):
            out = []
            if not self.named_id:
                self.named_id = new_call_id()
                self.calls = 1
                first = DeltaToolCall(
                    index=0,
                    id=self.named_id,
                    type="function",
                    function=DeltaFunction(name=choice.removeprefix("function:"), arguments=""),
                )
                out.append(Delta(tool_calls=[first]))
            if text:
                frag = DeltaToolCall(index=0, function=DeltaFunction(arguments=text))
                out.append(Delta(tool_calls=[frag]))
            return out
        if choice == "required":
            self.held.append(text)  # an array of calls: handed out whole at the end
            return []
        return self._pieces(self.parser.feed(text))

    def end(self) -> list[Delta]:
        if self.plan.choice == "required":
            calls = forced_calls("".join(self.held), "required")
            if not calls:
                return [Delta(content="".join(self.held))]
            return [self._call(c) for c in calls]
        if self.plan.choice in ("none",) or self.plan.choice.startswith("function:"):
            return []
        return self._pieces(self.parser.end())

    def _pieces(self, pieces: list[str | ToolCall]) -> list[Delta]:
        out = []
        for p in pieces:
            if isinstance(p, ToolCall):
                if self.plan.parallel or not self.calls:
                    out.append(self._call(p))
            elif p and not (self.calls and not p.strip()):
                out.append(Delta(content=p))
        return out

    def _call(self, call: ToolCall) -> Delta:
        d = DeltaToolCall(
            index=self.calls,
            id=call.id,
            type="function",
            function=DeltaFunction(name=call.name, arguments=call.arguments),
        )
        self.calls += 1
        return Delta(tool_calls=[d])

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` when this choice made calls and ended on its own."""
        return "tool_calls" if self.calls and reason == "stop" else reason


#: Template variables the request sets through its own fields, not chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
)


def template_options(req: ChatCompletionRequest, plan: ToolPlan | None) -> dict[str, Any]:
    """What the chat template is rendered with besides the messages (vLLM's meanings):
    ``add_generation_prompt``, ``continue_final_message`` (the last message is continued,
    not answered), ``chat_template_kwargs`` (more template variables) and the tools."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(
                f"chat_template_kwargs.{key}: set it with the request's own field",
                f"chat_template_kwargs.{key}",
            )
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "continue_final_message needs add_generation_prompt: false (continue the last "
            "message, or start a new assistant turn, not both)",
            "continue_final_message",
        )
    return {
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
        "template_kwargs": kwargs,
        "tools": plan.tools if plan is not None else None,
    }


def one_constraint(constraint: Constraint | None, plan: ToolPlan | None) -> Constraint | None:
    """The request's constraint: its response format's, or its forced tool choice's (never
    both)."""
    forced = plan.constraint if plan is not None else None
    if forced is not None and constraint is not None:
        raise bad_request(
            f"tool_choice {plan.choice.removeprefix('function:')!r} constrains the answer to "  # type: ignore[union-attr]
            f"tool calls; {constraint.param} cannot constrain it too",
            "tool_choice",
        )
    return forced or constraint


def refuse_on_workflow(req: ChatCompletionRequest) -> None:
    """A 400 naming a tool, constraint or template field sent to a workflow model: its nodes
    template and sample their own prompts, so these would be ignored."""
    given = {
        "tools": bool(req.tools),
        "tool_choice": req.tool_choice not in (None, "none"),
        "response_format": req.response_format is not None and req.response_format.type != "text",
        "structured_outputs": req.structured_outputs is not None,
        "chat_template_kwargs": bool(req.chat_template_kwargs),
        "add_generation_prompt": not req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
    }
    for name, set_ in given.items():
        if set_:
            raise bad_request(
                f"{name} does not apply to a workflow model (its nodes template and sample "
                "their own prompts); leave it unset",
                name,
            )
