"""A stand-in trajectory API for supervisor tests: /info, /status, /register-env and
/atroposd/registrations (credits by desired_name), in the shapes of docs/ARCHITECTURE.md.

argv: PORT [MARKER] — "api <monotonic>" is appended to MARKER once it listens.
"""

import http.server
import json
import signal
import sys
import time

port = int(sys.argv[1])
registrations: list[dict] = []
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, obj: object, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/info":
            self._send({"batch_size": -1, "max_token_len": -1})
        elif self.path == "/status":
            self._send(
                {
                    "current_step": 0,
                    "queue_size": 0,
                    "queued_sequences": 3,
                    "capacity": 8192,
                    "registered": bool(registrations),
                    "started": False,
                }
            )
        elif self.path == "/atroposd/registrations":
            self._send({"registrations": registrations})
        else:
            self._send({"error": "not found"}, 404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/register-env":
            registrations.append(
                {
                    "env_id": len(registrations),
                    "desired_name": body.get("desired_name", ""),
                    "peer_pid": None,
                    "status": "wait",
                    "at": time.time(),
                }
            )
            self._send({"status": "wait for trainer to start"})
        else:
            self._send({"error": "not found"}, 404)

    def log_message(self, *args: object) -> None:
        pass


server = http.server.HTTPServer(("127.0.0.1", port), Handler)
if len(sys.argv) > 2:
    with open(sys.argv[2], "a") as fh:
        fh.write(f"api {time.monotonic()}\n")
print(f"fake_api: listening on {port}", flush=True)
server.serve_forever()
