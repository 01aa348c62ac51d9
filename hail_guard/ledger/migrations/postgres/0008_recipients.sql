-- hail-guard ledger (PostgreSQL), version 8: every recipient field, one normal form, retries by meaning.
-- As SQLite's version 6: `recipients` holds everyone a send reaches (to, cc, bcc, ...) in the one
-- normal form of `hail_guard.recipients`, `recipient_keys` what opt-outs are probed by (each
-- recipient, and the mailbox of a sub-address); `content_fingerprint` is the message by meaning;
-- `sender` the sender fields given; `operation_recipients` finds the live operations that carry a
-- message for a recipient; `may_have_left` marks an operator's close after it may have been sent.
-- Existing rows are recomputed from their stored requests right after this script
-- (`hail_guard.ledger.backfill`), in the same transaction. `hg_begin_send` is no longer a migration:
-- it lives in sql/postgres/begin_send.sql and `migrate` (re)creates it when its text changes.
ALTER TABLE operations ADD COLUMN sender JSONB NOT NULL DEFAULT '{}';
ALTER TABLE operations ADD COLUMN may_have_left BOOLEAN NOT NULL DEFAULT false;
CREATE TABLE operation_recipients (
    operation_id        TEXT NOT NULL REFERENCES operations (id),
    recipient           TEXT NOT NULL,
    content_fingerprint TEXT NOT NULL,
    PRIMARY KEY (operation_id, recipient)
);
CREATE INDEX operation_recipients_by_message ON operation_recipients (content_fingerprint, recipient);
DROP INDEX operations_by_content;
DROP FUNCTION hg_begin_send(text, text, text, text, jsonb, text[], text, text, text, text, text, text, text, text,
    float8, float8, integer, integer, text);
UPDATE operations SET may_have_left = true
WHERE state IN ('failed', 'cancelled') AND (resent_as IS NOT NULL OR EXISTS (
    SELECT 1 FROM events e
    WHERE e.operation_id = operations.id AND e.from_state = 'needs_review' AND e.to_state = operations.state));
CREATE TABLE hail_guard_functions (
    name     TEXT PRIMARY KEY,
    checksum TEXT NOT NULL
);
