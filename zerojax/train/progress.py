"""Terminal output with rich: a progress bar during training and a summary table after it."""

from __future__ import annotations

import contextlib
import threading
import time

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(stderr=True)


@contextlib.contextmanager
def training_progress(total_steps: int):
    """Yields `on_step(record)`; shows nothing on processes other than 0."""
    if jax.process_index() != 0:
        yield lambda record: None
        return
    columns = (
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=total_steps, loss="-", tps="-")

        def on_step(record: dict) -> None:
            progress.update(
                task,
                completed=record["step"],
                loss=_loss(record["loss"], record.get("bad_step")),
                tps=f"{record['tokens_per_s']:,.0f}",
            )

        yield on_step


@contextlib.contextmanager
def compiling(what: str):
    """On a terminal, a status line while `what` compiles ("compiling the step ... 41 s"), gone when
    it is done; elsewhere (a log, a pipe) nothing: the run's summary reports the compile time."""
    if jax.process_index() != 0 or not console.is_terminal:
        yield
        return
    start, done = time.perf_counter(), threading.Event()
    with console.status(f"compiling {what} ...") as status:

        def tick() -> None:
            while not done.wait(1.0):
                status.update(f"compiling {what} ... {time.perf_counter() - start:.0f} s")

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


def _loss(value: float | None, bad: int | None = 0) -> str:
    """A loss for people: non-finite ones are stored as None (JSON has no NaN) and marked."""
    text = "non-finite" if value is None else f"{value:.4f}"
    return f"{text} (bad step, skipped)" if bad else text


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: the last unit always returns")


def _params(summary: dict) -> str:
    total, trained = summary["params"], summary.get("trainable_params", summary["params"])
    if trained == total:
        return f"{total:,}"
    return f"{total:,} ({trained:,} trainable, {trained / total:.1%})"


def summary_table(summary: dict, out_dir: str) -> None:
    if jax.process_index() != 0:
        return
    table = Table(title="zerojax run", show_header=False)
    rows = [
        ("stage / engine / precision", f"{summary['stage']} / {summary['engine']} / {summary['precision']}"),
        ("devices (mesh)", f"{summary['devices']} {summary['mesh']}"),
        ("parameters", _params(summary)),
        ("loss first -> final", f"{_loss(summary['first_loss'])} -> {_loss(summary['final_loss'])}"),
        ("eval loss", "-" if summary["eval_loss"] is None else _loss(summary["eval_loss"])),
        ("bad steps (skipped)", f"{summary.get('bad_steps', 0)}"),
        (
            "state per device",
            _bytes(summary["persistent_bytes_per_device"])
            + (
                f" (+ {_bytes(summary['host_persistent_bytes_per_device'])} in host memory)"
                if summary.get("host_persistent_bytes_per_device")
                else ""
            ),
        ),
        ("compile", f"{summary['compile_s']:.1f} s"),
        ("median step", f"{summary['median_step_time_s'] * 1e3:.1f} ms ({summary['tokens_per_s']:,.0f} tok/s)"),
        ("output", out_dir),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
