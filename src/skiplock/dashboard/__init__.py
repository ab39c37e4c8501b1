"""A web dashboard for skiplock: queues, throughput, jobs, and the operator's buttons.

``skiplock dashboard`` serves it with uvicorn; ``create_app(queue)`` is the ASGI app, to
mount in your own server.  Built on the public ``Queue`` API only (status, list_jobs,
get, throughput, requeue, cancel, delete, pause, resume); needs the ``dashboard`` extra
(starlette, uvicorn, jinja2).

The names are loaded on first use, not on import: ``skiplock --help`` imports the
command (``skiplock.dashboard._cli``) to list it, and must work without the extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._app import create_app
    from ._security import Credentials, parse_auth

__all__ = ["Credentials", "create_app", "parse_auth"]

_HOMES = {"create_app": "._app", "Credentials": "._security", "parse_auth": "._security"}


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first asked for (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value
