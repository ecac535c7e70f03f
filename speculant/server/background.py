"""A uvicorn server on a loopback port in a background thread (tests, the serve load bench)."""
from __future__ import annotations

import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """Serves ``app`` on 127.0.0.1 (a free port unless given) until ``close()``."""

    def __init__(self, app, port: int | None = None, start_timeout: float = 20.0):
        import uvicorn

        self.app, self.port = app, port or free_port()
        # keep-alive longer than clients keep idle connections (httpx: 5 s)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    timeout_keep_alive=30))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on port {self.port}")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
