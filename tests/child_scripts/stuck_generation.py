"""A stand-in inference server whose generation loop gets stuck: ``GET /health`` on PORT
always answers 200, but on the control socket SOCKET only the first ``POST /probe_generate``
(the readiness probe) answers; every later one never returns.

argv: PORT SOCKET
"""

import http.server
import json
import os
import signal
import socketserver
import sys
import threading

port, sock_path = int(sys.argv[1]), sys.argv[2]
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
generations = 0


class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, obj: object, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(
            {"status": "ok"} if self.path == "/health" else {"error": "not found"},
            200 if self.path == "/health" else 404,
        )

    def do_POST(self) -> None:
        global generations
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path != "/probe_generate":
            self._send({"error": "not found"}, 404)
            return
        generations += 1
        if generations > 1:
            threading.Event().wait()  # the engine's generation loop is stuck
        self._send({"text": ["x"], "weight_version": 0})

    def log_message(self, *args: object) -> None:
        pass


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):  # type: ignore[no-untyped-def]
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)


if os.path.exists(sock_path):
    os.unlink(sock_path)
tcp = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
tcp.daemon_threads = True
control = UnixServer(sock_path, Handler)
threading.Thread(target=control.serve_forever, daemon=True).start()
tcp.serve_forever()
