"""Tracing and metrics, wired once here for every server and channel.

Tracing follows the standard ``OTEL_*`` variables: ``OTEL_SDK_DISABLED`` turns it off,
``OTEL_SERVICE_NAME`` names the service, ``OTEL_TRACES_EXPORTER`` picks ``otlp`` (the
default when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._TRACES_ENDPOINT`` is set),
``console`` or ``none`` (the default otherwise: no span is recorded here, but the
caller's context still passes through to every downstream call, so a service that does
export keeps the trace connected). The W3C ``traceparent`` header carries the context
across every gRPC hop.

Metrics are Prometheus counters and histograms served on an HTTP port per service, named
``omniflow_<service>_<what>_<unit>``. Values a service already keeps (queue lengths, pool
usage, counters of a core with no Prometheus import) are read at scrape time through
``add_sampler``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omniflow.config import TelemetrySettings, load_settings

log = logging.getLogger(__name__)

TRACER_NAME = "omniflow"

RPC_SERVED = Counter(
    "omniflow_rpc_served_total", "RPCs served, by method and status code", ["method", "code"]
)
RPC_SECONDS = Histogram(
    "omniflow_rpc_server_seconds",
    "Time to serve an RPC (to the last message for streams)",
    ["method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# Latency buckets for calls and steps that take from a fraction of a millisecond to a minute.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip

_provider: TracerProvider | None = None


def _exporter_from_env() -> SpanExporter | None:
    env = load_settings(TelemetrySettings)
    kind = env.traces_exporter.strip().lower()
    endpoint = env.traces_endpoint or env.endpoint
    if not kind:
        kind = "otlp" if endpoint else "none"
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "otlp":
        # Imported here: the exporter pulls in its own gRPC stack only when used.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    raise ValueError(
        f"OTEL_TRACES_EXPORTER={kind!r} is not supported; accepted: otlp, console, none"
    )


def setup_tracing(
    service_name: str, exporter: SpanExporter | None = None, *, record: bool | None = None
) -> TracerProvider | None:
    """Install the process's tracer provider once; later calls return the same one.

    ``exporter`` overrides the environment (tests pass an in-memory exporter, exported
    synchronously so that a test sees every span as soon as it ends). With no exporter
    at all, no SDK is installed unless ``record`` is true: spans are then the API's
    non-recording ones, which still carry the caller's context to every downstream
    call, so a trace stays connected through this process at a fraction of the cost.
    """
    global _provider
    if _provider is not None:
        if exporter is not None:
            _provider.add_span_processor(SimpleSpanProcessor(exporter))
        return _provider
    env = load_settings(TelemetrySettings)
    if env.sdk_disabled.strip().lower() == "true":
        return None
    processor: SpanProcessor | None = None
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        env_exporter = _exporter_from_env()
        if env_exporter is not None:
            processor = BatchSpanProcessor(env_exporter)
    if processor is None and not record:
        log.debug("no trace exporter configured: propagating context only")
        return None
    name = env.service_name or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if processor is not None:
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _provider = provider
    log.debug("tracing set up for %s (%s)", name, type(processor).__name__)
    return provider


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush pending spans and stop exporting (the last step of a service's shutdown)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()


@functools.cache
def tracer() -> trace.Tracer:
    """The project's tracer. Cached: get_tracer costs microseconds on every call, and the
    proxy it returns before a provider is installed follows the provider installed later."""
    return trace.get_tracer(TRACER_NAME)


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current trace context into ``carrier`` (e.g. a Redis record or metadata)."""
    propagate.inject(carrier)


def start_metrics_server(port: int, host: str) -> int | None:
    """Serve Prometheus metrics over HTTP; returns the bound port, or None when disabled."""
    if port < 0:
        return None
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)


@dataclass(frozen=True, slots=True)
class Sample:
    """One value read at scrape time: a gauge, or a counter when ``counter`` (its name then
    ends in ``_total``). ``labels`` are (name, value) pairs, the same names for every sample
    of one metric."""

    name: str
    doc: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()
    counter: bool = False


Sampler = Callable[[], Iterable[Sample]]


class _Sampled(Collector):
    """Every sampler of the process, read on each scrape. Samples of one name and labels
    from several samplers (several apps in one test process) are summed, so that each
    series appears once."""

    def __init__(self) -> None:
        self._samplers: dict[int, Sampler] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def add(self, sampler: Sampler) -> Callable[[], None]:
        with self._lock:
            key = next(self._ids)
            self._samplers[key] = sampler

        def remove() -> None:
            with self._lock:
                self._samplers.pop(key, None)

        return remove

    def describe(self) -> list[Metric]:
        return []  # names vary with what is running: no duplicate check at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            samplers = list(self._samplers.values())
        values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        meta: dict[str, Sample] = {}
        for sampler in samplers:
            try:
                samples = list(sampler())
            except Exception as exc:  # the scrape thread reads live state: skip, never fail
                log.debug("metrics sampler %r failed: %s", sampler, exc)
                continue
            for sample in samples:
                meta.setdefault(sample.name, sample)
                key = (sample.name, sample.labels)
                values[key] = values.get(key, 0.0) + sample.value
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for (name, labels), value in values.items():
            family = families.get(name)
            if family is None:
                first = meta[name]
                label_names = [k for k, _ in first.labels]
                if first.counter:
                    family = CounterMetricFamily(
                        name.removesuffix("_total"), first.doc, labels=label_names
                    )
                else:
                    family = GaugeMetricFamily(name, first.doc, labels=label_names)
                families[name] = family
            family.add_metric([v for _, v in labels], value)
        yield from families.values()


_SAMPLED = _Sampled()
REGISTRY.register(_SAMPLED)


def add_sampler(sampler: Sampler) -> Callable[[], None]:
    """Read ``sampler`` on every scrape of this process's metrics; returns its remover.

    It runs on the metrics server's thread: read plain attributes and lengths of the
    live state, take no asyncio locks, and keep it cheap.
    """
    return _SAMPLED.add(sampler)
