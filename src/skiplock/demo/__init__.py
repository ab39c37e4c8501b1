"""The postmortem's invoicing system, runnable: ``skiplock demo`` shows who got two emails.

Invoices, one email job per invoice (payload: the invoice id only), W worker processes
sending through a local fake email provider that honours ``Idempotency-Key``, and the
audit table with its UNIQUE constraint on ``job_id``.  By default the workers are
skiplock's own and every invoice is emailed once; ``--strategy naive
--no-idempotency`` is the postmortem's incident; ``--kill-worker`` SIGKILLs a worker mid-run
and shows its jobs coming back after the lease without a second email.  Uses only
skiplock's public API and ``skiplock.lab``; the core knows nothing of it.
"""

from ._invoices import QUEUE, InvoiceMailer
from ._provider import FakeEmailProvider, ProviderStats
from ._run import DemoConfig, DemoError, DemoResult, KilledWorker, run_demo

__all__ = [
    "QUEUE",
    "DemoConfig",
    "DemoError",
    "DemoResult",
    "FakeEmailProvider",
    "InvoiceMailer",
    "KilledWorker",
    "ProviderStats",
    "run_demo",
]
