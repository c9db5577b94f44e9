"""An environment that registers with the API ($ATROPOSD_API_URL) under its component name,
then runs until SIGTERM.  argv: [MARKER] as in cooperative.py."""

import json
import os
import signal
import sys
import time
import urllib.request

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if len(sys.argv) > 1:
    with open(sys.argv[1], "a") as fh:
        fh.write(f"{os.environ.get('ATROPOSD_NAME', '?')} {time.monotonic()}\n")
req = urllib.request.Request(
    os.environ["ATROPOSD_API_URL"] + "/register-env",
    method="POST",
    data=json.dumps({"desired_name": os.environ["ATROPOSD_NAME"]}).encode(),
    headers={"Content-Type": "application/json"},
)
urllib.request.urlopen(req, timeout=10).read()
print("registered", flush=True)
while True:
    signal.pause()
