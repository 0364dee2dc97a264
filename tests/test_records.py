"""omniflow.records: one record built from another by the target's field list."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.convert import worker_info
from omniflow.kv.blocks import KVLayout
from omniflow.kv.wire import layout_from_proto, layout_to_proto
from omniflow.records import build, field_names
from omniflow.workers import WorkerRecord


@dataclass(frozen=True)
class _Options:
    name: str
    size: int = 3
    tags: tuple[str, ...] = ()
    made: bool = field(default=False, init=False)


def _call(arch: str, out_dir: str, *, layers: int = 2, seed: int = 0) -> tuple[str, str, int, int]:
    return arch, out_dir, layers, seed


def test_field_names_of_each_kind() -> None:
    assert field_names(_Options) == ("name", "size", "tags")  # init=False is not built from
    assert field_names(common_pb2.KVLayout) == (
        "model_id",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "page_size",
        "lora_id",
    )
    assert field_names(_call) == ("arch", "out_dir", "layers", "seed")


def test_copies_the_fields_the_source_has_and_keeps_defaults() -> None:
    args = argparse.Namespace(name="a", size=7, command="deploy", out=Path("x"))
    assert build(_Options, args) == _Options("a", 7)  # tags: the default; command: not a field


def test_overrides_replace_or_add_fields() -> None:
    args = argparse.Namespace(name="a", size=7, labels="p,q")
    opts = build(_Options, args, size=8, tags=tuple(args.labels.split(",")))
    assert opts == _Options("a", 8, ("p", "q"))


def test_an_override_that_is_no_field_fails() -> None:
    with pytest.raises(TypeError, match="no field sise"):
        build(_Options, argparse.Namespace(name="a"), sise=8)


def test_a_required_field_the_source_lacks_fails_in_the_target() -> None:
    with pytest.raises(TypeError, match="name"):
        build(_Options, argparse.Namespace(size=1))


def test_a_call_by_its_parameters() -> None:
    args = argparse.Namespace(arch="llama", out="/tmp/m", layers=4, seed=9, also="")
    assert build(_call, args, out_dir=args.out) == ("llama", "/tmp/m", 4, 9)


def test_layout_round_trip_through_its_message() -> None:
    layout = KVLayout("m", 2, 4, 8, dtype="bfloat16", page_size=32, lora_id="ad")
    msg = layout_to_proto(layout)
    assert (msg.model_id, msg.num_layers, msg.dtype, msg.page_size, msg.lora_id) == (
        "m",
        2,
        "bfloat16",
        32,
        "ad",
    )
    assert layout_from_proto(msg) == layout
    msg.dtype = ""
    assert layout_from_proto(msg).dtype == "float32"  # an unset dtype is the default


def test_worker_info_from_its_record() -> None:
    ns = bytes(range(16))
    w = WorkerRecord("w1", "llm", "127.0.0.1:1", "n1", "tiny", ns.hex(), ("generate",), {"k": "v"})
    info = worker_info(w, healthy=False)
    assert (info.worker_id, info.role, info.address, info.node, info.model) == (
        "w1",
        "llm",
        "127.0.0.1:1",
        "n1",
        "tiny",
    )
    assert (info.kv_namespace, info.kv_namespace_id) == (ns.hex(), ns)
    assert list(info.operations) == ["generate"] and dict(info.metadata) == {"k": "v"}
    assert info.healthy is False and not info.HasField("load")
