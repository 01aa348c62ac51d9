-- hail-guard ledger (SQLite), version 6: every recipient field, one normal form, retries by meaning.
-- `recipients` now holds everyone a send reaches (to, cc, bcc, ...) in the one normal form of
-- `hail_guard.recipients`, and `recipient_keys` what opt-outs are probed by (each recipient, and the
-- mailbox of a sub-address). `content_fingerprint` is the message by meaning, without recipients or
-- sender; `sender` the sender fields given (JSON object). `operation_recipients` finds, per recipient,
-- the live operations that carry a message: how a regenerated retry is recognised.
-- `may_have_left`: closed by an operator (failed, cancelled) while it may have been sent.
-- The values of existing rows are recomputed from their stored requests right after this script
-- (`hail_guard.ledger.backfill`), in the same transaction.
ALTER TABLE operations ADD COLUMN recipient_keys TEXT NOT NULL DEFAULT '[]';
ALTER TABLE operations ADD COLUMN sender TEXT NOT NULL DEFAULT '{}';
ALTER TABLE operations ADD COLUMN may_have_left INTEGER NOT NULL DEFAULT 0;
CREATE TABLE operation_recipients (
    operation_id        TEXT NOT NULL REFERENCES operations (id),
    recipient           TEXT NOT NULL,
    content_fingerprint TEXT NOT NULL,
    PRIMARY KEY (operation_id, recipient)
) WITHOUT ROWID;
CREATE INDEX operation_recipients_by_message ON operation_recipients (content_fingerprint, recipient);
DROP INDEX operations_by_content;
UPDATE operations SET may_have_left = 1
WHERE state IN ('failed', 'cancelled') AND (resent_as IS NOT NULL OR EXISTS (
    SELECT 1 FROM events e
    WHERE e.operation_id = operations.id AND e.from_state = 'needs_review' AND e.to_state = operations.state));
