-- hail-guard ledger (PostgreSQL), version 10: what the ledger keeps beside the operations, as SQLite's
-- version 8. A webhook that names a message id no operation has yet is kept (outcome 'parked') with the
-- delivery state it carries, and applied in the transaction that records that id; the console's
-- sign-ins (a hash of the session id only), so every `serve` sharing this database serves them; and
-- the heartbeats of whoever is sending.
ALTER TABLE webhook_deliveries ADD COLUMN delivery_state TEXT;
ALTER TABLE webhook_deliveries ADD COLUMN occurred_at TIMESTAMPTZ;
CREATE INDEX webhook_deliveries_parked ON webhook_deliveries (provider_id, received_at) WHERE outcome = 'parked';

CREATE TABLE console_sessions (
    digest     TEXT PRIMARY KEY,           -- SHA-256 (hex) of the session id
    name       TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX console_sessions_by_expiry ON console_sessions (expires_at);

CREATE TABLE heartbeats (
    id         TEXT PRIMARY KEY,
    who        TEXT NOT NULL,
    role       TEXT NOT NULL,
    batch_id   TEXT,
    started_at TIMESTAMPTZ NOT NULL,
    seen_at    TIMESTAMPTZ NOT NULL
);
