"""Contiguous K/V of the decode batch, kept from one step to the next.

Decode attention needs each request's keys as one ``[kv_heads, context, head_dim]`` run, but
the pool holds them in pages scattered over the pool. Gathering every request's pages for
every layer at every step moves the whole batch's KV through memory twice per token (copy
out, then attention reads the copy); at 32 requests that was as expensive as the matmuls.
While the set of decoding requests stays the same, each step adds exactly one token per
request, so the gathered copy is kept and only the new token is written into it. Any change
(a request joins, is preempted, or outgrows the reserved width) rebuilds the copy from the
pool with one gather, which is what every step did before. Requests that leave from either
end of the batch (the first admitted finish first when they ask for as many tokens) cost
nothing: the rest are a contiguous run of the copy's rows, used in place.

The copy costs memory (layers x 2 x batch x width); above ``max_bytes`` the engine falls
back to gathering every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tokens reserved past the longest context, so that a rebuild is needed every SLACK steps
# at most while the batch is unchanged.
SLACK = 32


@dataclass(slots=True)
class DecodePlan:
    """How this forward's decode rows attend: into ``k``/``v`` [layers, H, B, width, D].

    Heads outermost is the layout a page gather produces (so a rebuild is one plain copy)
    and, viewed as [B, H, width, D], measured faster in CPU SDPA than batch-major storage.
    """

    k: torch.Tensor
    v: torch.Tensor
    rebuild: bool
    rows: torch.Tensor  # arange(B)
    new_pos: torch.Tensor  # position of each row's new token (context - 1)
    mask: torch.Tensor  # [B, 1, 1, used] keys visible to each row
    used: int  # key columns attention reads this step (the longest context, rounded up)
    table: torch.Tensor | None  # [B, width / page_size] pages, padded, when rebuilding


class DecodeKV:
    """The decode batch's contiguous K/V across steps (one per model)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_bytes: int,
    ) -> None:
        self.shape = (num_layers, kv_heads, head_dim)
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.max_bytes = max_bytes
        self._ids: tuple[int, ...] = ()
        self._lens: list[int] = []
        self._row0 = 0  # the copy's row of self._ids[0]
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.rebuilds = 0

    def _bytes(self, batch: int, width: int) -> int:
        layers, heads, dim = self.shape
        return 2 * layers * batch * heads * width * dim * torch.finfo(self.dtype).bits // 8

    def plan(
        self, ids: tuple[int, ...], ctx: list[int], tables: list[list[int]]
    ) -> DecodePlan | None:
        """The plan for decode rows ``ids`` at contexts ``ctx`` (None: gather instead)."""
        ps = self.page_size
        dev = self.device
        longest = max(ctx)
        k, v = self._k, self._v
        old = self._ids
        # The rows of `ids` in the last batch: all of them, or a contiguous run of them.
        at = old.index(ids[0]) if k is not None and ids[0] in old else -1
        keep = (
            at >= 0
            and old[at : at + len(ids)] == ids
            and longest <= k.shape[3]
            and all(c - 1 == n for c, n in zip(ctx, self._lens[at:], strict=False))
        )
        table = None
        if keep:
            self._row0 += at
        else:
            self._row0 = 0
            width = -(-(longest + SLACK) // ps) * ps
            if self._bytes(len(ids), width) > self.max_bytes:
                self.clear()
                return None
            layers, heads, dim = self.shape
            shape = (layers, heads, len(ids), width, dim)
            if k is None or tuple(k.shape) != shape:
                k = torch.empty(shape, dtype=self.dtype, device=dev)
                v = torch.empty(shape, dtype=self.dtype, device=dev)
            pages = width // ps
            padded = [t + [t[-1]] * (pages - len(t)) for t in tables]
            table = torch.tensor(padded, dtype=torch.long, device=dev)
            self._k, self._v = k, v
            self.rebuilds += 1
        assert k is not None and v is not None
        self._ids, self._lens = ids, list(ctx)
        used = min(-(-longest // ps) * ps, k.shape[3])
        rows = slice(self._row0, self._row0 + len(ids))
        ctx_t = torch.tensor(ctx, device=dev)
        mask = (torch.arange(used, device=dev)[None, :] < ctx_t[:, None])[:, None, None, :]
        return DecodePlan(
            k=k[:, :, rows],
            v=v[:, :, rows],
            rebuild=not keep,
            rows=torch.arange(len(ids), device=dev),
            new_pos=ctx_t - 1,
            mask=mask,
            used=used,
            table=table,
        )

    def clear(self) -> None:
        self._ids, self._lens, self._row0 = (), [], 0
        self._k = self._v = None
