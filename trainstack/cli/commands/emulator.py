"""`trainstack emulator start|status|stop|env`: the local AWS emulator (moto server) in the background.

`make demo` leaves one running so the docs' next commands (`status`, `logs`, `launch --local`) work
after it. The server's own PID, endpoint and log are recorded in .emulator/endpoint.json under the
working directory; `--local`, `env` and `stop` find it there or in any directory below it, and `stop`
signals exactly that process.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

emulator_app = typer.Typer(
    name="emulator",
    no_args_is_help=True,
    help="Run the local AWS emulator (moto server) in the background: start, status, stop, env.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(emulator_app)


def _ago(started: float | None) -> str:
    if not started:
        return ""
    minutes = max(0.0, time.time() - started) / 60
    return f", up {minutes:.0f} min" if minutes < 120 else f", up {minutes / 60:.1f} h"


def _describe(state: dict) -> str:
    log = f", log {state['log']}" if state.get("log") else ""
    tracker = f"; MLflow on {state['mlflow']} (pid {state.get('mlflow_pid')})" if state.get("mlflow") else ""
    return f"{state['endpoint']} (pid {state.get('pid')}{_ago(state.get('started'))}{log}){tracker}"


@emulator_app.command("start")
def start(
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (default: a free one).")] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1.0, help="Seconds to wait for the server to answer.")
    ] = 120.0,
) -> None:
    """Start the emulator in the background (or say where the running one is) and record it.

    Beside moto it starts MLflow's own tracking server (SQLite and artifacts under .emulator/mlflow/,
    when the dev extra's mlflow is installed), where `--local` runs are tracked; its URL is recorded too.

    Prints the `export` line for other shells; `eval "$(trainstack emulator env)"` sets it in this one.
    The emulator keeps its state in memory: a new one starts empty (it says so, and names the one before
    it when that one died).
    Exit status 0 (also when one is already running), 2 when it cannot start.

    Example: trainstack emulator start && eval "$(trainstack emulator env)"
    """
    from trainstack.emulator import endpoint as emu

    state = emu.running()
    if state is not None:
        typer.echo(f"the local AWS emulator is already running on {_describe(state)}")
    else:
        from trainstack.emulator import mlflow_server

        before = emu.read_state(emu.STATE_FILE)  # a stale record: an emulator here that died
        emu.stop_recorded()  # a stale record (its server died): remove it
        emu.LOG_FILE.parent.mkdir(parents=True, exist_ok=True)
        tracker = mlflow_server.launch_beside()  # starts while moto does; None without the mlflow package
        server = emu.Emulator(port=port or emu.free_port(), log_path=emu.LOG_FILE)
        try:
            # Not waited for: it answers some seconds after moto (clients of it wait, or retry, themselves).
            server.start(timeout_s=timeout, detach=True)
        except BaseException:
            if tracker is not None:
                tracker.stop()
            raise
        emu.write_state(server.endpoint, server.pid or 0, log=emu.LOG_FILE, mlflow=tracker)
        state = emu.read_state(emu.STATE_FILE) or {"endpoint": server.endpoint, "pid": server.pid}
        typer.echo(f"started the local AWS emulator on {_describe(state)}")
        typer.echo(_memory_line(before))
    typer.echo("stop it with `trainstack emulator stop`; for AWS tools in another shell:")
    typer.echo(emu.export_line(emu.env_for(state["endpoint"])))


def _memory_line(before: dict | None) -> str:
    """moto keeps every bucket, stack, run registry and job in its process's memory: a new server starts
    empty, which a user who deployed into the last one must hear, once, when it starts."""
    gone = (
        f"the emulator that ran here before ({before['endpoint']}, pid {before.get('pid')}) is gone, and "
        "its state with it: "
        if before
        else ""
    )
    return (
        f"note: {gone}the emulator keeps its state in memory only: buckets, deployed stacks, runs and jobs "
        "last until it stops (redeploy after a restart: `npx cdk deploy --all -c recipe=...`)"
    )


@emulator_app.command("status")
def status() -> None:
    """Say whether the recorded emulator is running: endpoint, server PID, uptime, log.

    Exit status 0 when it runs, 1 when none is running here.
    """
    from trainstack.emulator import endpoint as emu

    state = emu.running()
    if state is None:
        recorded = emu.read_state(emu.state_file())
        stale = (
            f" (the record in {emu.state_file()} is stale: {recorded['endpoint']} does not answer)"
            if recorded
            else ""
        )
        typer.echo("no local AWS emulator is running here" + stale)
        typer.echo("start one with `trainstack emulator start`")
        raise typer.Exit(1)
    typer.echo(f"running on {_describe(state)}")


@emulator_app.command("stop")
def stop() -> None:
    """Stop the recorded emulator (its server process) and remove the record. Exit status 0.

    Its state (buckets, stacks, runs, jobs) is in the server's memory and goes with it."""
    from trainstack.emulator import endpoint as emu

    stopped = emu.stop_recorded()
    if stopped is None:
        typer.echo("no local AWS emulator was running here")
    else:
        typer.echo(
            f"stopped the local AWS emulator on {stopped['endpoint']} (pid {stopped.get('pid')}); its state "
            "(buckets, stacks, runs, jobs) was in its memory and is gone"
        )


@emulator_app.command("env")
def env() -> None:
    """Print the `export AWS_...` line for the running emulator, for `eval "$(trainstack emulator env)"`.

    The emulator recorded in this directory or the nearest one above it that has .emulator/. Exit status
    0, or 2 when none is running there (the line says where this user's running emulators were started).
    """
    from trainstack.emulator import endpoint as emu

    typer.echo(emu.export_line(emu.local_env()))
