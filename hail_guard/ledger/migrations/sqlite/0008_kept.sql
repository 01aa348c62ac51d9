-- hail-guard ledger (SQLite), version 8: what the ledger keeps beside the operations.
-- A webhook that names a message id no operation has yet (an `unknown` send whose answer was lost) is
-- kept (outcome 'parked') with the delivery state it carries, and applied in the transaction that
-- records that id (an outcome, a reconcile, a review decision). Kept for as long as its delivery id
-- is remembered; a bounded number at once (hail_guard.ledger.core).
ALTER TABLE webhook_deliveries ADD COLUMN delivery_state TEXT;
ALTER TABLE webhook_deliveries ADD COLUMN occurred_at REAL;     -- as the event said (NULL: it gave no time)
CREATE INDEX webhook_deliveries_parked ON webhook_deliveries (provider_id, received_at) WHERE outcome = 'parked';

-- The console's sign-ins, so that every `serve` sharing the ledger serves them and a restart keeps them.
-- Only a hash of the session id is kept: the id itself lives in the operator's cookie alone.
CREATE TABLE console_sessions (
    digest     TEXT PRIMARY KEY,           -- SHA-256 (hex) of the session id
    name       TEXT NOT NULL,              -- who every decision of the session is recorded as
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX console_sessions_by_expiry ON console_sessions (expires_at);

-- Who is sending: each worker, `batch run` and `serve` draining a batch beats here while it runs,
-- and takes its row away when it ends (a crashed one stops beating: its row goes stale).
CREATE TABLE heartbeats (
    id         TEXT PRIMARY KEY,
    who        TEXT NOT NULL,              -- host:pid
    role       TEXT NOT NULL,              -- worker | batch run | serve
    batch_id   TEXT,                       -- NULL: every batch
    started_at REAL NOT NULL,
    seen_at    REAL NOT NULL
) WITHOUT ROWID;
