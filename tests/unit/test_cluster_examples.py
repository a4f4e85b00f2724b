"""The Slurm batch script and the Kubernetes manifest in examples/: the swiftrun command each contains, with the
environment that system gives each node, is accepted by swiftrun's CLI and means the job the comments describe.
Nothing is launched (the CLI's launch is replaced, as in test_cli)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.unit.test_cli import clean_env, config_of, launched  # noqa: F401  (fixtures)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def in_the_repository(clean_env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Both examples run from the repository's root (the script path is examples/train_dp.py)."""
    monkeypatch.chdir(EXAMPLES.parent)


def _expand(text: str, env: dict[str, str]) -> str:
    """The shell's ${NAME:-default}, ${NAME} and $NAME (all the script uses)."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), text)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env[m.group(1) or m.group(2)], text)


def sbatch_command(env: dict[str, str]) -> tuple[list[str], list[str], dict[str, str]]:
    """(srun's flags, swiftrun's arguments, the script's variables) of examples/slurm/train_dp.sbatch."""
    lines = (EXAMPLES / "slurm" / "train_dp.sbatch").read_text().replace("\\\n", " ").splitlines()
    variables = dict(env)
    for line in lines:
        m = re.match(r"^(\w+)=(\S+)", line)
        if m:
            variables[m.group(1)] = _expand(m.group(2), variables)
    (srun,) = [line for line in lines if line.strip().startswith("srun ")]
    words = shlex.split(_expand(srun, variables))
    at = words.index("swiftrun")
    return words[1:at], words[at + 1:], variables


SLURM = {"SLURM_JOB_ID": "777", "SLURM_JOB_NUM_NODES": "5", "SLURM_STEP_NUM_NODES": "5",
         "SLURM_JOB_NODELIST": "gpu[07-11]", "SLURM_STEP_NODELIST": "gpu[07-11]"}


def test_the_sbatch_script_asks_srun_for_one_swiftrun_per_node_that_survives_a_lost_node():
    srun, _, _ = sbatch_command({**SLURM, "SLURM_NODEID": "0"})
    assert {"--ntasks-per-node=1", "--kill-on-bad-exit=0", "--no-kill"} <= set(srun)
    header = (EXAMPLES / "slurm" / "train_dp.sbatch").read_text()
    assert "#SBATCH --nodes=5" in header and "#SBATCH --ntasks-per-node=1" in header


@pytest.mark.parametrize("node_id, spare", [("0", False), ("3", False), ("4", True)])
def test_the_sbatch_command_is_a_node_of_the_job_from_slurms_variables(launched, node_id, spare):
    _, args, variables = sbatch_command({**SLURM, "SLURM_NODEID": node_id})
    config = config_of(launched, args, env={**SLURM, "SLURM_NODEID": node_id})
    assert config.nnodes == (4, 4) and config.node_rank == int(node_id) and config.spare_node is spare
    assert config.nproc_per_node == int(variables["NPROC"]) == 8 and config.world_size == 32
    assert (config.rdzv_backend, config.master_addr, config.master_port, config.rdzv_id) == (
        "c10d", "gpu07", 29400, "777")
    assert config.entrypoint.target == "examples/train_dp.py"
    assert "out/777" in config.entrypoint.args
    assert (config.timeouts.node_lease, config.timeouts.node_timeout) == (5.0, 10.0)


def test_the_sbatch_defaults_can_be_overridden(launched):
    env = {**SLURM, "SLURM_NODEID": "1", "SPARE_NODES": "0", "NPROC": "4",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    _, args, _ = sbatch_command(env)
    config = config_of(launched, args, env=env)
    assert (config.nnodes, config.nproc_per_node, config.node_rank) == ((2, 2), 4, 1)


def manifest() -> tuple[dict, dict]:
    service, job = yaml.safe_load_all((EXAMPLES / "kubernetes" / "train_dp.yaml").read_text())
    return service, job


def pod_env(container: dict, index: int) -> dict[str, str]:
    """The container's environment in the pod of completion index ``index``."""
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            env[var["name"]] = str(index)
    return env


def test_the_manifest_restarts_one_slot_without_recreating_the_others():
    service, job = manifest()
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 5
    assert spec["backoffLimitPerIndex"] >= 1 and spec["podReplacementPolicy"] == "Failed"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    # the coordinator's address resolves through the headless Service
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert {p["port"] for p in service["spec"]["ports"]} == {29400, 29401}


@pytest.mark.parametrize("index, spare", [(0, False), (3, False), (4, True)])
def test_the_manifest_command_is_a_node_of_the_job_from_its_pet_variables(launched, index, spare):
    _, job = manifest()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["swiftrun"]
    config = config_of(launched, list(container["args"]), env=pod_env(container, index))
    assert config.nnodes == (4, 4) and config.node_rank == index and config.spare_node is spare
    assert config.world_size == 32 and config.rdzv_id == job["metadata"]["name"]
    host = f"{job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}"
    assert (config.rdzv_backend, config.master_addr, config.master_port) == ("c10d", host, 29400)
    assert (config.timeouts.node_lease, config.timeouts.node_timeout) == (5.0, 10.0)


# --- examples/slurm/train_dp_coordinator.sbatch: `swiftrun coordinator` on the batch host ---------------------


def coordinator_sbatch(env: dict[str, str]) -> tuple[list[str], list[str], str]:
    """(the coordinator's arguments, an agent's arguments, the srun line) with the script's JOB and TRAIN."""
    text = (EXAMPLES / "slurm" / "train_dp_coordinator.sbatch").read_text().replace("\\\n", " ")
    variables = dict(env)  # COORDINATOR and TRAIN_NODES (command substitution, arithmetic) come from the test
    for m in re.finditer(r"^(\w+)=(\$\{\w+:-\w+\})", text, re.M):
        variables.setdefault(m.group(1), _expand(m.group(2), variables))
    for name in ("JOB", "TRAIN"):
        (value,) = re.findall(rf'^{name}="([^"]*)"', text, re.M)
        variables[name] = _expand(value, variables)
    (coordinator,) = [line for line in text.splitlines() if line.startswith("swiftrun coordinator ")]
    (srun,) = [line for line in text.splitlines() if line.strip().startswith("srun ")]
    agent = re.search(r'bash -c "exec swiftrun (.*)"', srun).group(1).replace("\\${SLURM_PROCID}", env["SLURM_PROCID"])
    return shlex.split(_expand(coordinator.rstrip(" &"), variables))[2:], shlex.split(_expand(agent, variables)), srun


@pytest.mark.parametrize("procid, spare", [("0", False), ("4", True)])
def test_the_coordinator_sbatch_runs_one_job_with_its_coordinator_off_the_training_nodes(
        launched, monkeypatch, procid, spare):
    from swiftrun import cli
    from swiftrun.launcher.coordinator import fingerprint
    import swiftrun.launcher

    env = {**SLURM, "SLURM_JOB_NUM_NODES": "6", "SLURM_NODEID": procid, "SLURM_PROCID": procid,
           "SPARE_NODES": "1", "COORDINATOR": "gpu07", "TRAIN_NODES": "4"}
    coordinator_args, agent_args, srun = coordinator_sbatch(env)
    assert {"--ntasks-per-node=1", "--kill-on-bad-exit=0", "--no-kill", "--exclude=${COORDINATOR}"} <= set(srun.split())
    served: list = []
    monkeypatch.setattr(swiftrun.launcher, "coordinate", lambda config: served.append(config) or 0, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        cli.main(["coordinator", *coordinator_args])
    agent = config_of(launched, agent_args, env=env)
    (coordinator,) = served
    assert fingerprint(agent) == fingerprint(coordinator)  # the coordinator accepts these agents
    assert agent.external_coordinator and agent.node_rank == int(procid) and agent.spare_node is spare
    store = (coordinator.master_addr, coordinator.master_port)
    assert (agent.master_addr, agent.master_port) == store == ("gpu07", 29400)
    assert coordinator.nnodes == (4, 4) and coordinator.nproc_per_node == 8


# --- examples/kubernetes/train_dp_coordinator.yaml: the coordinator in a pod of its own ------------------------


@pytest.mark.parametrize("index, spare", [(0, False), (4, True)])
def test_the_coordinator_manifest_runs_one_job_with_its_coordinator_in_its_own_pod(launched, monkeypatch, index,
                                                                                  spare):
    from swiftrun import cli
    from swiftrun.launcher.coordinator import fingerprint
    import swiftrun.launcher

    service, coordinator_pod, job = yaml.safe_load_all(
        (EXAMPLES / "kubernetes" / "train_dp_coordinator.yaml").read_text())
    assert (service["kind"], coordinator_pod["kind"], job["kind"]) == ("Service", "Pod", "Job")
    pod = coordinator_pod["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == service["metadata"]["name"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= coordinator_pod["metadata"]["labels"].items()
    (server,) = pod["containers"]
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    assert server["command"] == ["swiftrun", "coordinator"] and server["args"] == trainer["args"]
    served: list = []
    monkeypatch.setattr(swiftrun.launcher, "coordinate", lambda config: served.append(config) or 0, raising=False)
    for name, value in pod_env(server, 0).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        cli.main(["coordinator", *server["args"]])
    for name in pod_env(server, 0):
        monkeypatch.delenv(name)
    agent = config_of(launched, list(trainer["args"]), env=pod_env(trainer, index))
    (coordinator,) = served
    assert fingerprint(agent) == fingerprint(coordinator)  # the coordinator accepts these agents
    assert agent.external_coordinator and agent.node_rank == index and agent.spare_node is spare
    host = f"{pod['hostname']}.{pod['subdomain']}"
    assert (agent.master_addr, agent.master_port) == (coordinator.master_addr, coordinator.master_port) == (host, 29400)
