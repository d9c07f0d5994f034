"""A controllable OTLP/HTTP metrics receiver on loopback, built on ``opentelemetry-proto``.

Unlike ``OtlpProtoTestServer`` it keeps each export request whole and can misbehave on purpose: answer
with an error status, or hold requests until the test releases them (a slow receiver).
"""

from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

__all__ = ["OtlpReceiver", "attributes_of", "metrics_by_name"]


def attributes_of(point: Any) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in point.attributes}


def metrics_by_name(request: ExportMetricsServiceRequest) -> dict[str, Any]:
    """The request's metrics keyed by name (one resource and scope, as the exporter sends)."""
    return {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


class OtlpReceiver:
    """Records every ``POST /v1/metrics`` on 127.0.0.1 (``port=0`` picks a free port)."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.status = 200  # what to answer (e.g. 503 to fail)
        self.release = threading.Event()  # cleared: requests wait (a slow receiver)
        self.release.set()
        self.arrived = threading.Event()  # set when a request came in (before waiting on release)
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                receiver.arrived.set()
                receiver.release.wait()
                status = receiver.status
                if status == 200 and self.path == "/v1/metrics":
                    request = ExportMetricsServiceRequest()
                    request.ParseFromString(body)
                    with receiver._cond:
                        receiver.requests.append(request)
                        receiver._cond.notify_all()
                    payload = ExportMetricsServiceResponse().SerializeToString()
                else:
                    status = status if status != 200 else 404
                    payload = b""
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/metrics"

    def wait_for(self, count: int, timeout: float = 60.0) -> list[ExportMetricsServiceRequest]:
        """Wait until ``count`` requests were recorded; returns them all."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.requests) >= count, timeout):
                raise AssertionError(f"{len(self.requests)} of {count} OTLP requests arrived")
            return list(self.requests)

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
