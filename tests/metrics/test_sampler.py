"""Scrape-time samplers (``omniflow.telemetry.add_sampler``) through the process's real
Prometheus registry and its text format: no network."""

from __future__ import annotations

import uuid

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omniflow.telemetry import Sample, add_sampler


def _scrape() -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]:
    """family name -> (type, {sorted labels: value}) of this process's metrics."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        out[fam.name] = (fam.type, {tuple(sorted(s.labels.items())): s.value for s in fam.samples})
    return out


def test_samplers_are_summed_per_series_and_removable() -> None:
    name = f"omniflow_test_{uuid.uuid4().hex[:8]}"
    gauge, counter = f"{name}_depth", f"{name}_things_total"

    def one() -> list[Sample]:
        return [
            Sample(gauge, "a depth", 2, (("tier", "host"),)),
            Sample(counter, "things", 5, counter=True),
        ]

    def two() -> list[Sample]:
        return [
            Sample(gauge, "a depth", 3, (("tier", "host"),)),
            Sample(gauge, "", 7, (("tier", "ssd"),)),
        ]

    def broken() -> list[Sample]:
        raise RuntimeError("dictionary changed size during iteration")

    removers = [add_sampler(one), add_sampler(two), add_sampler(broken)]
    try:
        got = _scrape()
        assert got[gauge] == ("gauge", {(("tier", "host"),): 5.0, (("tier", "ssd"),): 7.0})
        # A counter family is named without _total; its sample keeps it.
        kind, samples = got[counter.removesuffix("_total")]
        assert kind == "counter" and samples == {(): 5.0}
        removers[1]()
        assert _scrape()[gauge] == ("gauge", {(("tier", "host"),): 2.0})
    finally:
        for remove in removers:
            remove()
    assert gauge not in _scrape()
