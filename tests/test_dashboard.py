"""Prometheus and Grafana in docker-compose.yml, held to the code: Prometheus finds every
service through the metadata key the services write, Grafana's provisioning points at that
Prometheus and at the dashboard, and the dashboard's queries name only series the code
exports (the names are read from the source, as string literals)."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any

import yaml

# The resolved compose file (`docker compose config`) of test_compose.py, reused as is.
from test_compose import _ours, _package, compose_cmd, config  # noqa: F401

from omniflow_services.gateway.app import build_app
from omniflow_services.gateway.config import GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "compose" / "prometheus.yml"
GRAFANA = ROOT / "compose" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "omniflow.json"

_NAME = re.compile(r"""["'](omniflow_[a-z0-9_]+)["']""")
_IN_QUERY = re.compile(r"\bomniflow_[a-z0-9_]+")
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def exported_names() -> set[str]:
    """Metric names that appear as string literals in the services and the library."""
    names: set[str] = set()
    for tree in (ROOT / "services", ROOT / "libs" / "omniflow"):
        for path in tree.rglob("*.py"):
            names.update(_NAME.findall(path.read_text()))
    return names


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> the repository path bound there."""
    return {
        v["target"]: Path(v["source"]) for v in service.get("volumes", []) if v["type"] == "bind"
    }


def test_dashboard_queries_name_only_exported_series() -> None:
    exported = exported_names()
    queries = _queries()
    assert queries, "the dashboard has no queries"
    unknown = set()
    for expr in queries:
        for name in _IN_QUERY.findall(expr):
            base = next((name.removesuffix(s) for s in _HISTOGRAM_SUFFIXES if name.endswith(s)), "")
            if name not in exported and base not in exported:
                unknown.add(name)
    assert not unknown, f"the dashboard queries series no code exports: {sorted(unknown)}"


def test_dashboard_shows_the_series_serving_engineers_expect() -> None:
    text = " ".join(_queries())
    for name in (
        "omniflow_worker_time_to_first_token_seconds_bucket",
        "omniflow_worker_inter_token_latency_seconds_bucket",
        "omniflow_worker_request_latency_seconds_bucket",
        "omniflow_worker_generated_tokens_total",
        "omniflow_worker_requests_running",
        "omniflow_worker_requests_waiting",
        "omniflow_worker_kv_pages_used",
        "omniflow_worker_prefix_cache_hit_tokens_total",
        "omniflow_worker_preemptions_total",
        "omniflow_router_picks_total",
        "omniflow_router_kv_fallbacks_total",
        "omniflow_router_breaker_state",
        "omniflow_kv_agent_pages",
        "omniflow_kv_agent_transfer_bytes_total",
        "omniflow_kv_agent_evictions_total",
        "omniflow_kv_index_match_prefix_seconds_bucket",
        "omniflow_kv_index_events_total",
        "omniflow_coordinator_runs_total",
        "omniflow_coordinator_node_seconds_bucket",
        "omniflow_gateway_time_to_first_token_seconds_bucket",
        "omniflow_gateway_requests_total",
    ):
        assert re.search(rf"\b{name}\b", text), f"no panel queries {name}"


def test_prometheus_scrapes_every_service(config: dict[str, Any]) -> None:  # noqa: F811
    services = config["services"]
    prom = services["prometheus"]
    assert _mounts(prom)["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    (job,) = [j for j in scrape if j["job_name"] == "omniflow"]
    (sd,) = job["consul_sd_configs"]
    host, _, port = sd["server"].rpartition(":")
    assert services[host]["image"].startswith("hashicorp/consul") and port == "8500"
    # The address Prometheus scrapes is the registration's "metrics" metadata...
    address = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    assert address and address[0]["source_labels"] == ["__meta_consul_service_metadata_metrics"]
    server = (ROOT / "libs" / "omniflow" / "rpc" / "server.py").read_text()
    assert 'meta["metrics"] = ' in server, "services no longer register their metrics address"
    # The gateway, not in discovery, is scraped on its HTTP port (it serves /metrics there).
    (gw,) = [j for j in scrape if j["job_name"] == "gateway"]
    (target,) = [t for c in gw["static_configs"] for t in c["targets"]]
    host, _, port = target.rpartition(":")
    assert _package(services[host]) == "gateway" and gw["metrics_path"] == "/metrics"
    assert services[host]["environment"]["OMNIFLOW_GATEWAY_PORT"] == port
    # The app's own route table (built without a core: the handlers only use it per request).
    guard = build_app(GatewaySettings(), types.SimpleNamespace(), lambda: True)  # type: ignore[arg-type]
    assert "/metrics" in guard.routes, "the gateway no longer serves /metrics"
    # ...which every service writes when its metrics port is on.
    for name, svc in _ours(config).items():
        if svc["command"][0] == "omniflow":  # the one-shot models job
            continue
        port = int((svc.get("environment") or {}).get("OMNIFLOW_METRICS_PORT", "-1"))
        assert port > 0, f"{name}: no OMNIFLOW_METRICS_PORT, so Prometheus cannot scrape it"


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(
    config: dict[str, Any],  # noqa: F811
) -> None:
    grafana = config["services"]["grafana"]
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    (datasource,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    assert "9090:9090" in {
        f"{p['published']}:{p['target']}" for p in config["services"]["prometheus"]["ports"]
    }
    (provider,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "omniflow.yml").read_text()
    )["providers"]
    folder = provider["options"]["path"]
    assert mounts[folder] == DASHBOARD.parent
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}, "panels must use the provisioned data source"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{folder}/{DASHBOARD.name}"
