-- hail-guard ledger (SQLite), version 7: what the operator console reads, each list by an index.
-- Newest first, overall and by state (the review queue); sends per hour by the time they left, with
-- their state and delivery state in the index (so an hour is counted from the index alone); a
-- recipient's operations; batches newest first; and the definitions of upstream tools by
-- fingerprint, so that a changed tool is shown as a diff against the one accepted.
CREATE INDEX operations_by_created ON operations (created_at);
CREATE INDEX operations_by_state_created ON operations (state, created_at);
CREATE INDEX operations_by_first_sent ON operations (first_sent_at, state, delivery_state)
    WHERE first_sent_at IS NOT NULL;
CREATE INDEX operation_recipients_by_recipient ON operation_recipients (recipient);
CREATE INDEX batches_by_created ON batches (created_at);
CREATE TABLE upstream_tool_definitions (
    fingerprint TEXT PRIMARY KEY,
    definition  TEXT NOT NULL              -- canonical JSON: name, description and schemas
);
