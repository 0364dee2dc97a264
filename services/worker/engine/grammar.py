"""Structured output enforced while decoding, with xgrammar (what vLLM and SGLang use).

A request's ``StructuredOutput`` (``omniflow.sampling``) is compiled once per distinct
(kind, spec) for this model's tokenizer and kept in a small LRU; a request holds its own
matcher (:class:`GrammarState`; each choice of ``n > 1`` is its own request, so its own
matcher). Each step the engine fills one token bitmask for the rows of the batch that
carry a grammar and applies it to those logits rows in place (the others are untouched),
samples, and hands every sampled token back to its matcher. When a matcher has accepted a
stop token (once the grammar is complete only those are left unmasked) the request ends
with ``stop``, ``ignore_eos`` or not.

Kinds (as vLLM's structured outputs over xgrammar): ``json`` a JSON schema, compiled in
xgrammar's strict mode (no properties the schema does not name), ``json_object`` any JSON
object, ``regex``, ``choice`` (one of a list of strings, as an EBNF alternation) and
``grammar`` (xgrammar's EBNF). JSON may carry whitespace between its tokens, as vLLM's
default allows, but at most ``MAX_WHITESPACE`` characters in one place: a small model is
not free to pad it with whitespace until it runs out of tokens.

A spec that does not compile raises ``InvalidArgument`` naming ``structured.<kind>``
before the request is queued.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from omniflow.errors import InvalidArgument
from omniflow.sampling import StructuredOutput

CACHE_ENTRIES = 64
MAX_WHITESPACE = 16  # characters of whitespace in one place of a JSON answer
_WHERE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidArgument(
            "structured output needs xgrammar on the worker (pip install 'omniflow[worker]')"
        ) from None
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher: which tokens may come next, and whether it is complete."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar refused it."""
        return bool(self.matcher.accept_token(token))

    @property
    def done(self) -> bool:
        """Whether the grammar has accepted a stop token: the answer is complete. (Once it
        can take nothing more, the mask leaves only the stop tokens, so this comes next.)"""
        return bool(self.matcher.is_terminated())


class Grammars:
    """Compiled grammars of one model's tokenizer (cached) and the matchers made from them.

    ``tokenizer`` is the model's ``tokenizers.Tokenizer``; ``vocab_size`` the width of the
    model's logits (it may pad past the tokenizer's ids: those are always masked);
    ``stop_token_ids`` the ids that end a generation once the grammar is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        #: Requests by how their constraint was served: compiled for them, cached (a hit),
        #: failed (refused).
        self.counts = {"compiled": 0, "cached": 0, "failed": 0}
        self._fresh: set[tuple[str, str]] = set()  # compiled, not yet counted for a request

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                from transformers import PreTrainedTokenizerFast

                if self._tokenizer is None:
                    raise InvalidArgument("structured output needs the model's tokenizer.json")
                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self._stop or None
                )
                # Its own cache is off: ours keeps a bounded number of entries.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar of ``so`` (from the cache when seen before)."""
        key = (so.kind, so.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            so.validate(f"structured.{so.kind}")
            compiled = self._compile(self._get_compiler(), so)
        except InvalidArgument:
            self.counts["failed"] += 1
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
            self.counts["failed"] += 1
            # xgrammar's messages start with a time and its C++ source line: drop those.
            detail = _WHERE.sub("", str(exc).strip().split("\n")[0]) or type(exc).__name__
            raise InvalidArgument(
                f"structured.{so.kind}: the {_NOUNS[so.kind]} does not compile: {detail}"
            ) from None
        with self._lock:
            self._fresh.add(key)
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: Any, so: StructuredOutput) -> Any:
        if so.kind in ("json", "json_object"):
            schema = so.spec if so.kind == "json" else '{"type": "object"}'
            return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)
        if so.kind == "regex":
            return compiler.compile_regex(so.spec)
        if so.kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(so.spec)))
        return compiler.compile_grammar(so.spec)

    def matcher(self, so: StructuredOutput) -> GrammarState:
        """A fresh matcher for one request (compiling ``so`` unless cached)."""
        compiled = self.compile(so)
        key = (so.kind, so.spec)
        with self._lock:
            fresh = key in self._fresh
            self._fresh.discard(key)
            self.counts["compiled" if fresh else "cached"] += 1
        return GrammarState(_xgr().GrammarMatcher(compiled))


_NOUNS = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def apply_grammars(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Mask, in place, the logits rows whose request has a grammar: every token its matcher
    cannot accept next becomes -inf. Rows without one are not touched."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(states), logits.shape[-1])
    used = []
    for i in rows:
        state = states[i]
        assert state is not None
        if state.matcher.fill_next_token_bitmask(bitmask, i):
            used.append(i)
    if not used:
        return
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=used)
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=used)


def grammar_ended(state: GrammarState | None, token: int) -> bool:
    """Hand a sampled token to a request's matcher: True when the answer is complete (the
    grammar accepted a stop token) or the grammar refused the token (it cannot go on)."""
    if state is None:
        return False
    return not state.accept(token) or state.done
