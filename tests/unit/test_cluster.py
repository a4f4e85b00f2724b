"""Multi-node conventions: Slurm hostlists and defaults, the multi-node command line, the worker environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from swiftrun.cluster import expand_hostlist, first_host, slurm_defaults
from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig
from swiftrun.errors import ConfigError
from swiftrun.launcher import envs
from tests.unit.test_cli import clean_env, config_of, invoke, launched  # noqa: F401  (fixtures)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07],gpu-[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-1", "gpu-2"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x[3].ib", ["x3.ib"]),
        (" ", []),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[a-b]", "n[5-2]", "n[]"])
def test_malformed_hostlist_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        expand_hostlist(bad)


def test_first_host_does_not_need_the_rest():
    assert first_host("gpu-[007-999],login") == "gpu-007"
    with pytest.raises(ConfigError):
        first_host("")


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "2", "SLURM_JOB_NUM_NODES": "4",
         "SLURM_JOB_NODELIST": "node[01-04]"}


def test_slurm_defaults():
    d = slurm_defaults(SLURM)
    assert d is not None
    assert (d.nnodes, d.node_rank, d.rdzv_id, d.endpoint_host) == ("4", 2, "4242", "node01")
    assert slurm_defaults(SLURM, spare_nodes=1).nnodes == "3"
    step = {**SLURM, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[03-04]"}
    assert (slurm_defaults(step).nnodes, slurm_defaults(step).endpoint_host) == ("2", "node03")
    assert slurm_defaults({**SLURM, "SWIFTRUN_SLURM": "0"}) is None
    assert slurm_defaults({"SLURM_JOB_ID": "1"}) is None  # not inside a step: no opinion
    with pytest.raises(ConfigError, match="leaves no training node"):
        slurm_defaults(SLURM, spare_nodes=4)
    with pytest.raises(ConfigError, match="SLURM_NODEID"):
        slurm_defaults({**SLURM, "SLURM_NODEID": "x"})


def test_slurm_fills_what_the_user_did_not_give(launched):
    config = config_of(launched, ["--nproc-per-node", "2", "train.py"], env=SLURM)
    assert (config.nnodes, config.node_rank, config.rdzv_id) == ((4, 4), 2, "4242")
    assert (config.rdzv_backend, config.rdzv_endpoint, config.master_addr, config.master_port) == (
        "c10d", "node01", "node01", 29400)
    assert config.world_size == 8 and config.multinode and not config.spare_node
    # the command line and PET_ win over Slurm
    config = config_of(launched, ["--nnodes", "3", "--rdzv-id", "mine", "train.py"],
                       env={**SLURM, "PET_NODE_RANK": "1", "PET_RDZV_ENDPOINT": "coord:1234",
                            "PET_RDZV_BACKEND": "c10d"})
    assert (config.nnodes, config.node_rank, config.rdzv_id, config.rdzv_endpoint) == ((3, 3), 1, "mine", "coord:1234")
    # the last --spare-nodes nodes of the allocation are hot spares
    config = config_of(launched, ["--spare-nodes", "1", "train.py"], env={**SLURM, "SLURM_NODEID": "3"})
    assert config.nnodes == (3, 3) and config.node_rank == 3 and config.spare_node


def test_torchrun_multinode_command_line(launched):
    args = ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:29555", "--rdzv-id", "job7", "train.py", "--lr", "1"]
    config = config_of(launched, args)
    assert (config.nnodes, config.node_rank, config.world_size) == ((2, 2), 1, 4)
    assert (config.master_addr, config.master_port, config.rdzv_id) == ("127.0.0.1", 29555, "job7")
    assert config.entrypoint.args == ("--lr", "1")
    # the same from Kubeflow's PET_ variables
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "c10d",
           "PET_RDZV_ENDPOINT": "127.0.0.1:29555", "PET_RDZV_ID": "job7"}
    assert config_of(launched, ["train.py", "--lr", "1"], env=pet) == config
    # static: --master-addr/--master-port name node 0's store
    config = config_of(launched, ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                  "--master-port", "29600", "train.py"])
    assert (config.rdzv_backend, config.master_addr, config.master_port) == ("static", "10.0.0.1", 29600)
    # MIN:MAX: MIN nodes train, the node ranks above are hot spares
    config = config_of(launched, ["--nnodes", "2:3", "--node-rank", "2", "--master-port", "5", "train.py"])
    assert config.world_size == 2 * 1 and config.spare_node
    config = config_of(launched, ["--nnodes", "2", "--master-port", "5", "--rdzv-conf",
                                  "join_timeout=7,control_port=6000", "train.py"])
    assert config.timeouts.join_timeout == 7.0 and config.control_port == 6000


def _ends() -> envs.JobEndpoints:
    return envs.JobEndpoints(master_addr="node01", master_port=29400, ctl_addr="ipc:///x", token="t",
                             run_id="job7", attempt_dir=Path("/logs/attempt_0"))


def test_worker_env_of_a_second_node_is_torchruns(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = LaunchConfig(entrypoint=Entrypoint(EntrypointKind.SCRIPT, "train.py"), nproc_per_node=2,
                          nnodes=(3, 3), node_rank=1, rdzv_id="job7", master_addr="node01", master_port=29400)
    env = envs.rank_env(config, _ends(), rank=3, attempt=0)
    # what torchrun 2.13 sets for global rank 3 of 3 nodes x 2 (observed: tests/integration/test_multinode.py)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                                "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")} == {
        "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "6", "MASTER_ADDR": "node01",
        "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }
    assert env["TORCHELASTIC_ERROR_FILE"] == "/logs/attempt_0/1/error.json"
