"""The daemon's Prometheus endpoint (`--metrics-port`), bounded like every port of ours.

prometheus_client's own server starts a thread per connection and never times one out: a
thousand connections that send nothing held a thousand threads (tests/integration/
test_port_floods.py). This one serves the same WSGI app with at most MAX_CONNECTIONS at once
-- a connection beyond them is closed unread -- and drops a client that sends nothing for
IDLE_S. A scraper asks once every few seconds and is answered in milliseconds.
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from socketserver import ThreadingMixIn

MAX_CONNECTIONS = 8
IDLE_S = 5.0


class _Handler(WSGIRequestHandler):
    timeout = IDLE_S  # a read that waits longer ends the connection

    def log_message(self, format, *args):  # noqa: A002 -- scrapes are not news
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(host: str, port: int, registry) -> tuple[WSGIServer, threading.Thread]:
    """Serve `registry` at http://host:port/metrics from a daemon thread."""
    from prometheus_client import make_wsgi_app

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    server = make_server(host, port, make_wsgi_app(registry), server_class,
                         handler_class=_Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="lazarus-metrics")
    thread.start()
    return server, thread
