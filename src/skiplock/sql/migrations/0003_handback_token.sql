-- skiplock schema, version 3: the token of the last fenced hand-back (fail, retry,
-- release) stays on the row.
--
-- A hand-back whose reply was lost with its connection is retried; if another worker
-- has re-claimed the job in between, the lease token on the row is new and the retry
-- matches nothing.  Without a record, the worker would report a lost lease for a write
-- that did commit.  With it, fence_outcome can prove the first try committed.  The
-- column is written in the same UPDATE as the hand-back: no extra row, index or WAL
-- record.  ADD COLUMN without a default is a catalog-only change.

ALTER TABLE {schema}.jobs ADD COLUMN handback_token uuid;
