-- hail-guard ledger, version 1: operations and their event history.
-- Times are Unix epoch seconds (REAL), taken from the database's clock.
CREATE TABLE operations (
    id                  TEXT PRIMARY KEY,
    idempotency_key     TEXT NOT NULL UNIQUE,
    tool                TEXT NOT NULL,
    channel             TEXT NOT NULL,
    recipients          TEXT NOT NULL,          -- JSON list
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
    result              TEXT,                   -- JSON object: the upstream's answer
    last_error          TEXT,
    review_reason       TEXT,
    attempts            INTEGER NOT NULL DEFAULT 0,
    lease_owner         TEXT,
    lease_expires_at    REAL,
    not_before          REAL,
    next_check_at       REAL,
    created_at          REAL NOT NULL,
    updated_at          REAL NOT NULL,
    first_sent_at       REAL
);
CREATE INDEX operations_by_state ON operations (state, next_check_at);
CREATE INDEX operations_by_content ON operations (content_fingerprint, created_at);
CREATE INDEX operations_by_campaign ON operations (campaign_id, created_at);
CREATE INDEX operations_by_batch ON operations (batch_id, state);
CREATE INDEX operations_sending_by_lease ON operations (lease_expires_at) WHERE state = 'sending';

CREATE TABLE events (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    operation_id TEXT NOT NULL REFERENCES operations (id),
    at           REAL NOT NULL,
    from_state   TEXT,
    to_state     TEXT NOT NULL,
    actor        TEXT NOT NULL,
    reason       TEXT NOT NULL
);
CREATE INDEX events_by_operation ON events (operation_id, id);
