"""The router's strategies, cost model and circuit breaker (core, no network)."""

from __future__ import annotations

import collections

import pytest

from omniflow.errors import InvalidArgument, NotFound
from omniflow.kv.blocks import KVLayout
from omniflow.kv.index_store import OwnerMatch
from omniflow.routing.table import CircuitBreaker, WorkerTable, pull_credit
from omniflow.workers import WorkerRecord


def _table(n: int = 3, **kw) -> WorkerTable:
    t = WorkerTable(seed=7, **kw)
    t.replace(
        WorkerRecord(
            f"w{i}",
            "llm",
            f"127.0.0.1:{9000 + i}",
            node=f"node{i % 2}",
            operations=("generate",),
            metadata={"weight": str(i + 1)},
        )
        for i in range(n)
    )
    return t


def _ids(t: WorkerTable, strategy: str, n: int, **kw) -> list[str]:
    return [t.pick("llm", strategy, **kw).worker.worker_id for _ in range(n)]


def test_round_robin_cycles_and_exclude_skips():
    t = _table()
    assert _ids(t, "round_robin", 6) == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert set(_ids(t, "round_robin", 4, exclude=("w1",))) == {"w0", "w2"}


def test_unknown_role_strategy_and_operation():
    t = _table()
    with pytest.raises(NotFound, match="no live worker of role 'talker'"):
        t.pick("talker", "round_robin")
    with pytest.raises(NotFound, match="serving 'encode'"):
        t.pick("llm", "round_robin", operation="encode")
    with pytest.raises(InvalidArgument, match="unknown strategy 'fastest'"):
        t.pick("llm", "fastest")


def test_least_outstanding_and_power_of_two_avoid_the_busy_worker():
    t = _table()
    for _ in range(5):
        t.begin("w0")
        t.begin("w1")
    assert set(_ids(t, "least_outstanding", 5)) == {"w2"}
    # Of any two sampled, the idle one wins whenever it is sampled; w0/w1 tie otherwise.
    counts = collections.Counter(_ids(t, "power_of_two", 300))
    assert counts["w2"] > 150
    t.finish("w0", None, True)
    assert t.load("w0") == 4


def test_consistent_hash_is_sticky_and_moves_little_when_a_worker_goes():
    t = _table(4)
    keys = [f"session-{i}" for i in range(200)]
    before = {k: t.pick("llm", "consistent_hash", session_key=k).worker.worker_id for k in keys}
    assert before == {
        k: t.pick("llm", "consistent_hash", session_key=k).worker.worker_id for k in keys
    }
    assert len(set(before.values())) == 4
    after = {
        k: t.pick("llm", "consistent_hash", session_key=k, exclude=("w3",)).worker.worker_id
        for k in keys
    }
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "w3" for k in moved)  # only w3's sessions move
    r = t.pick("llm", "consistent_hash")
    assert r.strategy == "round_robin" and r.fallback_reason == "no session key"


def test_weighted_follows_the_weights():
    t = _table()
    counts = collections.Counter(_ids(t, "weighted", 600))
    assert counts == {"w0": 100, "w1": 200, "w2": 300}  # smooth WRR is exact per cycle


def _owner(
    owner_id: str, kind: str, node: str, address: str, matched: int, per_tier: tuple[int, int, int]
) -> OwnerMatch:
    """What the index answers for one owner of a prompt's leading blocks."""
    return OwnerMatch(
        owner_id=owner_id,
        node=node,
        address=address,
        kind=kind,
        matched_blocks=matched,
        blocks_per_tier=per_tier,
    )


def test_kv_aware_prefers_reachable_blocks_with_tier_credit():
    t = _table()
    reach = [
        _owner("w1", "worker", "node1", "127.0.0.1:9001", 8, (8, 0, 0)),
        _owner("agent-node0", "agent", "node0", "x", 10, (0, 10, 0)),
    ]
    r = t.pick("llm", "kv_aware", reach=reach, prompt_blocks=10)
    # w0 and w2 sit on node0: 10 host blocks → credit 7.5, cost 2.5; w1: credit 8 → cost 2.
    assert r.worker.worker_id == "w1" and r.cost == pytest.approx(2.0)
    assert r.reachable_blocks == 8
    credit, reachable = t.reachable(t.list()[0], reach)
    assert (credit, reachable) == (pytest.approx(7.5), 10)
    ssd = [_owner("agent-node0", "agent", "node0", "x", 10, (0, 0, 10))]
    assert t.reachable(t.list()[0], ssd)[0] == pytest.approx(2.5)


def test_kv_aware_credits_a_node_siblings_device_pages_as_host_tier():
    # w1 on node1 holds 8 blocks on its device; the agent of node1 has not announced them
    # yet (an llm's prefill_only pages, just written through). w3, w1's node-mate, reaches
    # them through that agent: 0.75 a block; w0 and w2 on node0 reach nothing.
    t = _table(4)
    reach = [_owner("w1", "worker", "node1", "127.0.0.1:9001", 8, (8, 0, 0))]
    w = {r.worker_id: r for r in t.list()}
    assert t.reachable(w["w3"], reach) == (pytest.approx(6.0), 8)
    assert t.reachable(w["w0"], reach) == (0.0, 0)
    assert t.pick("llm", "kv_aware", ("w1",), reach=reach, prompt_blocks=8).worker.worker_id == "w3"
    # The agent's own answer, once there, counts with its tiers (here: more blocks on SSD).
    later = [*reach, _owner("agent-node1", "agent", "node1", "x", 10, (0, 0, 10))]
    assert t.reachable(w["w3"], later) == (pytest.approx(2.5), 10)


def test_kv_aware_weighs_load_and_falls_back_to_load_only():
    t = _table()
    reach = [_owner("w1", "worker", "node1", "127.0.0.1:9001", 4, (4, 0, 0))]
    for _ in range(6):
        t.begin("w1")  # 6 outstanding outweigh 4 cached blocks
    r = t.pick("llm", "kv_aware", reach=reach, prompt_blocks=8)
    assert r.worker.worker_id != "w1"
    r = t.pick("llm", "kv_aware", reach=None, prompt_blocks=8, fallback_reason="kv index timed out")
    assert r.fallback_reason == "kv index timed out" and r.worker.worker_id != "w1"


def test_kv_aware_weighs_prefill_already_queued_on_a_worker():
    t = _table()
    reach = [_owner("w1", "worker", "node1", "127.0.0.1:9001", 8, (8, 0, 0))]
    r = t.pick("llm", "kv_aware", reach=reach, prompt_blocks=10)
    assert (r.worker.worker_id, r.cost, r.prefill_blocks) == ("w1", 2.0, 2.0)
    big = t.begin("w1", 30.0)  # a long prefill the router sent to w1, not finished yet
    t.begin("w2")  # one call on w2 that brings no prefill
    assert t.queued_blocks("w1") == 30.0 and t.queued_blocks("w2") == 0.0
    # w1: 2 to prefill + 30 queued + 1 call = 33; w0: 10 + 0 + 0; w2: 10 + 0 + 1.
    r = t.pick("llm", "kv_aware", reach=reach, prompt_blocks=10)
    assert (r.worker.worker_id, r.cost, r.prefill_blocks) == ("w0", 10.0, 10.0)
    t.finish("w1", big, True)
    assert t.queued_blocks("w1") == 0.0
    assert t.pick("llm", "kv_aware", reach=reach, prompt_blocks=10).worker.worker_id == "w1"


def test_kv_aware_load_is_in_blocks_so_a_long_cached_prompt_still_moves():
    t = _table()
    reach = [_owner("w1", "worker", "node1", "127.0.0.1:9001", 90, (90, 0, 0))]
    t.begin("w1", 80.0)
    t.begin("w1", 80.0)
    t.begin("w2", 1.0)
    # Counting calls only, w1 would cost 10 + 2 and win; its queued prefill makes it
    # 10 + 160 + 2 = 172, against 100 on idle w0 (w2: 100 + 1 + 1).
    r = t.pick("llm", "kv_aware", reach=reach, prompt_blocks=100)
    assert (r.worker.worker_id, r.cost) == ("w0", 100.0)
    t.finish("w1", None, True)  # no ticket: the oldest call ends, with its queued prefill
    assert t.queued_blocks("w1") == 80.0 and t.load("w1") == 1
    r = t.pick("llm", "kv_aware", reach=reach, prompt_blocks=100)
    assert (r.worker.worker_id, r.cost) == ("w1", 91.0)


def test_kv_aware_temperature_spreads_near_equal_workers():
    t = _table()
    cold = collections.Counter(_ids(t, "kv_aware", 200, reach=[], prompt_blocks=4))
    hot = collections.Counter(_ids(t, "kv_aware", 300, reach=[], prompt_blocks=4, temperature=5.0))
    assert len(hot) == 3 and min(hot.values()) > 50
    assert sum(cold.values()) == 200


def test_circuit_breaker_opens_half_opens_and_closes():
    b = CircuitBreaker(threshold=2, cooldown_s=10.0)
    assert b.allows(0.0)
    assert not b.record(False, 0.0)
    assert b.record(False, 1.0) and b.state == "open"
    assert not b.allows(5.0)
    assert b.allows(11.5) and b.state == "half_open"
    b.on_pick()
    assert not b.allows(11.6)  # one trial at a time
    b.record(True, 12.0)
    assert b.state == "closed" and b.allows(12.0)


def test_table_skips_open_breakers_and_ignores_caller_errors():
    t = _table(breaker_threshold=2, breaker_cooldown_s=60.0)
    for _ in range(5):
        t.finish("w1", None, False, "INVALID_ARGUMENT")  # the caller's fault: neutral
    assert t.breakers()["w1"] == "closed"
    t.finish("w1", None, False, "UNAVAILABLE")
    t.finish("w1", None, False, "UNAVAILABLE")
    assert t.breakers()["w1"] == "open" and t.counters["breaker_opened"] == 1
    assert "w1" not in _ids(t, "round_robin", 6)
    t.set_health("w0", False)
    assert set(_ids(t, "round_robin", 4)) == {"w2"}


def test_kv_aware_costs_equal_the_full_walk_of_the_answer_for_every_worker():
    # kv_costs walks the index's answer only for workers it names or whose node it names;
    # every cost must still be the one walking it for every worker gives.
    import random

    rng = random.Random(3)
    t = WorkerTable(seed=1)
    t.replace(
        WorkerRecord(f"w{i}", "llm", f"10.0.0.{i}:1", node=f"n{i % 40}", operations=("generate",))
        for i in range(400)
    )
    for i in range(0, 400, 7):
        t.begin(f"w{i}", float(rng.randrange(0, 20)))
    t.set_health("w5", True, queue=4)
    reach = [
        _owner(f"w{rng.randrange(400)}", "worker", f"n{rng.randrange(40)}", "", m, (m, 0, 0))
        for m in (rng.randrange(1, 64) for _ in range(12))
    ]
    reach += [
        _owner("a", "agent", "n3", "x", 30, (0, 20, 10)),
        _owner("b", "agent", "", "", 9, (9, 0, 0)),
    ]
    reach.append(_owner("by-address", "worker", "", "10.0.0.17:1", 50, (50, 0, 0)))
    cands = t.candidates("llm")
    got = {v.record.worker_id: (c, p, r) for c, p, r, v in t.kv_costs(cands, reach, 64, 1.5)}
    assert len(got) == 400 and got["w17"][2] == 50
    for v in cands:
        wid = v.record.worker_id
        credit, reachable = t.reachable(v.record, reach)
        prefill = max(64 - credit, 0.0)
        cost = prefill + t.queued_blocks(wid) + 1.5 * t.load(wid)
        assert got[wid] == (pytest.approx(cost), pytest.approx(prefill), reachable), wid


def _two_nodes(gbps: float, **meta: str) -> WorkerTable:
    # SmolLM2-135M's page: 30 layers x 3 KV heads x 64 dims, bfloat16, 16 tokens.
    page = KVLayout("smollm2", 30, 3, 64, "bfloat16", 16)
    t = WorkerTable(seed=1, link_gbps=gbps, prefill_tokens_s=10_000.0)
    t.replace(
        WorkerRecord(
            wid,
            "llm",
            f"198.18.0.{i}:1",
            node=node,
            operations=("generate",),
            metadata={"page_bytes": str(page.page_bytes), "page_size": "16", **meta},
        )
        for i, (wid, node) in enumerate((("a1", "A"), ("b1", "B")))
    )
    return t


def test_kv_aware_pulls_from_another_node_only_when_the_link_beats_the_prefill():
    # A page is 368,640 bytes: 0.29 ms at 10 Gbit/s, 2.9 ms at 1 Gbit/s; prefilling its 16
    # tokens at 10,000 tokens/s takes 1.6 ms. Node A's agent holds all 64 blocks; a1 (on
    # A) has 30 blocks of prefill queued, b1 (on B) is idle.
    reach = [_owner("agent-A", "agent", "A", "198.18.0.1:2", 64, (0, 64, 0))]
    assert KVLayout("smollm2", 30, 3, 64, "bfloat16", 16).page_bytes == 368_640
    credit_10 = 1 - (368_640 * 8 / 10e9) / (16 / 10_000)
    assert pull_credit(368_640, 16, 10.0, 10_000.0) == pytest.approx(credit_10)
    assert pull_credit(368_640, 16, 1.0, 10_000.0) == 0.0  # slower than recomputing
    assert pull_credit(368_640, 16, 0.0, 10_000.0) == 0.0  # no link speed known

    fast = _two_nodes(10.0)
    fast.begin("a1", 30.0)
    r = fast.pick("llm", "kv_aware", reach=reach, prompt_blocks=64)
    # b1 pulls the 64 blocks: 64 x 0.18 left to prefill, against a1's 16 + 30 + 1.
    assert r.worker.worker_id == "b1" and r.reachable_blocks == 64
    assert r.prefill_blocks == pytest.approx(64 * (1 - credit_10))

    slow = _two_nodes(1.0)
    slow.begin("a1", 30.0)
    r = slow.pick("llm", "kv_aware", reach=reach, prompt_blocks=64)
    # At 1 Gbit/s b1 would recompute all 64 blocks (cost 64): a1 (cost 47) is the pick.
    assert (r.worker.worker_id, r.cost) == ("a1", pytest.approx(16 + 30 + 1))
    b1 = next(v for v in slow.candidates("llm") if v.record.worker_id == "b1")
    assert slow.reachable(b1.record, reach, slow.pull_credit(b1)) == (0.0, 0)

    # A worker's own link_gbps metadata overrides the setting (its node's link).
    mixed = _two_nodes(1.0, link_gbps="10")
    mixed.begin("a1", 30.0)
    assert mixed.pick("llm", "kv_aware", reach=reach, prompt_blocks=64).worker.worker_id == "b1"


def test_kv_aware_pull_costs_equal_the_full_walk_of_the_answer():
    import random

    rng = random.Random(5)
    t = WorkerTable(seed=1, link_gbps=10.0, prefill_tokens_s=10_000.0)
    t.replace(
        WorkerRecord(
            f"w{i}",
            "llm",
            f"10.0.1.{i}:1",
            node=f"n{i % 30}",
            metadata={"page_bytes": "368640", "page_size": "16"}
            | ({"link_gbps": "1"} if i % 3 == 0 else {}),
        )
        for i in range(300)
    )
    reach = [
        _owner(f"w{rng.randrange(300)}", "worker", f"n{rng.randrange(30)}", "", m, (m, 0, 0))
        for m in (rng.randrange(1, 64) for _ in range(8))
    ]
    reach.append(_owner("agent-n4", "agent", "n4", "x", 60, (0, 50, 10)))
    cands = t.candidates("llm")
    got = {v.record.worker_id: (c, r) for c, _, r, v in t.kv_costs(cands, reach, 64, 1.0)}
    longest = max(r.matched_blocks for r in reach)
    assert {r for _, r in got.values()} >= {longest, 0}  # pulled by some, recomputed by others
    for v in cands:
        credit, reachable = t.reachable(v.record, reach, t.pull_credit(v))
        assert got[v.record.worker_id] == (pytest.approx(max(64 - credit, 0.0)), reachable)


class _CountingIndex:
    """A prefix index that answers one owner, w1, holding every block; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def match(self, namespace: bytes, hashes: list[bytes]) -> list[OwnerMatch]:
        self.calls += 1
        return [OwnerMatch("w1", "node1", "127.0.0.1:9001", "worker", len(hashes), (0, 0, 0))]

    async def close(self) -> None:
        pass


async def test_picker_asks_the_index_once_per_choice_and_not_for_a_lone_candidate():
    from omniflow.config import load_settings
    from omniflow.routing.picker import Picker
    from omniflow.routing.settings import PickSettings

    hashes = [bytes([i]) * 16 for i in range(4)]
    settings = load_settings(PickSettings, env={})
    for match_alone in (True, False):
        picker = Picker(settings, match_alone=match_alone)
        picker.table = _table(2)
        picker.index = index = _CountingIndex()
        got = await picker.pick("llm", "kv_aware", namespace=b"n" * 16, hashes=hashes)
        assert (got.worker.worker_id, got.reachable_blocks, index.calls) == ("w1", 4, 1)
        # w1 excluded: w0 is the one candidate, picked whether or not the index is asked.
        alone = await picker.pick(
            "llm", "kv_aware", exclude=("w1",), namespace=b"n" * 16, hashes=hashes
        )
        assert alone.worker.worker_id == "w0" and alone.fallback_reason == ""
        assert index.calls == (2 if match_alone else 1)
        assert picker.table.counters["pick_kv_aware"] == 2
