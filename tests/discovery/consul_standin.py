"""A STAND-IN for a Consul agent's HTTP API, for tests only.

No Consul binary can be installed on the test machines, so this small HTTP
server (http.server in a thread, real sockets) implements just the endpoints
``omniflow.discovery.consul_backend`` calls, following Consul's documented
behaviour:

* ``PUT /v1/agent/service/register`` (with ``replace-existing-checks``): TTL
  checks start critical unless the definition sets ``Status``; gRPC checks are
  run for real against the standard ``grpc.health.v1.Health/Check`` every
  ``Interval``.
* ``PUT /v1/agent/service/deregister/<id>``: 404 for an unknown id.
* ``PUT /v1/agent/check/pass/<check id>``: 404 for an unknown check, 500 for a
  check without a TTL.
* ``GET /v1/health/service/<name>`` with ``passing``, and blocking queries
  (``index`` + ``wait``) answered when the index moves past the given one or the
  wait ends; every response carries ``X-Consul-Index``.
* ACL: when built with ``acl_token``, any request without that token in
  ``X-Consul-Token`` (or ``?token=``) gets 403 "ACL not found".

TTL checks that are not passed within their TTL turn critical (and bump the
index). ``DeregisterCriticalServiceAfter`` is recorded but not enforced: real
Consul clamps it to at least a minute. It is not Consul: no catalog, no
anti-entropy, no datacenters.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Go duration ("250ms", "1m30s") to seconds."""
    parts = re.findall(r"([\d.]+)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"bad duration {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _lower_keys(d: dict[str, Any]) -> dict[str, Any]:
    # Consul decodes JSON case-insensitively and accepts snake_case aliases.
    return {k.lower().replace("_", ""): v for k, v in d.items()}


@dataclass
class Check:
    check_id: str
    service_id: str
    name: str
    status: str
    definition: dict[str, Any]
    ttl_s: float | None = None
    last_pass: float = 0.0
    grpc_target: str | None = None
    interval_s: float = 10.0


@dataclass
class Service:
    service_id: str
    name: str
    address: str
    port: int
    meta: dict[str, str]
    definition: dict[str, Any]
    checks: list[str] = field(default_factory=list)


class ConsulStandIn:
    """Start with ``start()`` (returns "127.0.0.1:<port>"), end with ``stop()``."""

    def __init__(self, acl_token: str | None = None) -> None:
        self.acl_token = acl_token
        self.services: dict[str, Service] = {}
        self.checks: dict[str, Check] = {}
        self.index = 1
        #: (method, path with query) of every request, for tests to inspect.
        self.requests: list[tuple[str, str]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> str:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                standin._handle(self, "GET")

            def do_PUT(self) -> None:
                standin._handle(self, "PUT")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._spawn(self._server.serve_forever)
        self._spawn(self._ttl_ticker)
        return f"127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- state changes (hold _cond) ----------------------------------------------

    def _bump(self) -> None:
        self.index += 1
        self._cond.notify_all()

    def _set_status(self, check: Check, status: str) -> None:
        if check.status != status:
            check.status = status
            self._bump()

    def _ttl_ticker(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                for check in self.checks.values():
                    if check.ttl_s is not None and now > check.last_pass + check.ttl_s:
                        self._set_status(check, "critical")
                self._cond.wait(0.02)

    def _grpc_prober(self, check_id: str) -> None:
        with self._cond:
            check = self.checks.get(check_id)
        if check is None or check.grpc_target is None:
            return
        target, _, service = check.grpc_target.partition("/")
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    ok = False
                with self._cond:
                    if self._stopping or self.checks.get(check_id) is not check:
                        return  # deregistered or replaced
                    self._set_status(check, "passing" if ok else "critical")
                    self._cond.wait(check.interval_s)
                    if self._stopping or self.checks.get(check_id) is not check:
                        return

    def _remove_service(self, service_id: str) -> None:
        service = self.services.pop(service_id)
        for check_id in service.checks:
            self.checks.pop(check_id, None)
        self._bump()

    # -- HTTP ----------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(req.path)
        query = parse_qs(url.query, keep_blank_values=True)
        path = unquote(url.path)
        with self._cond:
            self.requests.append((method, req.path))
        token = req.headers.get("X-Consul-Token") or query.get("token", [""])[0]
        if self.acl_token is not None and token != self.acl_token:
            return self._reply(req, 403, "ACL not found")
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length) if length else b""
        try:
            if method == "PUT" and path == "/v1/agent/service/register":
                return self._register(req, json.loads(body or b"{}"))
            if method == "PUT" and path.startswith("/v1/agent/service/deregister/"):
                return self._deregister(req, path.rsplit("/", 1)[1])
            if method == "PUT" and path.startswith("/v1/agent/check/pass/"):
                return self._pass(req, path.removeprefix("/v1/agent/check/pass/"))
            if method == "GET" and path.startswith("/v1/health/service/"):
                return self._health(req, path.rsplit("/", 1)[1], query)
        except (ValueError, KeyError, TypeError) as exc:
            return self._reply(req, 400, f"Request decode failed: {exc}")
        return self._reply(req, 404, f"stand-in does not implement {method} {path}")

    def _reply(
        self, req: BaseHTTPRequestHandler, code: int, body: Any = "", index: int | None = None
    ) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json" if code == 200 else "text/plain")
        req.send_header("Content-Length", str(len(data)))
        if index is not None:
            req.send_header("X-Consul-Index", str(index))
        req.end_headers()
        req.wfile.write(data)

    def _register(self, req: BaseHTTPRequestHandler, raw: dict[str, Any]) -> None:
        d = _lower_keys(raw)
        name = d["name"]
        service_id = d.get("id") or name
        raw_checks = list(d.get("checks") or []) + ([d["check"]] if d.get("check") else [])
        checks = []
        for i, raw_check in enumerate(raw_checks):
            c = _lower_keys(raw_check)
            default_id = f"service:{service_id}" + (f":{i + 1}" if len(raw_checks) > 1 else "")
            check = Check(
                check_id=c.get("checkid") or c.get("id") or default_id,
                service_id=service_id,
                name=c.get("name") or f"Service '{name}' check",
                status=c.get("status") or "critical",
                definition=raw_check,
            )
            if c.get("ttl"):
                check.ttl_s = parse_duration(c["ttl"])
                check.last_pass = time.monotonic()
            elif c.get("grpc"):
                if c.get("grpcusetls"):
                    raise ValueError("the stand-in only probes plaintext gRPC")
                check.grpc_target = c["grpc"]
                check.interval_s = parse_duration(c["interval"])
            else:
                raise ValueError("the stand-in supports only TTL and gRPC checks")
            checks.append(check)
        with self._cond:
            if service_id in self.services:
                self._remove_service(service_id)
            self.services[service_id] = Service(
                service_id=service_id,
                name=name,
                address=d.get("address") or "",
                port=int(d.get("port") or 0),
                meta=dict(d.get("meta") or {}),
                definition=raw,
                checks=[c.check_id for c in checks],
            )
            for check in checks:
                self.checks[check.check_id] = check
            self._bump()
        for check in checks:
            if check.grpc_target is not None:
                self._spawn(self._grpc_prober, check.check_id)
        self._reply(req, 200)

    def _deregister(self, req: BaseHTTPRequestHandler, service_id: str) -> None:
        with self._cond:
            if service_id not in self.services:
                return self._reply(req, 404, f'Unknown service ID "{service_id}"')
            self._remove_service(service_id)
        self._reply(req, 200)

    def _pass(self, req: BaseHTTPRequestHandler, check_id: str) -> None:
        with self._cond:
            check = self.checks.get(check_id)
            if check is None:
                return self._reply(req, 404, f'Unknown check ID "{check_id}"')
            if check.ttl_s is None:
                return self._reply(req, 500, f'CheckID "{check_id}" does not have associated TTL')
            check.last_pass = time.monotonic()
            self._set_status(check, "passing")
        self._reply(req, 200)

    def _health(self, req: BaseHTTPRequestHandler, name: str, query: dict[str, list[str]]) -> None:
        passing_only = "passing" in query and query["passing"][0] not in ("0", "false")
        wanted = int(query.get("index", ["0"])[0])
        wait_s = parse_duration(query["wait"][0]) if "wait" in query else 300.0
        with self._cond:
            if wanted > 0:
                deadline = time.monotonic() + wait_s
                while self.index <= wanted and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            out = []
            for svc in self.services.values():
                if svc.name != name:
                    continue
                checks = [self.checks[c] for c in svc.checks if c in self.checks]
                if passing_only and any(c.status != "passing" for c in checks):
                    continue
                out.append(
                    {
                        "Node": {"Node": "standin", "Address": "127.0.0.1"},
                        "Service": {
                            "ID": svc.service_id,
                            "Service": svc.name,
                            "Address": svc.address,
                            "Port": svc.port,
                            "Meta": svc.meta,
                            "Tags": [],
                        },
                        "Checks": [
                            {
                                "CheckID": c.check_id,
                                "Name": c.name,
                                "Status": c.status,
                                "ServiceID": svc.service_id,
                                "ServiceName": svc.name,
                            }
                            for c in checks
                        ],
                    }
                )
            index = self.index
        self._reply(req, 200, out, index=index)
