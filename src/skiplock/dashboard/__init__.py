"""A web dashboard for skiplock: queues, throughput, jobs, and the operator's buttons.

``skiplock dashboard`` serves it with uvicorn; ``create_app(queue)`` is the ASGI app, to
mount in your own server.  Built on the public ``Queue`` API only (status, list_jobs,
get, throughput, requeue, cancel, delete, pause, resume); needs the ``dashboard`` extra
(starlette, uvicorn, jinja2).
"""

from ._app import create_app
from ._security import Credentials, parse_auth

__all__ = ["Credentials", "create_app", "parse_auth"]
