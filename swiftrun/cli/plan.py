"""``swiftrun plan``: which pipeline boundaries to log under a storage budget, and the whole trade-off.

Input is either a profile file (``--profile FILE.json``, the schema below) or the numbers on the command line
(``--stages``, ``--boundary-bytes``, ``--ckpt-every``). Flags given with a profile override its values.

An interleaved (looped) schedule, rank r of P running virtual stages r, r+P, ..., is planned over its P ranks
(pipeline positions: a rank's virtual stages fail together), which form a ring: give one "stage" per rank (its
compute: the sum of its virtual stages'), as ``boundary_bytes`` of rank p the bytes of every virtual boundary
between rank p and rank p+1 (one per round), and the wrap, the boundaries from rank P-1's stage of one round to
rank 0's of the next, as ``wrap_bytes`` (``--wrap-bytes``). A group may then wrap around (``[3-0]``: ranks 3 and 0;
boundary ``3|0`` is the wrap). swiftrun/logplan/looped.py derives these from per-virtual-boundary numbers. Output:
the plan chosen for ``--log-budget`` and the trade-off curve (every budget's best plan) as rich tables;
``--plot FILE.png`` draws the curve, which needs matplotlib (``pip install 'swiftrun[plot]'``).

Exit status: 0; 2 for bad input (a malformed profile, list or size; a negative budget); 1 when the plot cannot be
drawn (matplotlib missing, checked before any output, as ``swiftrun report`` does; or the file not writable).

Profile schema (version 1), a JSON object::

    {
      "version": 1,                      # optional; only 1 exists
      "ckpt_every": 100,                 # checkpoint interval K, iterations (required unless --ckpt-every)
      "stages": [                        # one object per stage, in pipeline order (required)
        {"compute_seconds": 0.42,        #   forward+backward seconds per iteration (all micro-batches)
         "boundary_bytes": 268435456},   #   bytes per iteration crossing to the next stage, both directions:
        ...                              #   an integer, or a size such as "256MiB"; absent or 0 on the last
        {"compute_seconds": 0.40}
      ],
      "failure_weights": [1, 1, 2, 1],   # optional: relative failure likelihood per stage (default uniform)
      "replay_speedup": 1.0,             # optional: parallel recovery's replay speed-up (>= 1, default 1)
      "micro_batches": 1,                # optional: 1 models a group's replay as the sum of its stages' times
      "restart_seconds": 90.0,           # optional: a global restart's expected recovery, shown for comparison
      "wrap_bytes": 134217728,           # optional: an interleaved schedule's ranks (a ring, see above): bytes
                                         #   per iteration over the wrap boundary; an integer or a size
      "meta": {}                         # optional, free-form (model name, when measured): ignored
    }

Any other key is an error (a typo must not silently fall back to a default). :func:`profile_to_dict` writes this
schema, for the runtime that will measure it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from swiftrun.logplan.planner import (
    LoggingPlan,
    PlanError,
    PlanInput,
    StageProfile,
    choose_plan,
    format_size,
    parse_size,
    tradeoff_curve,
)

# the optional matplotlib import is report.py's, shared: one install hint, one headless backend
from swiftrun.report import PLOT_INSTALL_HINT, PlotUnavailable, _pyplot  # noqa: E402,F401

PROFILE_VERSION = 1
_PROFILE_KEYS = {
    "version", "ckpt_every", "stages", "failure_weights", "replay_speedup", "micro_batches", "restart_seconds",
    "wrap_bytes", "meta",
}  # fmt: skip
_STAGE_KEYS = {"compute_seconds", "boundary_bytes"}

app = typer.Typer(
    add_completion=False,
    help="Choose which pipeline boundaries to log under a storage budget.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


# --- input ------------------------------------------------------------------------------------------------------


def profile_to_dict(plan_input: PlanInput) -> dict[str, Any]:
    """The profile file's content for ``plan_input`` (what the runtime writes after measuring)."""
    data: dict[str, Any] = {
        "version": PROFILE_VERSION,
        "ckpt_every": plan_input.ckpt_every,
        "stages": [
            {"compute_seconds": stage.compute_seconds, "boundary_bytes": stage.boundary_bytes}
            for stage in plan_input.stages
        ],
        "replay_speedup": plan_input.replay_speedup,
        "micro_batches": plan_input.micro_batches,
    }
    if plan_input.failure_weights is not None:
        data["failure_weights"] = list(plan_input.failure_weights)
    if plan_input.restart_seconds is not None:
        data["restart_seconds"] = plan_input.restart_seconds
    if plan_input.wrap_bytes is not None:
        data["wrap_bytes"] = plan_input.wrap_bytes
    return data


def profile_from_dict(data: Any, overrides: dict[str, Any] | None = None) -> PlanInput:
    """A :class:`PlanInput` from a profile's parsed JSON; ``overrides`` (non-None values) win over the file's."""
    if not isinstance(data, dict):
        raise PlanError("the profile must be a JSON object with 'stages' and 'ckpt_every'")
    unknown = sorted(set(data) - _PROFILE_KEYS)
    if unknown:
        raise PlanError(f"unknown profile keys {unknown}; known: {sorted(_PROFILE_KEYS)}")
    if data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        raise PlanError(f"profile version {data['version']!r} is not supported (only {PROFILE_VERSION})")
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise PlanError("the profile needs 'stages': a non-empty list of {compute_seconds, boundary_bytes}")
    stages = tuple(_stage(index, raw) for index, raw in enumerate(raw_stages))
    values = {key: data.get(key) for key in ("ckpt_every", "failure_weights", "replay_speedup", "micro_batches",
                                             "restart_seconds", "wrap_bytes")}  # fmt: skip
    if isinstance(values["wrap_bytes"], str):
        values["wrap_bytes"] = parse_size(values["wrap_bytes"])
    values.update({key: value for key, value in (overrides or {}).items() if value is not None})
    if values["ckpt_every"] is None:
        raise PlanError("the profile has no 'ckpt_every' and --ckpt-every was not given")
    if values["failure_weights"] is not None:
        if not isinstance(values["failure_weights"], (list, tuple)):
            raise PlanError("'failure_weights' must be a list of numbers, one per stage")
        values["failure_weights"] = tuple(values["failure_weights"])
    options = {key: value for key, value in values.items() if value is not None and key != "ckpt_every"}
    return PlanInput(stages=stages, ckpt_every=values["ckpt_every"], **options)


def _stage(index: int, raw: Any) -> StageProfile:
    if not isinstance(raw, dict):
        raise PlanError(f"stage {index}: expected an object with compute_seconds and boundary_bytes, got {raw!r}")
    unknown = sorted(set(raw) - _STAGE_KEYS)
    if unknown:
        raise PlanError(f"stage {index}: unknown keys {unknown}; known: {sorted(_STAGE_KEYS)}")
    if "compute_seconds" not in raw:
        raise PlanError(f"stage {index}: compute_seconds is missing")
    size = raw.get("boundary_bytes", 0)
    if isinstance(size, str):
        size = parse_size(size)
    try:
        return StageProfile(raw["compute_seconds"], size)
    except PlanError as error:
        raise PlanError(f"stage {index}: {error}") from None


def load_profile(path: Path, overrides: dict[str, Any] | None = None) -> PlanInput:
    """Read and check a profile file (module docstring); :class:`PlanError` says what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError(f"no profile at {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"cannot read the profile {path}: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(f"{path} is not valid JSON: {error}") from None
    try:
        return profile_from_dict(data, overrides)
    except PlanError as error:
        raise PlanError(f"{path}: {error}") from None


def parse_floats(text: str, flag: str) -> list[float]:
    """``"0.5,1,2.25"`` -> ``[0.5, 1.0, 2.25]``."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise PlanError(f"{flag} {text!r} is not a comma-separated list of numbers") from None
    if not all(math.isfinite(value) for value in values):
        raise PlanError(f"{flag} {text!r}: every value must be a finite number")
    return values


def parse_sizes(text: str, flag: str) -> list[int]:
    """``"256MiB,1GB,1024"`` -> bytes."""
    if not text.strip():
        return []
    try:
        return [parse_size(item) for item in text.split(",")]
    except PlanError as error:
        raise PlanError(f"{flag}: {error}") from None


def build_input(
    *,
    profile: Path | None,
    stages: str | None,
    boundary_bytes: str | None,
    ckpt_every: int | None,
    failure_weights: str | None = None,
    replay_speedup: float | None = None,
    micro_batches: int | None = None,
    restart_seconds: float | None = None,
    wrap_bytes: str | None = None,
) -> PlanInput:
    """The command line's :class:`PlanInput`: a profile file, or ``--stages``/``--boundary-bytes``/``--ckpt-every``."""
    overrides: dict[str, Any] = {
        "ckpt_every": ckpt_every,
        "failure_weights": None if failure_weights is None else parse_floats(failure_weights, "--failure-weights"),
        "replay_speedup": replay_speedup,
        "micro_batches": micro_batches,
        "restart_seconds": restart_seconds,
        "wrap_bytes": None if wrap_bytes is None else _wrap_size(wrap_bytes),
    }
    if profile is not None:
        if stages is not None or boundary_bytes is not None:
            raise PlanError("give either --profile or --stages/--boundary-bytes, not both")
        return load_profile(profile, overrides)
    if stages is None:
        raise PlanError("give --profile FILE.json, or --stages T0,T1,... with --boundary-bytes and --ckpt-every")
    times = parse_floats(stages, "--stages")
    if boundary_bytes is None and len(times) > 1:
        raise PlanError(f"--stages gives {len(times)} stages: --boundary-bytes needs their {len(times) - 1} sizes")
    sizes = parse_sizes(boundary_bytes or "", "--boundary-bytes")
    if len(sizes) != len(times) - 1:
        raise PlanError(
            f"--stages gives {len(times)} stages, so --boundary-bytes needs {len(times) - 1} sizes, not {len(sizes)}"
        )
    if ckpt_every is None:
        raise PlanError("--ckpt-every K is needed with --stages (the checkpoint interval in iterations)")
    options = {key: value for key, value in overrides.items() if value is not None and key != "ckpt_every"}
    if "failure_weights" in options:
        options["failure_weights"] = tuple(options["failure_weights"])
    return PlanInput.from_lists(times, sizes, ckpt_every, **options)


def _wrap_size(text: str) -> int:
    try:
        return parse_size(text)
    except PlanError as error:
        raise PlanError(f"--wrap-bytes: {error}") from None


# --- text -------------------------------------------------------------------------------------------------------


def groups_label(plan: LoggingPlan) -> str:
    """``[0] [1-2] [3]``; on a ring a group may wrap around: ``[1-2] [3-0]``."""
    return " ".join(f"[{a}]" if a == b else f"[{a}-{b}]" for a, b in plan.groups)


def boundaries_label(plan: LoggingPlan) -> str:
    """``0|1, 2|3``, or ``none``; the wrap of a ring of 4 is ``3|0``."""
    return ", ".join(f"{b}|{(b + 1) % plan.num_stages}" for b in plan.logged_boundaries) or "none"


def seconds_label(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 100:
        return f"{seconds:.0f} s"
    return f"{seconds:.3g} s"


def describe_input(plan_input: PlanInput) -> list[str]:
    """Two short lines: the pipeline, then the replay model."""
    pipeline = [f"{plan_input.num_stages} stages" if not plan_input.ring else
                f"{plan_input.num_stages} ranks of an interleaved schedule (a ring: the wrap {plan_input.num_stages - 1}|0 "
                f"carries {format_size(plan_input.wrap_bytes or 0)} per iteration)",
                f"checkpoint every {plan_input.ckpt_every} iterations"]
    if plan_input.failure_weights is not None:
        pipeline.append("weighted failures")
    model = [
        "a group replays the sum of its stages' times" if plan_input.micro_batches == 1
        else f"a group replays {plan_input.micro_batches} micro-batches pipelined"
    ]  # fmt: skip
    if plan_input.replay_speedup != 1:
        model.append(f"{plan_input.replay_speedup:g}x faster in parallel")
    return [", ".join(pipeline), ", ".join(model)]


def plan_table(plan_input: PlanInput, plan: LoggingPlan, budget: int) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    num_boundaries = len(plan_input.edge_bytes)
    table.add_row("log budget", f"{format_size(budget)} ({budget} bytes)")
    table.add_row("logging groups", groups_label(plan))
    table.add_row("logged boundaries", f"{boundaries_label(plan)}  ({len(plan.logged_boundaries)} of {num_boundaries})")
    table.add_row("peak log volume", f"{format_size(plan.peak_log_bytes)} ({plan.peak_log_bytes} bytes)")
    table.add_row("expected recovery", f"{seconds_label(plan.expected_recovery_seconds)} of replay")
    table.add_row("worst recovery", f"{seconds_label(plan.worst_recovery_seconds)} of replay")
    if plan_input.restart_seconds is not None:
        table.add_row("global restart", f"{seconds_label(plan_input.restart_seconds)} (given, for comparison)")
    return table


def shown_rows(count: int, chosen: int | None, max_rows: int) -> list[int]:
    """Which curve points to print: all of them, or ``max_rows`` spread evenly, always the ends and the chosen."""
    if count <= max_rows:
        return list(range(count))
    picked = {0, count - 1, *([] if chosen is None else [chosen])}
    slots = max(max_rows - len(picked), 0)
    picked |= {round(i * (count - 1) / (slots + 1)) for i in range(1, slots + 1)}
    return sorted(picked)


# What a curve row takes besides the groups: five columns of at most 10 characters, borders and padding.
_CURVE_FIXED_WIDTH = 58


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def curve_table(curve: list[LoggingPlan], chosen: LoggingPlan | None, max_rows: int, width: int = 100) -> Table:
    """The curve's rows (thinned to ``max_rows``); groups are clipped so a row fits ``width`` columns."""
    chosen_index = next((i for i, point in enumerate(curve) if point == chosen), None)
    rows = shown_rows(len(curve), chosen_index, max_rows)
    caption = None if len(rows) == len(curve) else f"{len(rows)} of {len(curve)} plans shown (--max-rows)"
    table = Table(title="Trade-off curve: the best plan for every budget", caption=caption, title_justify="left")
    table.add_column("", width=1, no_wrap=True)
    for name in ("log volume", "expected", "worst", "logged"):
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    table.add_column("groups", no_wrap=True)  # clipped; the chosen plan above shows all of its own
    groups_width = max(width - _CURVE_FIXED_WIDTH, 12)
    for index in rows:
        point = curve[index]
        table.add_row(
            "*" if index == chosen_index else "",
            format_size(point.peak_log_bytes),
            seconds_label(point.expected_recovery_seconds),
            seconds_label(point.worst_recovery_seconds),
            str(len(point.logged_boundaries)),
            _clip(groups_label(point), groups_width),
            style="bold" if index == chosen_index else None,
        )
    return table


# --- plot -------------------------------------------------------------------------------------------------------


def draw_curve(
    curve: list[LoggingPlan], chosen: LoggingPlan | None, budget: int | None, plan_input: PlanInput, out: Path,
    plt: Any,
) -> None:  # fmt: skip
    """Expected (and worst) recovery time against log volume; a budget gets its best plan: a step function."""
    top = max(point.peak_log_bytes for point in curve)
    scale, unit = next(((2**p, u) for p, u in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")) if top >= 2**p),
                       (1, "B"))  # fmt: skip
    xs = [point.peak_log_bytes / scale for point in curve]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    axes.step(xs, [p.expected_recovery_seconds for p in curve], where="post", color="tab:blue", marker="o",
              markersize=3, label="expected recovery")  # fmt: skip
    axes.step(xs, [p.worst_recovery_seconds for p in curve], where="post", color="tab:blue", alpha=0.4,
              linestyle=":", label="worst recovery")  # fmt: skip
    if budget is not None:
        axes.axvline(min(budget, top) / scale, color="tab:gray", linestyle="--", linewidth=1,
                     label=f"budget {format_size(budget)}")  # fmt: skip
    if chosen is not None:
        axes.plot([chosen.peak_log_bytes / scale], [chosen.expected_recovery_seconds], marker="*", markersize=14,
                  color="tab:red", linestyle="none", label="chosen plan")  # fmt: skip
    if plan_input.restart_seconds is not None:
        axes.axhline(plan_input.restart_seconds, color="tab:purple", linestyle="-.", linewidth=1,
                     label="global restart")  # fmt: skip
    axes.set(
        title=f"Selective logging: {plan_input.num_stages} {'ranks (interleaved)' if plan_input.ring else 'stages'}, "
              f"checkpoint every {plan_input.ckpt_every} iterations",
        xlabel=f"peak log volume ({unit})",
        ylabel="recovery time (s of replay)",
    )
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


# --- command ----------------------------------------------------------------------------------------------------


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"swiftrun plan: error: {message}", err=True)
    return typer.Exit(code=code)


@app.command()
def plan(
    profile: Annotated[
        Optional[Path],
        typer.Option("--profile", metavar="FILE.json", help="Measured profile (schema: cli/plan.py)."),
    ] = None,
    stages: Annotated[
        Optional[str],
        typer.Option("--stages", metavar="T0,T1,...",
                     help="Compute seconds per iteration per stage (interleaved: per rank, all its virtual stages)."),
    ] = None,  # fmt: skip
    boundary_bytes: Annotated[
        Optional[str],
        typer.Option("--boundary-bytes", metavar="B0,B1,...",
                     help="Bytes per iteration crossing each boundary, both directions (sizes: 256MiB); interleaved: "
                          "between rank p and p+1, all rounds."),
    ] = None,  # fmt: skip
    wrap_bytes: Annotated[
        Optional[str],
        typer.Option("--wrap-bytes", metavar="SIZE",
                     help="Interleaved (looped) schedule: bytes per iteration from the last rank back to the first "
                          "(virtual stage kP-1 -> kP); the ranks then form a ring and a group may wrap around."),
    ] = None,  # fmt: skip
    ckpt_every: Annotated[
        Optional[int], typer.Option("--ckpt-every", metavar="K", help="Checkpoint interval in iterations.")
    ] = None,
    log_budget: Annotated[
        Optional[str],
        typer.Option("--log-budget", metavar="SIZE",
                     help="Most log volume held at once (2GiB, 500MB): chooses the plan. Without it: the curve only."),
    ] = None,  # fmt: skip
    failure_weights: Annotated[
        Optional[str],
        typer.Option("--failure-weights", metavar="W0,W1,...", help="Relative failure likelihood per stage."),
    ] = None,
    replay_speedup: Annotated[
        Optional[float],
        typer.Option("--replay-speedup", metavar="F", help="Parallel recovery's replay speed-up (default 1)."),
    ] = None,
    micro_batches: Annotated[
        Optional[int],
        typer.Option("--micro-batches", metavar="M",
                     help="Model a group's replay as pipelined over M micro-batches (default 1: sum of stage times)."),
    ] = None,  # fmt: skip
    restart_seconds: Annotated[
        Optional[float],
        typer.Option("--restart-seconds", metavar="S", help="A global restart's expected recovery, for comparison."),
    ] = None,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", metavar="FILE.png", help="Also draw the trade-off curve to this PNG.")
    ] = None,
    max_rows: Annotated[int, typer.Option("--max-rows", metavar="N", help="Most curve rows printed.")] = 40,
) -> None:
    """Choose which pipeline boundaries swiftrun logs under a storage budget, and show the whole trade-off."""
    plt = None
    if plot is not None:  # fail before any output, as swiftrun report does
        try:
            plt = _pyplot()
        except PlotUnavailable:
            raise _fail(f"--plot needs matplotlib, which is not installed; run: {PLOT_INSTALL_HINT}", 1) from None
    try:
        plan_input = build_input(
            profile=profile,
            stages=stages,
            boundary_bytes=boundary_bytes,
            ckpt_every=ckpt_every,
            failure_weights=failure_weights,
            replay_speedup=replay_speedup,
            micro_batches=micro_batches,
            restart_seconds=restart_seconds,
            wrap_bytes=wrap_bytes,
        )
        budget = None if log_budget is None else parse_size(log_budget)
        if max_rows < 2:
            raise PlanError(f"--max-rows {max_rows}: show at least 2 rows")
        chosen = None if budget is None else choose_plan(plan_input, budget)
        curve = tradeoff_curve(plan_input)
    except PlanError as error:
        raise _fail(str(error), error.exit_code) from None

    console = Console(highlight=False, soft_wrap=False)
    pipeline, model = describe_input(plan_input)
    console.print(f"swiftrun plan: {pipeline}")
    console.print(f"replay model: {model}")
    if chosen is not None and budget is not None:
        console.print()
        console.print("[bold]Chosen plan[/bold]")
        console.print(plan_table(plan_input, chosen, budget))
        if chosen.logs_nothing and plan_input.num_stages > 1:
            # on a ring a split needs two boundaries: one cut leaves it in one piece
            cheapest = sum(sorted(plan_input.edge_bytes)[: 2 if plan_input.ring else 1]) * plan_input.ckpt_every
            console.print(
                "[yellow]warning:[/yellow] the budget logs no boundary: any failure replays every stage from its "
                f"checkpoint, like a global restart (the cheapest "
                f"{'split' if plan_input.ring else 'boundary'} needs {format_size(cheapest)})"
            )
    console.print()
    console.print(curve_table(curve, chosen, max_rows, console.width))
    console.print("times: the failed group's replay, K/2 iterations on average, K at worst")
    if plt is not None and plot is not None:
        try:
            draw_curve(curve, chosen, budget, plan_input, plot, plt)
        except (OSError, ValueError) as error:
            raise _fail(f"cannot write the plot to {plot}: {error}", 1) from None
        console.print(f"plot: {plot}")


def main(argv: list[str] | None = None) -> int:
    """Run ``swiftrun plan`` with ``argv`` (the arguments after ``plan``); returns the exit code."""
    try:
        app(args=sys.argv[1:] if argv is None else argv, prog_name="swiftrun plan")
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
