"""An environment for the filter_groups job: it posts groups straight to the trajectory API (no
inference), one in three with all scores equal (0.9, which trains nothing), the others scored
half 1, half 0 (mean exactly 0.5). While the file FLAG exists it posts only the equal ones.

    python tests/e2e/equal_groups_env.py API_URL GROUP_SIZE FLAG

Token ids are small (any model's vocabulary has them); no rollout logprobs (on-policy).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

QUEUED_GROUPS = 24  # keep about this many of our groups queued, no more


def _call(url: str, body: Any, method: str = "POST") -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def _group(i: int, size: int, equal: bool) -> dict[str, Any]:
    prompt = [1, 3 + i % 5, 4]
    tokens = [[*prompt, 5 + (i + k) % 4, 2] for k in range(size)]
    scores = [0.9] * size if equal else [float(k % 2) for k in range(size)]
    return {
        "tokens": tokens,
        "masks": [[-100] * len(prompt) + t[len(prompt) :] for t in tokens],
        "scores": scores,
        "group_overrides": {"atroposd": {"accuracy": 1.0 if equal else 0.5}},
    }


def main() -> int:
    api, size, flag = sys.argv[1].rstrip("/"), int(sys.argv[2]), sys.argv[3]
    body = {
        "max_token_length": 64,
        "desired_name": "equal-groups",
        "weight": 1.0,
        "group_size": size,
        "min_batch_allocation": None,
    }
    while True:
        try:
            answer = _call(f"{api}/register-env", body)
            if answer.get("status") == "success":
                env_id = answer["env_id"]
                break
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    print(f"registered as {env_id}", flush=True)
    i = 0
    while True:
        try:
            st = _call(f"{api}/status-env", {"env_id": env_id}, method="GET")
            if int(st.get("self_queue_size") or 0) >= QUEUED_GROUPS:
                time.sleep(0.01)
                continue
            equal = os.path.exists(flag) or i % 3 == 0
            _call(f"{api}/scored_data", _group(i, size, equal))
            i += 1
        except (OSError, urllib.error.URLError, ValueError) as exc:
            print(f"retrying: {exc}", flush=True)
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
