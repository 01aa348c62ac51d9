-- hail-guard ledger, version 2: batches, the suppression list, and why an operation was cancelled.
CREATE TABLE batches (
    id         TEXT PRIMARY KEY,
    name       TEXT,
    created_by TEXT NOT NULL,
    created_at REAL NOT NULL
);

CREATE TABLE suppressions (
    recipient  TEXT NOT NULL,               -- normalised: trimmed, lower case
    channel    TEXT NOT NULL,               -- email | sms | call | all
    reason     TEXT NOT NULL,
    source     TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (recipient, channel)
);

ALTER TABLE operations ADD COLUMN cancel_reason TEXT;
CREATE INDEX operations_ready ON operations (created_at) WHERE state = 'ready';
