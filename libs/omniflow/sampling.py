"""The one sampling contract: what a generation may do, checked once, the same at every hop.

The gateway builds it from an OpenAI request (``to_sampling_params`` on the protocol
models), the coordinator from a workflow node's params (``SamplingParams.from_params``), the
worker from the proto (``SamplingParams.from_proto``); every engine backend reads it (the
built-in engine's batched sampler, the vLLM and SGLang mappings). Fields and meanings are
vLLM's (``vllm/sampling_params.py``); every default is decided here, once:

- ``max_tokens`` unset (``None``, 0 on the wire): up to the context, that is
  ``context - prompt`` tokens, decided by ``resolved`` where the context is known (the
  engine); more than that room is cut to it, more than the whole context is refused naming
  the field (vLLM 0.32's rules).
- a workflow node's params that leave them unset get ``NODE_DEFAULTS`` (greedy, 64 tokens):
  a node is a step of a pipeline, not a chat.

Nothing here needs torch: the gateway and the coordinator import it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from omniflow.api.common.v1 import common_pb2
from omniflow.errors import InvalidArgument

GREEDY_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
LOGIT_BIAS_LIMIT = 100.0  # each bias is clamped to [-100, 100], as OpenAI and vLLM do
MAX_WIRE_TOKENS = 2**32 - 1  # max_tokens / min_tokens travel as uint32

#: What a workflow llm node generates when its params leave these unset.
NODE_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0}

#: What ``StructuredOutput.kind`` may be, and what its ``spec`` holds.
STRUCTURED_KINDS = {
    "json": "a JSON-schema text",
    "json_object": "empty (any JSON object)",
    "regex": "the regex",
    "choice": "a JSON list of strings",
    "grammar": "an EBNF grammar text",
}


class SamplingError(InvalidArgument):
    """A sampling field out of its range; ``field`` names it (the gateway's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text, enforced while decoding (by the worker's grammar
    engine). ``kind`` is a key of ``STRUCTURED_KINDS``; ``spec`` is what that key names."""

    kind: str
    spec: str = ""

    def validate(self, field: str = "structured") -> None:
        """Raise ``InvalidArgument`` naming ``field`` for an unknown kind or a spec of the
        wrong shape. Whether a schema, regex or grammar compiles is the grammar engine's
        check."""
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingError(
                field, f"{field}: kind {self.kind!r} is not one of {', '.join(STRUCTURED_KINDS)}"
            )
        if self.kind == "json_object":
            if self.spec:
                raise SamplingError(field, f"{field}: kind 'json_object' takes no spec")
            return
        if not self.spec:
            raise SamplingError(
                field, f"{field}: kind {self.kind!r} needs a spec ({STRUCTURED_KINDS[self.kind]})"
            )
        if self.kind in ("json", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError:
                raise SamplingError(
                    field,
                    f"{field}: the spec of kind {self.kind!r} is not valid JSON "
                    f"({STRUCTURED_KINDS[self.kind]})",
                ) from None
            if self.kind == "json" and not isinstance(value, dict | bool):
                raise SamplingError(field, f"{field}: a JSON schema is an object or a boolean")
            if self.kind == "choice" and (
                not isinstance(value, list)
                or not value
                or not all(isinstance(v, str) for v in value)
            ):
                raise SamplingError(field, f"{field}: choice takes a non-empty list of strings")

    def to_proto(self) -> common_pb2.StructuredOutput:
        return common_pb2.StructuredOutput(kind=self.kind, spec=self.spec)

    @staticmethod
    def from_proto(m: common_pb2.StructuredOutput) -> StructuredOutput:
        return StructuredOutput(kind=m.kind, spec=m.spec)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next tokens, with vLLM's meanings.

    ``temperature`` 0 means greedy. ``top_k`` 0 disables top-k; ``top_p`` 1 and ``min_p`` 0
    disable those filters; ``repetition_penalty`` 1 disables it (a seen token's positive
    logit is divided by it, a negative one multiplied, prompt and output tokens alike).
    ``presence_penalty`` and ``frequency_penalty`` follow OpenAI over the generated tokens.
    ``logit_bias`` adds (token id, bias) to the logits before penalties and sampling.
    ``seed`` makes sampling reproducible per request. ``logprobs`` returns each sampled
    token's log-probability and ``top_logprobs`` that many alternatives, of the model's raw
    distribution (vLLM's default). Generation stops at ``max_tokens``, at an EOS id (unless
    ``ignore_eos``), at any of ``stop_token_ids`` or when the text contains one of ``stop``;
    none of these stops the first ``min_tokens`` tokens. The stop string (or the stop
    token's text) is cut from the text unless ``include_stop_str_in_output``; special
    tokens are left out of the text when ``skip_special_tokens``. ``structured`` constrains
    the output (``StructuredOutput``).
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None

    # ------------------------------------------------------------ reading

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    # ------------------------------------------------------------ checking

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``SamplingError`` (an ``InvalidArgument``) naming the first bad field and its
        accepted range. Token ids are checked against ``vocab_size`` when it is given."""
        m = self.max_tokens
        if m is not None and not isinstance(m, bool) and isinstance(m, int):
            if m < 1:
                raise SamplingError("max_tokens", f"max_tokens must be >= 1, got {m}")
            if m > MAX_WIRE_TOKENS:
                raise SamplingError(
                    "max_tokens",
                    f"max_tokens is too large: {m} (the context length bounds it; no model "
                    f"here takes more than {MAX_WIRE_TOKENS})",
                )
        _int_range("max_tokens", m, 1, MAX_WIRE_TOKENS, none_ok=True)
        _num_range("temperature", self.temperature, 0.0, 100.0)
        top = vocab_size if vocab_size is not None else MAX_WIRE_TOKENS
        _int_range("top_k", self.top_k, 0, top, note=" (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _num_range("min_p", self.min_p, 0.0, 1.0)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise SamplingError(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            _num_range(name, getattr(self, name), -2.0, 2.0, note=" (0 disables it)")
        _int_range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise SamplingError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise SamplingError("seed", f"seed must be in [0, 2^63), got {self.seed}")
        _int_range("min_tokens", self.min_tokens, 0, MAX_WIRE_TOKENS)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
            )
        if len(self.stop) > MAX_STOP_STRINGS or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            raise SamplingError(
                "stop",
                f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}",
            )
        for t in self.stop_token_ids:
            _token("stop_token_ids", t, vocab_size, "stop token id")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(
                "logit_bias",
                f"logit_bias holds {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
            )
        for t, b in self.logit_bias:
            _token("logit_bias", t, vocab_size, "logit_bias token id")
            _num_range("logit_bias", b, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT, what="a bias")
        if self.structured is not None:
            self.structured.validate()

    def resolved(self, prompt_len: int, context_len: int) -> SamplingParams:
        """These params with ``max_tokens`` decided for a prompt of ``prompt_len`` tokens in a
        context of ``context_len``, as vLLM 0.32 decides it: unset means all the room the
        prompt leaves; more than the room is cut to the room; more than the whole context is
        a ``SamplingError`` naming ``max_tokens`` (and a prompt that leaves no room one
        naming the prompt)."""
        if self.max_tokens is not None and self.max_tokens > context_len:
            raise SamplingError(
                "max_tokens",
                f"max_tokens={self.max_tokens} cannot be greater than the context length "
                f"{context_len}: ask for fewer output tokens",
            )
        room = context_len - prompt_len
        if room < 1:
            raise SamplingError(
                "prompt",
                f"the prompt has {prompt_len} tokens; the context length is {context_len} "
                "(prompt must be shorter to leave room for output)",
            )
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        if self.min_tokens > max_tokens:
            raise SamplingError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) is more than the {max_tokens} tokens the "
                f"context length {context_len} leaves after the {prompt_len}-token prompt",
            )
        return self if max_tokens == self.max_tokens else replace(self, max_tokens=max_tokens)

    def with_eos(self, eos_token_ids: tuple[int, ...] | list[int]) -> SamplingParams:
        """These params with the model's EOS ids among the stop ids, unless ``ignore_eos``
        (vLLM adds generation_config's ``eos_token_id`` so: every one of them stops)."""
        if self.ignore_eos or not eos_token_ids:
            return self
        ids = tuple(dict.fromkeys((*self.stop_token_ids, *eos_token_ids)))
        return replace(self, stop_token_ids=ids)

    # ------------------------------------------------------------ building

    @classmethod
    def build(cls, **values: Any) -> SamplingParams:
        """The params from loose values (JSON: ``stop`` a string or a list, ``logit_bias`` a
        mapping with string keys, ``top_k`` -1 for off), validated; ``None`` values take
        the default."""
        given = {k: v for k, v in values.items() if v is not None}
        unknown = sorted(set(given) - set(FIELDS))
        if unknown:
            raise SamplingError(unknown[0], f"{unknown[0]} is not a sampling field")
        stop = given.get("stop")
        if isinstance(stop, str):
            given["stop"] = (stop,)
        elif isinstance(stop, list | tuple):
            given["stop"] = tuple(stop)
        elif stop is not None:
            raise SamplingError("stop", "stop must be a string or a list of strings")
        if isinstance(given.get("stop_token_ids"), list | tuple):
            given["stop_token_ids"] = tuple(given["stop_token_ids"])
        if "logit_bias" in given:
            given["logit_bias"] = _bias_pairs(given["logit_bias"])
        if given.get("top_k") == -1:
            given["top_k"] = 0
        for name in _INT_FIELDS:
            if name in given and (
                isinstance(given[name], bool) or not isinstance(given[name], int)
            ):
                raise SamplingError(name, f"{name} must be an integer, got {given[name]!r}")
        for name in _FLOAT_FIELDS:
            v = given.get(name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int | float):
                    raise SamplingError(name, f"{name} must be a number, got {v!r}")
                given[name] = float(v)
        for name in _BOOL_FIELDS:
            if name in given and not isinstance(given[name], bool):
                raise SamplingError(name, f"{name} must be true or false, got {given[name]!r}")
        structured = given.get("structured")
        if isinstance(structured, Mapping):  # JSON: {"kind": ..., "spec": ...}
            extra = set(structured) - {"kind", "spec"}
            kind, spec = structured.get("kind"), structured.get("spec", "")
            if extra or not isinstance(kind, str) or not isinstance(spec, str):
                raise SamplingError(
                    "structured", "structured takes {kind: string, spec: string} only"
                )
            given["structured"] = StructuredOutput(kind, spec)
        elif structured is not None and not isinstance(structured, StructuredOutput):
            raise SamplingError("structured", "structured must be {kind, spec}")
        params = cls(**given)
        params.validate()
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> SamplingParams:
        """A workflow node's sampling from its params (other params, such as ``chat`` or
        ``system``, are not sampling and are left alone); unset fields take
        ``NODE_DEFAULTS``, then the contract's defaults. Errors name ``param '<field>'``."""
        values = {**NODE_DEFAULTS, **{k: params[k] for k in FIELDS if k in params}}
        if values.get("max_tokens") == 0:  # 0, as on the wire: the whole context
            values["max_tokens"] = None
        try:
            return cls.build(**values)
        except SamplingError as exc:
            raise SamplingError(exc.field, f"param {exc.field!r}: {exc}") from None

    # ------------------------------------------------------------ the wire

    def to_proto(self) -> common_pb2.SamplingParams:
        """The proto of these params (every field set; validate first: the wire's integers
        are unsigned 32- and 64-bit)."""
        sp = common_pb2.SamplingParams(
            max_tokens=self.max_tokens or 0,
            stop_token_ids=list(self.stop_token_ids),
            stop=list(self.stop),
            logit_bias=dict(self.logit_bias),
            **{name: getattr(self, name) for name in _WIRE_AS_IS},
        )
        if self.seed is not None:
            sp.seed = self.seed
        if self.structured is not None:
            sp.structured.CopyFrom(self.structured.to_proto())
        return sp

    @staticmethod
    def from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
        """The params of a proto. Its zeros keep their documented wire meaning (the proto
        comments): max_tokens 0 unset, top_p and repetition_penalty 0 off, temperature 0
        greedy; skip_special_tokens absent is true. Not validated here (the engine does,
        with its vocabulary)."""
        return SamplingParams(
            max_tokens=p.max_tokens or None,
            temperature=_f32(p.temperature),
            top_k=p.top_k,
            top_p=_f32(p.top_p) if p.top_p else 1.0,
            min_p=_f32(p.min_p),
            repetition_penalty=_f32(p.repetition_penalty) if p.repetition_penalty else 1.0,
            seed=p.seed if p.HasField("seed") else None,
            stop_token_ids=tuple(p.stop_token_ids),
            stop=tuple(p.stop),
            ignore_eos=p.ignore_eos,
            presence_penalty=_f32(p.presence_penalty),
            frequency_penalty=_f32(p.frequency_penalty),
            logprobs=p.logprobs,
            top_logprobs=p.top_logprobs,
            min_tokens=p.min_tokens,
            logit_bias=tuple(sorted((int(t), _f32(b)) for t, b in p.logit_bias.items())),
            include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens
            if p.HasField("skip_special_tokens")
            else True,
            structured=StructuredOutput.from_proto(p.structured)
            if p.HasField("structured")
            else None,
        )


#: Every field of the contract, in declaration order.
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
_INT_FIELDS = ("max_tokens", "top_k", "seed", "top_logprobs", "min_tokens")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens")
#: The fields the proto carries as they are (same name, same value).
_WIRE_AS_IS = (*_FLOAT_FIELDS, *_BOOL_FIELDS, "top_k", "top_logprobs", "min_tokens")


def _f32(x: float) -> float:
    """A float32 off the wire as the decimal it was sent as (0.7 arrives as 0.69999998):
    seven significant digits identify a float32's decimal, so a round trip is exact."""
    return float(f"{x:.7g}")


def _int_range(
    name: str, v: Any, lo: int, hi: int, *, none_ok: bool = False, note: str = ""
) -> None:
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SamplingError(name, f"{name} must be in [{lo}, {hi}]{note}, got {v!r}")


def _num_range(name: str, v: Any, lo: float, hi: float, *, note: str = "", what: str = "") -> None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or not lo <= v <= hi:
        label = f"{name}: {what}" if what else name
        raise SamplingError(name, f"{label} must be in [{lo:g}, {hi:g}]{note}, got {v!r}")


def _token(name: str, t: Any, vocab_size: int | None, what: str) -> None:
    if isinstance(t, bool) or not isinstance(t, int) or t < 0 or t > MAX_WIRE_TOKENS:
        raise SamplingError(name, f"{what} {t!r} is not a token id (an integer >= 0)")
    if vocab_size is not None and t >= vocab_size:
        raise SamplingError(name, f"{what} {t} is outside the vocabulary [0, {vocab_size})")


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id, as a string or an int → bias) as sorted pairs, each
    bias clamped to [-100, 100] as OpenAI and vLLM do."""
    if isinstance(bias, tuple):
        items = list(bias)
    elif isinstance(bias, Mapping):
        items = list(bias.items())
    else:
        raise SamplingError("logit_bias", "logit_bias must map token ids to numbers")
    out: dict[int, float] = {}
    for key, value in items:
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise SamplingError(
                "logit_bias", f"logit_bias key {key!r} is not a token id (an integer)"
            ) from None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise SamplingError("logit_bias", f"logit_bias[{key!r}] must be a number")
        out[tid] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return tuple(sorted(out.items()))
