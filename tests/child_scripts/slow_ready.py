"""An HTTP server that only starts listening after DELAY seconds: GET /info (or any path) → 200.

argv: PORT DELAY
"""

import http.server
import signal
import sys
import time

port, delay = int(sys.argv[1]), float(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(delay)  # the slowness under test


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


print(f"slow_ready: listening on {port}", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
