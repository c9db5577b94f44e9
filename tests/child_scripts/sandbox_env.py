"""An environment that runs containers through DOCKER_HOST (docker-py), as agent environments do:
it starts ``N`` long-running containers, writes their ids (one line each, appended) to ``FILE``,
then waits to be stopped.

usage: sandbox_env.py FILE N IMAGE"""

from __future__ import annotations

import sys
import time

import docker


def main() -> None:
    out, n, image = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    client = docker.from_env()
    for _ in range(n):
        c = client.containers.run(image, ["sh", "-c", "trap '' TERM; while true; do sleep 1; done"], detach=True)
        with open(out, "a") as f:
            f.write(c.id + "\n")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
