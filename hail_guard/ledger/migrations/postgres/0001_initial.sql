-- hail-guard ledger (PostgreSQL), version 1: operations and their event history.
-- Times are timestamptz from the database's clock. Version numbers match the SQLite ledger's.
CREATE TABLE operations (
    id                  TEXT PRIMARY KEY,
    seq                 BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,  -- insertion order (SQLite's rowid)
    idempotency_key     TEXT NOT NULL UNIQUE,
    tool                TEXT NOT NULL,
    channel             TEXT NOT NULL,
    recipients          JSONB NOT NULL,         -- JSON list, as given
    request             TEXT NOT NULL,          -- canonical JSON, exactly as forwarded
    request_fingerprint TEXT NOT NULL,
    content_fingerprint TEXT NOT NULL,
    campaign_id         TEXT,
    lead_id             TEXT,
    message_id          TEXT,
    batch_id            TEXT,
    state               TEXT NOT NULL CHECK (state IN ('planned', 'ready', 'sending', 'accepted',
                                                       'failed', 'unknown', 'needs_review', 'cancelled')),
    provider_id         TEXT,
    result              JSON,                   -- the upstream's answer, its text kept as received
    last_error          TEXT,
    review_reason       TEXT,
    attempts            INTEGER NOT NULL DEFAULT 0,
    lease_owner         TEXT,
    lease_expires_at    TIMESTAMPTZ,
    not_before          TIMESTAMPTZ,
    next_check_at       TIMESTAMPTZ,
    created_at          TIMESTAMPTZ NOT NULL,
    updated_at          TIMESTAMPTZ NOT NULL,
    first_sent_at       TIMESTAMPTZ
);
CREATE INDEX operations_by_state ON operations (state, next_check_at);
CREATE INDEX operations_by_content ON operations (content_fingerprint, created_at);
CREATE INDEX operations_by_campaign ON operations (campaign_id, created_at);
CREATE INDEX operations_by_batch ON operations (batch_id, state);
CREATE INDEX operations_sending_by_lease ON operations (lease_expires_at) WHERE state = 'sending';

CREATE TABLE events (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id TEXT NOT NULL REFERENCES operations (id),
    at           TIMESTAMPTZ NOT NULL,
    from_state   TEXT,
    to_state     TEXT NOT NULL,
    actor        TEXT NOT NULL,
    reason       TEXT NOT NULL
);
CREATE INDEX events_by_operation ON events (operation_id, id);
