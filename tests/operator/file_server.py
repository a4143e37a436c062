"""A real HTTP server on 127.0.0.1 serving weights from memory, for pull and node-agent tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class FileServer:
    """`files[path]` is served; `corrupt[path]` = how many answers to spoil, `fail_500[path]` = how many
    500s to answer first; paths in `no_length` are sent without Content-Length (read until close)."""

    files: dict[str, bytes] = field(default_factory=dict)
    corrupt: dict[str, int] = field(default_factory=dict)
    fail_500: dict[str, int] = field(default_factory=dict)
    no_length: set[str] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)
    url: str = ""

    def publish_dir(self, prefix: str, directory: Path) -> None:
        """Serve every file under ``directory`` at ``prefix`` + its relative path."""
        for path in directory.rglob("*"):
            if path.is_file():
                self.files[prefix + path.relative_to(directory).as_posix()] = path.read_bytes()


@contextmanager
def serve_files() -> Iterator[FileServer]:
    state = FileServer()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.requests.append(self.path)
            if state.fail_500.get(self.path, 0) > 0:
                state.fail_500[self.path] -= 1
                self.send_error(500)
                return
            body = state.files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            if state.corrupt.get(self.path, 0) > 0:
                state.corrupt[self.path] -= 1
                body = body[:-1] + bytes([body[-1] ^ 0xFF])
            self.send_response(200)
            if self.path not in state.no_length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
