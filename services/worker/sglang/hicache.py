"""A HiCache storage backend (SGLang's L3 tier) that keeps pages in the Omni-Flow kv-agents.

Loaded by SGLang as a dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "omniflow",
        "module_path": "omniflow_services.worker.sglang.hicache",
        "class_name": "OmniflowHiCacheStorage",
        "agent_address": "127.0.0.1:7301", "index_address": "127.0.0.1:7201",
        "model_id": "Qwen2.5-0.5B"}'

so every SGLang worker of a model shares one distributed, tiered page cache with the
others through the node agents (``sglang.backend.SGLangRole`` writes this for you).

SGLang API read (sgl-project/sglang main, Nov 2026; sglang 0.5.23 on PyPI):
``python/sglang/srt/mem_cache/hicache_storage.py`` (``HiCacheStorage``: abstract
``get``/``batch_get``/``set``/``batch_set``/``exists``; ``batch_exists`` returns the
leading hit count; ``batch_get_v1``/``batch_set_v1`` take host-pool indices and are used
when the extra config sets ``"interface_v1": 1``; ``register_mem_pool_host`` is called
right after construction), ``python/sglang/srt/mem_cache/storage/backend_factory.py``
(``dynamic`` → ``backend_class(storage_config, kwargs)``),
``python/sglang/srt/managers/cache_controller.py`` (``_generic_page_get`` passes
``get_dummy_flat_data_page()`` targets and calls ``set_from_flat_data_page`` with what
``batch_get`` returns; ``_generic_page_set`` passes ``get_data_page(i, flat=True)``), and
``MHATokenToKVPoolHost`` in ``memory_pool_host.py`` for the flat page layouts.

Only the v1 KV pool is handled: MLA models and the v2 multi-pool interface (Mamba, SWA,
DSA side pools) are refused with a clear error. Every fault is a miss for SGLang (False or
None), never an exception in its prefetch or backup thread, which it does not restart.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import torch

from omniflow.errors import InvalidArgument
from omniflow.kv.blocking import AgentPageStore, agent_settings
from omniflow_services.worker.sglang.pages import (
    HostPageFormat,
    KeyMapper,
    KeyTable,
    host_format_of,
    key_table_path,
    namespace_model_id,
)

log = logging.getLogger(__name__)

try:  # the base class when SGLang is installed; this module imports without it
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base

    SGLANG_HICACHE = True
except ImportError:  # pragma: no cover - depends on the environment
    _Base = object  # type: ignore[assignment,misc]
    SGLANG_HICACHE = False

BACKEND_NAME = "omniflow"
MODULE_PATH = __name__
CLASS_NAME = "OmniflowHiCacheStorage"


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """Our fields of SGLang's ``hicache_storage_backend_extra_config``."""

    agent_address: str
    index_address: str = ""
    model_id: str = ""
    timeout_s: float = 10.0
    zero_copy: bool = True
    max_batch: int = 256
    key_tables: str = ""  # the worker's folder of KeyTable files (empty: none)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> BackendConfig:
        agent, index, timeout = agent_settings(extra, "hicache extra config")
        try:
            max_batch = int(extra.get("max_batch", 256))
        except (TypeError, ValueError):
            max_batch = 0
        if max_batch <= 0:
            raise InvalidArgument(
                f"max_batch must be an integer > 0, got {extra.get('max_batch')!r}"
            )
        return cls(
            agent_address=agent,
            index_address=index,
            model_id=str(extra.get("model_id", "")),
            timeout_s=timeout,
            zero_copy=bool(extra.get("zero_copy", True)),
            max_batch=max_batch,
            key_tables=str(extra.get("key_tables", "")),
        )


def extra_config(
    agent_address: str,
    index_address: str,
    model_id: str,
    *,
    interface_v1: bool = True,
    timeout_s: float = 10.0,
    key_tables: str = "",
) -> dict[str, Any]:
    """The extra config that makes SGLang load this backend (JSON-encode it for SGLang);
    ``key_tables``: the folder where the worker writes the ``KeyTable`` of each namespace."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "agent_address": agent_address,
        "index_address": index_address,
        "model_id": model_id,
        "timeout_s": timeout_s,
        "interface_v1": 1 if interface_v1 else 0,
        "key_tables": key_tables,
    }


class OmniflowHiCacheStorage(_Base):  # type: ignore[misc,valid-type]
    """SGLang HiCache storage over the kv-agent: one namespace per model, layout and rank."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = BackendConfig.from_extra(extra)
        if getattr(storage_config, "is_mla_model", False):
            raise InvalidArgument(
                "MLA models are not supported by the omniflow HiCache backend (MHA pages only)"
            )
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self.tp_size = int(getattr(storage_config, "tp_size", 1))
        base_id = (
            self.config.model_id
            or PurePath(str(getattr(storage_config, "model_name", "") or "model")).name
        )
        self.model_id = namespace_model_id(base_id, self.tp_rank, self.tp_size)
        self.mem_pool_host: Any = None
        self.format: HostPageFormat | None = None
        self.store: AgentPageStore | None = None
        self.keys: KeyMapper | None = None

    # --- set-up -----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool right after construction: its page format fixes
        our namespace, so the agent connection opens here."""
        self.mem_pool_host = mem_pool_host
        self.open(host_format_of(mem_pool_host))

    def open(self, fmt: HostPageFormat) -> None:
        """Connect for pages of ``fmt`` (also usable without SGLang, e.g. from tests)."""
        self.close()
        layout = fmt.kv_layout(self.model_id)
        store = AgentPageStore(
            self.config.agent_address,
            layout,
            index_address=self.config.index_address,
            timeout_s=self.config.timeout_s,
            zero_copy=self.config.zero_copy,
            max_batch=self.config.max_batch,
        )
        store.register()
        self.format, self.store = fmt, store
        self.keys = KeyMapper(layout.namespace, self._key_table(layout.namespace))
        log.info(
            "omniflow HiCache: namespace %s (%s, %s pages of %d bytes) at %s",
            layout.namespace_hex,
            self.model_id,
            fmt.layout,
            layout.page_bytes,
            self.config.agent_address,
        )

    def _key_table(self, namespace: bytes) -> KeyTable | None:
        """The worker's table of this namespace's page names, when it writes one."""
        if not self.config.key_tables:
            return None
        path = key_table_path(self.config.key_tables, namespace)
        try:
            return KeyTable(path)
        except (OSError, InvalidArgument) as exc:  # pages keep their key-derived names
            log.warning("omniflow HiCache: no key table at %s (%s)", path, exc)
            return None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.keys is not None and self.keys.table is not None:
            self.keys.table.close()
        self.keys = None

    def _ready(self) -> tuple[HostPageFormat, AgentPageStore, KeyMapper]:
        if self.format is None or self.store is None or self.keys is None:
            raise InvalidArgument("no host pool registered: call register_mem_pool_host first")
        return self.format, self.store, self.keys

    # --- the generic interface (flat page tensors) ------------------------------------------

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Pages for ``keys`` written into ``target_locations`` (flat host-layout tensors)
        when given; None from the first miss on."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        try:
            fmt, store, mapper = self._ready()
            pages = store.get(mapper.block_hashes(keys))
            for i, page in enumerate(pages):
                flat = fmt.from_contract(page)
                target = target_locations[i] if target_locations else None
                if target is not None:
                    target.reshape(-1).view(torch.uint8).copy_(flat.view(torch.uint8))
                    out[i] = target
                else:
                    out[i] = flat
        except Exception as exc:  # SGLang never restarts its I/O threads
            log.warning("omniflow HiCache get failed (a miss for SGLang): %s", exc)
        return out

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat host-layout pages; True when the agent holds all of them."""
        return all(self._set_pages(keys, list(values or [])))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def _set_pages(self, keys: Sequence[str], flats: Sequence[torch.Tensor]) -> list[bool]:
        if len(keys) != len(flats):
            log.warning("omniflow HiCache set: %d keys but %d pages", len(keys), len(flats))
            return [False] * len(keys)
        try:
            fmt, store, mapper = self._ready()
            pages = [fmt.to_contract(f).numpy() for f in flats]
            held = store.put(mapper.block_hashes(keys), pages)
            return [True] * held + [False] * (len(keys) - held)
        except Exception as exc:  # SGLang never restarts its I/O threads
            log.warning("omniflow HiCache set failed (pages stay local): %s", exc)
            return [False] * len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` can be fetched (this node, or pulled from another)."""
        try:
            _, store, mapper = self._ready()
            return store.exists(mapper.block_hashes(keys))
        except Exception as exc:  # SGLang never restarts its I/O threads
            log.warning("omniflow HiCache exists failed (a miss for SGLang): %s", exc)
            return 0

    # --- the v1 interface (host-pool indices; "interface_v1": 1) -----------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load pages straight into the host pool at ``host_indices`` (page-aligned)."""
        flags = [False] * len(keys)
        try:
            fmt, store, mapper = self._ready()
            pages = store.get(mapper.block_hashes(keys))
            for i, page in enumerate(pages):
                index = int(host_indices[i * fmt.page_size])
                self.mem_pool_host.set_from_flat_data_page(index, fmt.from_contract(page))
                flags[i] = True
        except Exception as exc:  # SGLang never restarts its I/O threads
            log.warning("omniflow HiCache get_v1 failed (a miss for SGLang): %s", exc)
        return flags

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices``."""
        try:
            fmt, _, _ = self._ready()
            flats = [
                self.mem_pool_host.get_data_page(int(host_indices[i * fmt.page_size]), flat=True)
                for i in range(len(keys))
            ]
        except Exception as exc:  # SGLang never restarts its I/O threads
            log.warning("omniflow HiCache set_v1 failed: %s", exc)
            return [False] * len(keys)
        return self._set_pages(keys, flats)

    # --- misc ---------------------------------------------------------------------------------

    def clear(self) -> None:
        # Pages are shared with other workers through the agent: never dropped from here.
        log.info("omniflow HiCache clear: shared pages stay in the kv-agent")

    def omniflow_stats(self) -> dict[str, int]:
        """Transport counters (SGLang's own ``get_stats`` expects its metrics type)."""
        if self.store is None:
            return {}
        s = self.store.stats
        return {
            "pages_put": s.pages_put,
            "pages_got": s.pages_got,
            "pages_pulled": s.pages_pulled,
            "checksum_failures": s.checksum_failures,
            "zero_copy_puts": s.zero_copy_puts,
            "streamed_puts": s.streamed_puts,
            "zero_copy_gets": s.zero_copy_gets,
            "streamed_gets": s.streamed_gets,
            "errors": s.errors,
        }
