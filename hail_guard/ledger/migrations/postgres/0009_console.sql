-- hail-guard ledger (PostgreSQL), version 9: what the operator console reads, each list by an index.
-- As SQLite's version 7: newest first, overall and by state (the review queue); sends per hour by
-- the time they left, with their state and delivery state in the index; a recipient's operations;
-- keys and opt-outs by prefix (in byte order, "C", whatever the database's collation); batches
-- newest first; and the definitions of upstream tools by fingerprint, so that a changed tool is
-- shown as a diff.
CREATE INDEX operations_by_created ON operations (created_at, seq);
CREATE INDEX operations_by_state_created ON operations (state, created_at, seq);
CREATE INDEX operations_by_first_sent ON operations (first_sent_at, state, delivery_state)
    WHERE first_sent_at IS NOT NULL;
CREATE INDEX operations_by_key_prefix ON operations (idempotency_key COLLATE "C");
CREATE INDEX operation_recipients_by_recipient ON operation_recipients (recipient COLLATE "C");
CREATE INDEX suppressions_by_recipient ON suppressions (recipient COLLATE "C", channel COLLATE "C");
CREATE INDEX batches_by_created ON batches (created_at);
CREATE TABLE upstream_tool_definitions (
    fingerprint TEXT PRIMARY KEY,
    definition  TEXT NOT NULL              -- canonical JSON: name, description and schemas
);
