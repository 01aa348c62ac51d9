-- hail-guard ledger (PostgreSQL), version 2: batches, the suppression list, and why an operation was cancelled.
CREATE TABLE batches (
    id         TEXT PRIMARY KEY,
    name       TEXT,
    created_by TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL
);

CREATE TABLE suppressions (
    recipient  TEXT NOT NULL,               -- normalised: trimmed, lower case
    channel    TEXT NOT NULL,               -- email | sms | call | all
    reason     TEXT NOT NULL,
    source     TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (recipient, channel)
);

ALTER TABLE operations ADD COLUMN cancel_reason TEXT;
-- The recipients normalised by hail-guard (models.normalise_recipient) when the row is written, so
-- opt-out checks compare exactly what Python compares. Rows from version 1 get SQL's nearest equivalent.
ALTER TABLE operations ADD COLUMN recipient_keys TEXT[];
UPDATE operations SET recipient_keys = ARRAY(SELECT lower(btrim(r)) FROM jsonb_array_elements_text(recipients) AS r);
ALTER TABLE operations ALTER COLUMN recipient_keys SET NOT NULL;
CREATE INDEX operations_ready ON operations (created_at, seq) WHERE state = 'ready';
