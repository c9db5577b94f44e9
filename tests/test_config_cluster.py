"""Config: ``[cluster]`` (SPEC §12.3) and ``[trainer] checkpoint_dir`` (SPEC §12.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from atroposd.cluster.head import bind_address
from atroposd.config import (
    ApiConfig,
    ClusterConfig,
    ClusterError,
    TokenError,
    dump_toml,
    inference_secret,
    parse_toml,
)
from atroposd.paths import Paths
from tests.support import config_problems

RANK_VARS = ("ATROPOSD_NODE_RANK", "SLURM_NODEID")


@pytest.fixture(autouse=True)
def _no_rank_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test machine under SLURM must not lend its SLURM_NODEID to these tests."""
    for var in RANK_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.token"
    path.write_text("s3cret-of-the-job\n")
    path.chmod(0o600)
    return path


def _two_nodes(token: Path, tmp_path: Path, *, head: str = "127.0.0.1", rank: int = 1, extra: str = "") -> str:
    return (
        f'[cluster]\nnodes = 2\nnode_rank = {rank}\nhead = "{head}"\ntoken_file = "{token}"\n{extra}'
        f'[trainer]\ncheckpoint_dir = "{tmp_path / "shared-ckpt"}"\n'
    )


def test_one_node_is_today() -> None:
    cfg = parse_toml("")
    c = cfg.cluster
    assert (c.nodes, c.node_rank, c.head, c.port, c.token_file) == (1, -1, "", 29400, "")
    assert (c.heartbeat_timeout, c.join_timeout) == (30.0, 600.0)
    assert not c.enabled
    assert c.resolve_node_rank() == 0
    assert cfg.checkpoint_dir == cfg.state_dir / "checkpoints" == Paths.of(cfg).checkpoints_dir


def test_a_valid_two_node_config_loads_and_round_trips(token: Path, tmp_path: Path) -> None:
    cfg = parse_toml(_two_nodes(token, tmp_path, extra="port = 29500\nheartbeat_timeout = 5.0\n"))
    assert cfg.cluster.enabled and cfg.cluster.resolve_node_rank() == 1
    assert cfg.cluster.read_token() == b"s3cret-of-the-job"
    assert cfg.checkpoint_dir == tmp_path / "shared-ckpt" == Paths.of(cfg).checkpoints_dir
    again = parse_toml(dump_toml(cfg))
    assert again.cluster == cfg.cluster and again.trainer == cfg.trainer


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ("[cluster]\nnodes = 2\n", "cluster.head: required when cluster.nodes > 1"),
        ("[cluster]\nnodes = 2\n", "cluster.token_file: required when cluster.nodes > 1"),
        ("[cluster]\nnodes = 2\n", "trainer.checkpoint_dir: required when cluster.nodes > 1"),
        ("[cluster]\nnodes = 2\n", "cluster.node_rank: cluster.node_rank = -1 and neither $ATROPOSD_NODE_RANK"),
        ("[cluster]\nnodes = 0\n", "cluster.nodes: must be ≥ 1, got 0"),
        ("[cluster]\nnode_rank = -2\n", "cluster.node_rank: must be ≥ -1, got -2"),
        (
            "[cluster]\nnode_rank = 1\n",
            "cluster.node_rank: node rank 1 (from cluster.node_rank) must be < cluster.nodes (1)",
        ),
        ("[cluster]\nport = 65535\n", "cluster.port: must be ≤ 65534"),
        # below 1 s a node's give-up time (heartbeat_timeout less one interval) would be ~0 or less
        ("[cluster]\nheartbeat_timeout = 0.5\n", "cluster.heartbeat_timeout: must be ≥ 1, got 0.5"),
        ('[cluster]\nbind = "http://n0"\n', "cluster.bind: must be a host name or address without a scheme or port"),
        ('[cluster]\nbind = "n0:29400"\n', "cluster.bind: must be a host name or address without a scheme or port"),
        ("[cluster]\njoin_timeout = -1.0\n", "cluster.join_timeout: must be > 0"),
        ('[cluster]\nhead = "http://n0"\n', "cluster.head: must be a host name or address without a scheme or port"),
        ('[cluster]\nhead = "n0:29400"\n', "cluster.head: must be a host name or address without a scheme or port"),
        ("[cluster]\nnodes = 2\nheartbeat = 3\n", "cluster.heartbeat: unknown key (did you mean 'heartbeat_timeout'?)"),
        ("[clusters]\nnodes = 2\n", "clusters: unknown section (did you mean 'cluster'?)"),
    ],
)
def test_invalid_cluster_settings_name_their_key(extra: str, fragment: str) -> None:
    found = config_problems(extra)
    assert any(fragment in p for p in found), found


def test_an_ipv6_head_is_an_address_not_a_port() -> None:
    assert parse_toml('[cluster]\nhead = "fd00::1"\n').cluster.head == "fd00::1"


def test_token_file_must_be_readable_and_not_empty(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    found = config_problems(_two_nodes(missing, tmp_path))
    assert any(p.startswith("cluster.token_file: cannot read") and str(missing) in p for p in found), found
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    found = config_problems(_two_nodes(empty, tmp_path))
    assert any(p == f"cluster.token_file: {empty} is empty" for p in found), found


def test_a_token_file_under_16_bytes_is_refused_and_one_others_can_read_warns(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("fifteen-bytes!!\n")  # 15 bytes once the newline is stripped
    short.chmod(0o600)
    found = config_problems(_two_nodes(short, tmp_path))
    assert any(
        p.startswith(f"cluster.token_file: {short} holds 15 bytes; a token must have at least 16") for p in found
    ), found
    found = config_problems(f'[inference]\ntoken_file = "{short}"\n')
    assert any(p.startswith("inference.token_file:") and "holds 15 bytes" in p for p in found), found
    with pytest.raises(TokenError, match=r"api\.token_file: .* holds 15 bytes"):
        ApiConfig(token_file=str(short)).bearer_token()
    ok = tmp_path / "ok"
    ok.write_text("sixteen-bytes!!!\n")
    ok.chmod(0o600)
    cfg = parse_toml(_two_nodes(ok, tmp_path) + f'[api]\nhost = "127.0.0.1"\ntoken_file = "{ok}"\n')
    assert cfg.cluster.read_token() == b"sixteen-bytes!!!" and cfg.api.bearer_token() == "sixteen-bytes!!!"
    assert not [w for w in cfg.warnings if "token_file" in w], cfg.warnings
    ok.chmod(0o644)
    cfg = parse_toml(_two_nodes(ok, tmp_path) + f'[api]\nhost = "127.0.0.1"\ntoken_file = "{ok}"\n')
    for key in ("cluster.token_file", "api.token_file"):
        assert any(w.startswith(f"{key}: {ok} is readable by other users (mode 0644)") for w in cfg.warnings), (
            cfg.warnings
        )


def test_the_inference_token_comes_from_its_file_or_the_cluster_token(token: Path, tmp_path: Path) -> None:
    assert parse_toml("").inference_token() == ""  # one machine, no file: none
    two = parse_toml(_two_nodes(token, tmp_path))
    derived = two.inference_token()
    assert len(derived) == 64 and derived.encode() != two.cluster.read_token()
    assert derived == inference_secret(b"s3cret-of-the-job") != inference_secret(b"another-secret-of-a-job")
    own = tmp_path / "inference.token"
    own.write_text("an-inference-token-of-its-own\n")
    own.chmod(0o600)
    assert (
        parse_toml(_two_nodes(token, tmp_path) + f'[inference]\ntoken_file = "{own}"\n').inference_token()
        == "an-inference-token-of-its-own"
    )


def test_bind_defaults_to_the_address_head_resolves_to(token: Path, tmp_path: Path) -> None:
    cfg = parse_toml(_two_nodes(token, tmp_path, head="127.0.0.1"))
    assert bind_address(cfg.cluster) == "127.0.0.1"
    assert bind_address(parse_toml(_two_nodes(token, tmp_path, head="localhost")).cluster) == "127.0.0.1"
    cfg = parse_toml(_two_nodes(token, tmp_path, head="127.0.0.1", extra='bind = "127.0.0.2"\n'))
    assert bind_address(cfg.cluster) == "127.0.0.2"
    # a wildcard API or inference host binds the cluster's address with several machines, and
    # the URLs the children use follow it
    cfg = parse_toml(
        _two_nodes(token, tmp_path, head="127.0.0.1", rank=0, extra='bind = "127.0.0.2"\n')
        + '[inference]\nhost = "0.0.0.0"\n[api]\nhost = "0.0.0.0"\n'
    )
    assert cfg.listen_host(cfg.inference.host) == "127.0.0.2" and cfg.inference_urls == ["http://127.0.0.2:9001"]
    assert cfg.api_url == "http://127.0.0.2:8000"
    assert parse_toml('[inference]\nhost = "0.0.0.0"\n').listen_host("0.0.0.0") == "0.0.0.0"  # one machine


def test_loopback_hosts_are_valid_exactly_with_a_loopback_head(token: Path, tmp_path: Path) -> None:
    # one machine acting as two nodes: loopback everywhere is fine
    parse_toml(_two_nodes(token, tmp_path, head="localhost"))
    # a real head: the default loopback api.host and inference.host cannot be reached
    found = config_problems(_two_nodes(token, tmp_path, head="node-a.cluster"))
    assert any(p.startswith("api.host: '127.0.0.1' is loopback") for p in found), found
    assert any(p.startswith("inference.host: '127.0.0.1' is loopback") for p in found), found
    ok = _two_nodes(token, tmp_path, head="10.0.0.5") + '[api]\nhost = "0.0.0.0"\n[inference]\nhost = "10.0.0.6"\n'
    parse_toml(ok)
    # an external API is not bound here: its host does not matter
    parse_toml(
        _two_nodes(token, tmp_path, head="10.0.0.5")
        + '[api]\nenabled = false\nurl = "http://10.0.0.5:8000"\n[inference]\nhost = "0.0.0.0"\n'
    )


def test_checkpoint_dir_is_not_needed_without_a_trainer(token: Path) -> None:
    parse_toml(
        f'[cluster]\nnodes = 2\nnode_rank = 0\nhead = "127.0.0.1"\ntoken_file = "{token}"\n[trainer]\nenabled = false\n'
    )


def test_cluster_ports_are_claimed_with_the_others(token: Path, tmp_path: Path) -> None:
    found = config_problems(_two_nodes(token, tmp_path, extra="port = 7999\n"))
    assert any(
        p.startswith("cluster.port: port 8000 (the trainer ranks' c10d store: port + 1) is already used by api.port")
        for p in found
    ), found
    # with one node the port is not used: no clash
    parse_toml("[cluster]\nport = 8000\n")


def test_node_rank_from_the_environment_then_the_host_name() -> None:
    c = ClusterConfig(nodes=4)
    assert c.resolve_node_rank({"ATROPOSD_NODE_RANK": "2", "SLURM_NODEID": "3"}, "x") == 2
    assert c.resolve_node_rank({"SLURM_NODEID": "3"}, "x") == 3
    assert c.resolve_node_rank({}, "atroposd-1.atroposd.default.svc.cluster.local") == 1
    assert c.resolve_node_rank({"ATROPOSD_NODE_RANK": ""}, "job-worker-0") == 0
    with pytest.raises(ClusterError, match=r"\$SLURM_NODEID = 'x1' is not a node rank"):
        c.resolve_node_rank({"SLURM_NODEID": "x1"}, "h-0")
    with pytest.raises(ClusterError, match=r"node rank 4 \(from \$ATROPOSD_NODE_RANK\) must be < cluster.nodes \(4\)"):
        c.resolve_node_rank({"ATROPOSD_NODE_RANK": "4"}, "h-0")
    with pytest.raises(ClusterError, match=r"node rank 7 \(from the host name 'atroposd-7'\) must be <"):
        c.resolve_node_rank({}, "atroposd-7")
    with pytest.raises(ClusterError, match=r"the host name 'gpu017' ends in no ordinal"):
        c.resolve_node_rank({}, "gpu017")
    # an explicit node_rank wins over the environment
    assert ClusterConfig(nodes=4, node_rank=0).resolve_node_rank({"SLURM_NODEID": "3"}, "h-2") == 0


def test_config_check_reads_the_rank_from_the_environment(
    token: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _two_nodes(token, tmp_path).replace("node_rank = 1\n", "")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert parse_toml(text).cluster.resolve_node_rank() == 1
    monkeypatch.setenv("SLURM_NODEID", "2")
    found = config_problems(text)
    assert found == ["cluster.node_rank: node rank 2 (from $SLURM_NODEID) must be < cluster.nodes (2)"]
