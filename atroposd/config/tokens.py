"""The secrets a config names: token files (read, size-checked, their mode warned about), the
systemd credentials that stand in for an empty ``token_file``, and the inference servers'
token derived from the cluster token."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path


class TokenError(ValueError):
    """``[api] token_file`` or ``[inference] token_file`` names a file that cannot give a
    token; the message says why."""


API_TOKEN_ENV = "ATROPOSD_API_TOKEN"
INFERENCE_TOKEN_ENV = "ATROPOSD_INFERENCE_TOKEN"
# systemd credentials (the shipped unit's LoadCredential=, from /etc/credstore/): used when the
# token_file key is empty.
CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"
CLUSTER_CREDENTIAL = "atroposd-cluster.token"
API_CREDENTIAL = "atroposd-api.token"


def credential_file(name: str) -> str:
    """``$CREDENTIALS_DIRECTORY/name`` when systemd passed that credential to the daemon, else ""."""
    directory = os.environ.get(CREDENTIALS_ENV, "")
    if not directory:
        return ""
    path = Path(directory) / name
    return str(path) if path.is_file() else ""


# The shortest secret a token file may hold (SPEC §12.3): anything shorter is guessable.
MIN_TOKEN_BYTES = 16


_INFERENCE_LABEL = b"atroposd inference bearer token v1"


def inference_secret(cluster_token: bytes) -> str:
    """The inference servers' bearer token derived from the cluster token (when ``[inference]
    token_file`` is not set): 64 hex characters, the same on every node, unrelated to the cluster
    endpoint's signing key and the store's prefix (each an HMAC of the token under its own label)."""
    return hmac.new(cluster_token, _INFERENCE_LABEL, hashlib.sha256).hexdigest()


def read_token_file(name: str, key: str, error: type[ValueError]) -> bytes:
    """The secret in the file ``name`` (surrounding whitespace stripped); ``error`` naming
    ``key`` for a file that cannot be read, is empty, or holds fewer than MIN_TOKEN_BYTES."""
    path = Path(name).expanduser()
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise error(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    if not token:
        raise error(f"{key}: {path} is empty")
    if len(token) < MIN_TOKEN_BYTES:
        raise error(
            f"{key}: {path} holds {len(token)} bytes; a token must have at least {MIN_TOKEN_BYTES} "
            "(make one with: openssl rand -hex 32)"
        )
    return token


def token_file_warning(name: str, key: str) -> str | None:
    """A warning when the token file ``name`` may be read by users other than its owner."""
    path = Path(name).expanduser()
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # reading it is what fails, and says so
    if mode & 0o044:
        return f"{key}: {path} is readable by other users (mode {mode & 0o777:04o}); make it private: chmod 600 {path}"
    return None
