-- hail-guard ledger (PostgreSQL), version 7: reconcile's next `unknown` operations without sorting them all.
-- A reconcile claim wants the due `unknown` operations in check order (`next_check_at NULLS FIRST, seq`).
-- With only (state, next_check_at) to go by, PostgreSQL read every `unknown` operation and sorted them for
-- each claim: after an outage that left thousands unknown, every claim of the next hundred read them all.
CREATE INDEX operations_unknown_due ON operations (next_check_at NULLS FIRST, seq) WHERE state = 'unknown';
