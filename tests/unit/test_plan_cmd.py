"""``swiftrun plan``: inputs (profile file or flags), the printed plan and curve, errors, the optional plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swiftrun import cli
from swiftrun.cli.plan import (
    PLOT_INSTALL_HINT,
    build_input,
    load_profile,
    main,
    profile_from_dict,
    profile_to_dict,
    shown_rows,
)
from swiftrun.logplan.planner import PlanError, PlanInput, choose_plan, tradeoff_curve

GiB = 2**30
NUMBERS = ["--stages", "10,1,1,4", "--boundary-bytes", "256MiB,256MiB,128MiB", "--ckpt-every", "100"]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich sizes tables to COLUMNS when the output is not a terminal; fix it so lines never wrap."""
    monkeypatch.setenv("COLUMNS", "160")


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def write_profile(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# --- the output ------------------------------------------------------------------------------------------------


def test_numbers_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([*NUMBERS, "--log-budget", "30GiB"], capsys)
    assert code == 0, err
    assert "swiftrun plan: 4 stages, checkpoint every 100 iterations" in out
    # 30 GiB allows one 256 MiB boundary (25 GiB per interval): the slow stage 0 gets its own group.
    assert "logging groups     [0] [1-3]" in out
    assert "logged boundaries  0|1  (1 of 3)" in out
    assert "peak log volume    25.0 GiB (26843545600 bytes)" in out
    assert "expected recovery  350 s of replay" in out  # 1/4 * 50 * 10 + 3/4 * 50 * 6
    assert "worst recovery     1000 s of replay" in out
    rows = [line for line in out.splitlines() if "GiB" in line and "│" in line]
    assert len(rows) == 4  # 12.5, 25, 37.5, 62.5 GiB; the 0 B row has no GiB
    chosen = [line for line in out.splitlines() if line.startswith("│ * │")]
    assert len(chosen) == 1 and "25.0 GiB" in chosen[0]


def test_same_plan_as_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    plan_input = PlanInput.from_lists([3.0, 1.0, 2.0, 2.0, 1.0], [5 * GiB, GiB, 2 * GiB, 3 * GiB], ckpt_every=2)
    expected = choose_plan(plan_input, 7 * GiB)
    flags = ["--stages", "3,1,2,2,1", "--boundary-bytes", "5GiB,1GiB,2GiB,3GiB", "--ckpt-every", "2"]
    code, out, _ = run([*flags, "--log-budget", "7GiB"], capsys)
    assert code == 0
    assert f"logged boundaries  {', '.join(f'{b}|{b + 1}' for b in expected.logged_boundaries)}" in out
    assert len([line for line in out.splitlines() if line.startswith("│")]) == len(tradeoff_curve(plan_input))


def test_without_a_budget_only_the_curve(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(NUMBERS, capsys)
    assert code == 0
    assert "Chosen plan" not in out
    assert "Trade-off curve" in out
    assert "│ * │" not in out


def test_a_budget_too_small_warns_that_nothing_is_logged(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*NUMBERS, "--log-budget", "1GiB"], capsys)
    assert code == 0
    assert "logged boundaries  none  (0 of 3)" in out
    assert "warning: the budget logs no boundary" in out
    assert "cheapest boundary needs 12.5 GiB" in out


def test_options_reach_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--stages", "2,6", "--boundary-bytes", "5", "--ckpt-every", "10", "--failure-weights", "3,1",
             "--replay-speedup", "2", "--micro-batches", "4", "--restart-seconds", "90",
             "--log-budget", "0"]  # fmt: skip
    code, out, _ = run(flags, capsys)
    assert code == 0
    assert "weighted failures" in out
    assert "a group replays 4 micro-batches pipelined, 2x faster in parallel" in out
    assert "expected recovery  16.2 s of replay" in out  # 5 iterations * (2 + 6 + 3 * 6) / 4 / 2 = 16.25
    assert "global restart     90 s (given, for comparison)" in out


def test_long_curves_are_thinned(capsys: pytest.CaptureFixture[str]) -> None:
    stages = ",".join(["1"] * 60)
    sizes = ",".join(["1MiB"] * 59)
    code, out, _ = run(["--stages", stages, "--boundary-bytes", sizes, "--ckpt-every", "1", "--log-budget", "7MiB",
                        "--max-rows", "10"], capsys)  # fmt: skip
    assert code == 0
    shown = [line for line in out.splitlines() if line.startswith("│")]
    assert 2 <= len(shown) <= 10
    assert f"{len(shown)} of 60 plans shown (--max-rows)" in out
    assert "0 B" in shown[0] and "59.0 MiB" in shown[-1]  # both ends
    assert any(line.startswith("│ * │") and "7.00 MiB" in line for line in out.splitlines())


def test_shown_rows() -> None:
    assert shown_rows(5, None, 40) == [0, 1, 2, 3, 4]
    rows = shown_rows(100, 37, 10)
    assert rows[0] == 0 and rows[-1] == 99 and 37 in rows and len(rows) <= 11
    assert rows == sorted(set(rows))


# --- the profile file -------------------------------------------------------------------------------------------


def test_the_readme_example_profile(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "pipeline_profile.json"
    plan = choose_plan(load_profile(path), 100 * GiB)
    assert plan.groups == ((0, 0), (1, 2), (3, 4), (5, 6), (7, 7))
    assert plan.peak_log_bytes == 100 * GiB
    code, out, _ = run(["--profile", str(path), "--log-budget", "100GiB"], capsys)
    assert code == 0
    assert "logging groups     [0] [1-2] [3-4] [5-6] [7]" in out


def test_profile_round_trip(tmp_path: Path) -> None:
    plan_input = PlanInput.from_lists([0.4, 0.5, 0.45], [2**28, 2**27], ckpt_every=50, failure_weights=(1.0, 2.0, 1.0),
                                      replay_speedup=3.0, micro_batches=8, restart_seconds=120.0)  # fmt: skip
    assert profile_from_dict(profile_to_dict(plan_input)) == plan_input
    path = write_profile(tmp_path / "profile.json", profile_to_dict(plan_input))
    assert load_profile(path) == plan_input


def test_profile_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_profile(tmp_path / "profile.json", {
        "version": 1,
        "ckpt_every": 100,
        "stages": [{"compute_seconds": 10, "boundary_bytes": "256MiB"},
                   {"compute_seconds": 1, "boundary_bytes": 268435456},
                   {"compute_seconds": 1, "boundary_bytes": "128MiB"},
                   {"compute_seconds": 4}],
        "meta": {"model": "toy", "measured": "by hand"},
    })  # fmt: skip
    from_file = run(["--profile", str(path), "--log-budget", "30GiB"], capsys)
    from_flags = run([*NUMBERS, "--log-budget", "30GiB"], capsys)
    assert from_file == from_flags


def test_flags_override_the_profile(tmp_path: Path) -> None:
    stages = [{"compute_seconds": 1, "boundary_bytes": 8}, {"compute_seconds": 1}]
    path = write_profile(tmp_path / "p.json", {"ckpt_every": 100, "stages": stages})
    plan_input = build_input(profile=path, stages=None, boundary_bytes=None, ckpt_every=7, failure_weights="1,3",
                             replay_speedup=2.0, micro_batches=None, restart_seconds=None)  # fmt: skip
    assert plan_input.ckpt_every == 7
    assert plan_input.failure_weights == (1.0, 3.0)
    assert plan_input.replay_speedup == 2.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no profile at"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"stages": [{"compute_seconds": 1}]}', "no 'ckpt_every'"),
        ('{"ckpt_every": 5}', "needs 'stages'"),
        ('{"ckpt_every": 5, "stages": []}', "needs 'stages'"),
        ('{"ckpt_every": 5, "ckpt_evry": 5, "stages": [{"compute_seconds": 1}]}', "unknown profile keys ['ckpt_evry']"),
        ('{"version": 2, "ckpt_every": 5, "stages": [{"compute_seconds": 1}]}', "version 2 is not supported"),
        ('{"ckpt_every": 5, "stages": [{"boundary_bytes": 3}, {"compute_seconds": 1}]}', "stage 0: compute_seconds"),
        ('{"ckpt_every": 5, "stages": [{"compute_seconds": 1, "bytes": 3}]}', "stage 0: unknown keys ['bytes']"),
        ('{"ckpt_every": 5, "stages": [{"compute_seconds": 1, "boundary_bytes": "3 apples"}, {"compute_seconds": 1}]}',
         "unknown unit"),
        ('{"ckpt_every": 5, "stages": [{"compute_seconds": -1}]}', "stage 0: compute_seconds must be"),
        ('{"ckpt_every": 5, "stages": [{"compute_seconds": 1, "boundary_bytes": 3}]}', "last stage"),
        ('{"ckpt_every": 5, "stages": [{"compute_seconds": 1}], "failure_weights": 3}', "list of numbers"),
        ('{"ckpt_every": "5", "stages": [{"compute_seconds": 1}]}', "checkpoint interval"),
        ('{"ckpt_every": 5, "stages": [7]}', "stage 0: expected an object"),
    ],
)
def test_bad_profiles_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    code, out, err = run(["--profile", str(path), "--log-budget", "1GiB"], capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("swiftrun plan: error: ")
    assert message in err


# --- errors on the command line --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give --profile FILE.json, or --stages"),
        (["--profile", "p.json", "--stages", "1,2"], "either --profile or --stages"),
        (["--stages", "1,2", "--ckpt-every", "3"], "--boundary-bytes needs their 1 sizes"),
        (["--stages", "1,2", "--boundary-bytes", "1MB,2MB", "--ckpt-every", "3"], "needs 1 sizes, not 2"),
        (["--stages", "1,2", "--boundary-bytes", "1MB"], "--ckpt-every K is needed"),
        (["--stages", "1,x", "--boundary-bytes", "1MB", "--ckpt-every", "3"], "--stages '1,x' is not a comma"),
        (["--stages", "1,nan", "--boundary-bytes", "1MB", "--ckpt-every", "3"], "finite"),
        (["--stages", "1,2", "--boundary-bytes", "1 parsec", "--ckpt-every", "3"], "--boundary-bytes: '1 parsec'"),
        (["--stages", "1,-2", "--boundary-bytes", "1MB", "--ckpt-every", "3"], "compute_seconds"),
        (["--stages", "1,2", "--boundary-bytes", "1MB", "--ckpt-every", "0"], "checkpoint interval"),
        ([*NUMBERS, "--log-budget", "-1GiB"], "must not be negative"),
        ([*NUMBERS, "--log-budget", "lots"], "'lots' is not a size"),
        ([*NUMBERS, "--failure-weights", "1,1"], "2 failure weights for 4 stages"),
        ([*NUMBERS, "--replay-speedup", "0.5"], "speed-up"),
        ([*NUMBERS, "--max-rows", "1"], "--max-rows 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("swiftrun plan: error: ") and err.count("\n") == 1
    assert message in err


def test_unknown_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*NUMBERS, "--budget", "1GiB"], capsys)
    assert code == 2
    assert "--budget" in err


# --- the plot ---------------------------------------------------------------------------------------------------


def test_plot_without_matplotlib_exits_1_with_the_install_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes ``import matplotlib`` raise ImportError, as if it were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out_png = tmp_path / "curve.png"
    code, out, err = run([*NUMBERS, "--log-budget", "30GiB", "--plot", str(out_png)], capsys)
    assert code == 1
    assert out == ""  # checked before printing anything
    assert PLOT_INSTALL_HINT in err
    assert not out_png.exists()


def test_plot_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "curve.png"
    code, out, _ = run([*NUMBERS, "--log-budget", "30GiB", "--restart-seconds", "600", "--plot", str(out_png)], capsys)
    assert code == 0
    assert f"plot: {out_png}" in out
    assert out_png.read_bytes().startswith(b"\x89PNG")


def test_plot_to_an_unwritable_place_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, _, err = run([*NUMBERS, "--plot", str(tmp_path / "missing-dir" / "curve.png")], capsys)
    assert code == 1
    assert "cannot write the plot" in err


# --- dispatch ---------------------------------------------------------------------------------------------------


def test_swiftrun_plan_is_dispatched(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *NUMBERS, "--log-budget", "30GiB"])
    assert exit_info.value.code == 0
    assert "logging groups     [0] [1-3]" in capsys.readouterr().out


def test_swiftrun_plan_errors_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *NUMBERS, "--log-budget", "-5"])
    assert exit_info.value.code == 2
    assert "must not be negative" in capsys.readouterr().err


def test_python_dash_m_swiftrun_plan() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "swiftrun", "plan", *NUMBERS, "--log-budget", "bogus"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == "swiftrun plan: error: 'bogus' is not a size; write a number with an optional unit, " \
                            "such as 2GiB, 500MB or 1.5G\n"


def test_plan_error_from_the_api_is_raised_not_printed() -> None:
    with pytest.raises(PlanError):
        build_input(profile=None, stages="1", boundary_bytes=None, ckpt_every=None)


# --- interleaved schedules: the ranks form a ring ----------------------------------------------------------------

RING = ["--stages", "1,1,1,1", "--boundary-bytes", "1KiB,10KiB,1KiB", "--wrap-bytes", "10KiB", "--ckpt-every", "1"]


def test_an_interleaved_pipeline_is_planned_as_a_ring(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([*RING, "--log-budget", "2KiB"], capsys)
    assert code == 0, err
    assert "4 ranks of an interleaved schedule (a ring: the wrap 3|0 carries 10.0 KiB per iteration)" in out
    assert "logging groups     [1-2] [3-0]" in out  # the cheap split wraps around
    assert "logged boundaries  0|1, 2|3  (2 of 4)" in out
    code, out, _ = run([*RING, "--log-budget", "1KiB"], capsys)
    assert code == 0 and "the cheapest split needs 2.00 KiB" in out  # one cut alone splits nothing


def test_a_ring_profile_round_trips(tmp_path: Path) -> None:
    plan_input = build_input(profile=None, stages="1,2,3", boundary_bytes="5,6", ckpt_every=4, wrap_bytes="1KiB")
    assert plan_input.wrap_bytes == 1024
    data = profile_to_dict(plan_input)
    assert data["wrap_bytes"] == 1024
    assert profile_from_dict(data) == plan_input
    assert profile_from_dict({**data, "wrap_bytes": "1KiB"}) == plan_input
    path = write_profile(tmp_path / "ring.json", data)
    assert load_profile(path).ring
    assert not profile_from_dict({k: v for k, v in data.items() if k != "wrap_bytes"}).ring


@pytest.mark.parametrize(("argv", "message"), [
    ([*RING[:4], "--wrap-bytes", "lots", "--ckpt-every", "1"], "--wrap-bytes: 'lots' is not a size"),
    (["--stages", "1", "--wrap-bytes", "5", "--ckpt-every", "1"], "needs at least 2 stages"),
])
def test_bad_ring_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err, err
