"""Every SWIFTRUN_* setting the runtime reads is read in runtime/worker/env.py: the parsing, and that nothing else
in the runtime reads one."""

from __future__ import annotations

import ast
from pathlib import Path

from swiftrun.runtime.worker.env import Settings, launcher_pid

RUNTIME = Path(__file__).resolve().parents[2] / "swiftrun" / "runtime"


def test_unset_settings_are_the_defaults():
    assert Settings.read({}) == Settings()
    assert Settings().parallel_replay == -1 and Settings().log_budget is None and Settings().verify_every == 0


def test_settings_from_the_launchers_variables():
    got = Settings.read({"SWIFTRUN_LOGLEVEL": "info", "SWIFTRUN_CKPT_EVERY": "5", "SWIFTRUN_STAGE_CKPT_DIR": "/d",
                         "SWIFTRUN_LOG_MEMORY": "1024", "SWIFTRUN_LOG_SPILL_DIR": "/s", "SWIFTRUN_LOG_BUDGET": "0",
                         "SWIFTRUN_VERIFY_EVERY": "50", "SWIFTRUN_TRANSFER_CHUNK_MB": "4",
                         "SWIFTRUN_PARALLEL_REPLAY": "0"})
    assert got == Settings(loglevel="info", ckpt_every=5, stage_ckpt_dir="/d", log_memory=1024, log_spill_dir="/s",
                           log_budget=0, verify_every=50, transfer_chunk_mb=4, parallel_replay=0)


def test_a_malformed_count_falls_back_to_its_default_instead_of_crashing_a_worker():
    got = Settings.read({"SWIFTRUN_VERIFY_EVERY": "often", "SWIFTRUN_CKPT_EVERY": "x", "SWIFTRUN_TRANSFER_CHUNK_MB": ""})
    assert got.verify_every == 0 and got.ckpt_every is None and got.transfer_chunk_mb == 0
    assert launcher_pid({"SWIFTRUN_LAUNCHER_PID": "12x"}) == 0 and launcher_pid({"SWIFTRUN_LAUNCHER_PID": "42"}) == 42


def test_no_runtime_module_but_worker_env_reads_a_swiftrun_variable():
    readers = []
    for path in RUNTIME.rglob("*.py"):
        if path == RUNTIME / "worker" / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("SWIFTRUN_"):
                readers.append(f"{path.relative_to(RUNTIME)}:{node.lineno} {node.value}")
    assert readers == []
