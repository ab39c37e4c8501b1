"""``skiplock dashboard``: serve the web dashboard with uvicorn (127.0.0.1 by default)."""

from __future__ import annotations

import ipaddress

import click

from skiplock.cli.common import dsn_option, require_extra, schema_option, user_errors

__all__ = ["dashboard"]

# What the `dashboard` extra installs; checked before anything else the command does.
EXTRA_MODULES = ("starlette", "uvicorn", "jinja2")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="TCP port."
)
@click.option(
    "--auth",
    default=None,
    metavar="USER:PASSWORD",
    help="Require HTTP basic auth (use it whenever --host is not a loopback address).",
)
@click.option(
    "--refresh",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0.5),
    help="Seconds between the queues page's live updates.",
)
@dsn_option
@schema_option
@user_errors
def dashboard(
    host: str, port: int, auth: str | None, refresh: float, dsn: str | None, schema: str
) -> None:
    """Serve the web dashboard: queues, throughput, jobs; retry, cancel, delete, pause.

    Actions are POSTs carrying a CSRF token.  It binds 127.0.0.1 unless told otherwise;
    anyone who can reach it can act on the queue, so give --auth before --host 0.0.0.0.
    """
    require_extra("the dashboard", "dashboard", *EXTRA_MODULES)
    import uvicorn

    from skiplock import Queue
    from skiplock.connect import embedded_data_dir, resolve_dsn

    from . import create_app, parse_auth

    credentials = parse_auth(auth) if auth is not None else None
    if not _loopback(host) and credentials is None:
        click.echo(
            f"skiplock: warning: serving on {host} without --auth: anyone who reaches it "
            "can retry, cancel and delete jobs",
            err=True,
        )
    if resolve_dsn(dsn) is None:
        click.echo(
            f"skiplock: no DSN given; using embedded PostgreSQL in {embedded_data_dir()}", err=True
        )
    with Queue(dsn, schema=schema, application_name="skiplock-dashboard", max_size=4) as q:
        q.status()  # fail now, with the core's one-line error, if the server or schema is off
        app = create_app(q, auth=credentials, refresh=refresh)
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"skiplock dashboard on http://{shown}:{port}/ (schema {schema})", err=True)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
