"""Several machines (SPEC §12.3): the head's cluster endpoint and a node's client.

One atroposd runs on each machine. Node 0, the head, opens its endpoint (``ClusterHead``)
before it starts any child; every other node joins it (``ClusterNode``), heartbeats, reports
its components, and learns from it when the job stops. Each connection is one session whose
messages (``messages``: one dataclass per type) are signed under keys derived from the shared
cluster token, the head's challenge and the node's nonce, with a session id, a direction and a
rising sequence number (``wire``): none can be replayed. The token also gives the trainer ranks'
c10d store prefix (``store_secret``) and their command key (``ranks_key``).
"""

from atroposd.cluster.head import ClusterHead, ClusterStartError, heartbeat_interval
from atroposd.cluster.membership import JOINING, LOST, READY, STATES, replicas_ready
from atroposd.cluster.node import ClusterJoinTimeout, ClusterNode, ClusterRefused
from atroposd.cluster.wire import ranks_key, store_secret

__all__ = [
    "JOINING",
    "LOST",
    "READY",
    "STATES",
    "ClusterHead",
    "ClusterJoinTimeout",
    "ClusterNode",
    "ClusterRefused",
    "ClusterStartError",
    "heartbeat_interval",
    "ranks_key",
    "replicas_ready",
    "store_secret",
]
