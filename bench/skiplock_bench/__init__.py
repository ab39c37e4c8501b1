"""skiplock's bench: skiplock, procrastinate, pgqueuer and pgbench on one Postgres, one run."""
