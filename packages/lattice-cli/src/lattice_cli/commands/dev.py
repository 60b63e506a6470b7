"""``lattice dev``: a local cluster for newcomers and tests (the embedded default).

The cluster itself is :class:`lattice_cli.devcluster.LocalCluster` (also used by the test
harness and the benchmarks); this module is only its command line.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import typer

dev_app = typer.Typer(
    help="Run a whole Lattice cluster on this machine, as real processes on loopback.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(dev_app, name="dev", help="Run a local Lattice cluster for development.")


def _cli_config_path() -> Path:
    env = os.environ.get("LATTICE_CONFIG")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "lattice" / "config.yaml"


@dev_app.command("up")
def up(
    agents: int = typer.Option(
        2, "--agents", "-n", min=0, max=64, help="Number of node agents to start."
    ),
    quorum: int = typer.Option(1, "--quorum", help="Quorum members: 1 or 3."),
    data_dir: Path = typer.Option(
        Path(".lattice-dev"), "--data-dir", help="Where the cluster keeps its state and logs."
    ),
    fresh: bool = typer.Option(
        False, "--fresh", help="Delete the data dir first (all previous state is lost)."
    ),
    cycle_interval: float = typer.Option(
        5.0, "--cycle-interval", help="Scheduling cycle interval in seconds."
    ),
    write_config: bool = typer.Option(
        True, "--write-config/--no-write-config", help="Point the CLI config at this cluster."
    ),
    secure: bool = typer.Option(
        False,
        "--secure",
        help="Run it as production does: TLS, mTLS between components (a site CA, the "
        "internal CA, bootstrap certificates), OIDC against a local identity provider, "
        "encrypted Raft. Log in with `lattice login --device`.",
    ),
    accounting: bool = typer.Option(
        False,
        "--accounting",
        help="Turn accounting on (also LATTICE_ACCOUNTING__ENABLED=true): start "
        "lattice-accounting with a SQLite ledger under the data dir, and gate "
        "submissions by the funds of their project.",
    ),
) -> None:
    """Start quorum member(s), a scheduler for the default vCluster and N agents; Ctrl-C stops them."""
    from lattice_cli.devcluster import ClusterError, LocalCluster

    if quorum not in (1, 3):
        raise typer.BadParameter("--quorum must be 1 or 3")
    if cycle_interval <= 0:
        raise typer.BadParameter("--cycle-interval must be greater than zero")
    if fresh and data_dir.exists():
        shutil.rmtree(data_dir)
    cluster = LocalCluster(
        data_dir,
        members=quorum,
        agents=agents,
        cycle_interval=cycle_interval,
        preferred_ports=True,
        secure=secure,
        accounting=accounting
        or os.environ.get("LATTICE_ACCOUNTING__ENABLED", "").lower() in ("1", "true", "yes"),
    )
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    typer.echo(
        f"Starting Lattice dev cluster in {cluster.base} ({quorum} quorum member(s), {agents} agent(s))..."
    )
    try:
        cluster.start()
    except ClusterError as e:
        cluster.stop()
        typer.echo(
            f"Error: {e}\nHint: look at the process logs in {cluster.base / 'logs'}", err=True
        )
        raise typer.Exit(1) from None
    typer.echo(f"Cluster up in {time.monotonic() - t0:.1f}s")
    for m in cluster.members:
        typer.echo(f"  member {m.id}: REST {m.rest_url}  gRPC {m.grpc_address}")
    typer.echo(f"  tenant: {cluster.tenant}   vCluster(s): {', '.join(cluster.vclusters)}")
    typer.echo(f"  logs: {cluster.base / 'logs'}")
    if cluster.checkpoint_broker:
        typer.echo(
            f"  checkpoint broker: lattice-checkpoint, metrics on "
            f"http://127.0.0.1:{cluster.broker_metrics_port}/metrics"
        )
    if cluster.accounting:
        typer.echo(
            f"  accounting: lattice-accounting on {cluster.accounting_url} (ledger under "
            f"{cluster.base / 'accounting'}); `lattice account topup --tenant "
            f"{cluster.tenant} 100` to fund work"
        )
    if cluster.secure is not None:
        typer.echo(f"  identity provider: {cluster.secure.issuer} (logins as alice)")
        typer.echo(f"  site CA: {cluster.secure.ca_cert}")
    if write_config:
        path = cluster.write_cli_config(_cli_config_path())
        typer.echo(f"  CLI config written to {path}")
    else:
        ca = f" LATTICE_CA_CERT={cluster.secure.ca_cert}" if cluster.secure is not None else ""
        typer.echo(
            f"  export LATTICE_ENDPOINT={cluster.rest_url} LATTICE_TENANT={cluster.tenant}{ca}"
        )
    if cluster.secure is not None:
        typer.echo("\nFirst log in (the local identity provider approves at once):")
        typer.echo("  lattice login --device")
    typer.echo(
        "\nTry (prefix with `uv run` from the repository checkout):\n"
        "  lattice submit --walltime=5m -- echo hello\n  lattice status\n  lattice logs <ID>\n"
    )
    typer.echo("Press Ctrl-C to stop the cluster.")
    try:
        while not stop["now"]:
            time.sleep(0.5)
            dead = [
                m.id for m in cluster.members if m.proc is not None and m.proc.poll() is not None
            ]
            if dead and len(dead) > len(cluster.members) // 2:
                typer.echo(
                    f"Quorum lost (members {dead} exited); see {cluster.base / 'logs'}", err=True
                )
                break
    finally:
        typer.echo("Stopping the cluster...")
        cluster.stop()
        typer.echo("Stopped.")
