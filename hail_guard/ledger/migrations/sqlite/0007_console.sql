-- hail-guard ledger (SQLite), version 7: what the operator console reads, each list by an index.
-- Newest first, overall and by state (the review queue); a recipient's operations; batches newest
-- first; and the definitions of upstream tools by fingerprint, so that a changed tool is shown as a
-- diff against the one accepted.
CREATE INDEX operations_by_created ON operations (created_at);
CREATE INDEX operations_by_state_created ON operations (state, created_at);
CREATE INDEX operation_recipients_by_recipient ON operation_recipients (recipient);
CREATE INDEX batches_by_created ON batches (created_at);
CREATE TABLE upstream_tool_definitions (
    fingerprint TEXT PRIMARY KEY,
    definition  TEXT NOT NULL              -- canonical JSON: name, description and schemas
);

-- Sends per hour: how many operations first left in each hour (UTC), by their state and delivery
-- state now. Kept by the database itself, in the transaction of every write to `operations` (the
-- triggers below), so the console reads a week as one range of this small table, never the
-- operations. Filled here from the operations there are. A count that falls to 0 stays as a row
-- until `prune`.
CREATE TABLE sends_by_hour (
    hour           INTEGER NOT NULL,       -- the hour's start (epoch seconds) in which the send first left
    state          TEXT NOT NULL,
    delivery_state TEXT NOT NULL,          -- '' before any delivery fact
    count          INTEGER NOT NULL,
    PRIMARY KEY (hour, state, delivery_state)
) WITHOUT ROWID;
INSERT INTO sends_by_hour (hour, state, delivery_state, count)
SELECT CAST(first_sent_at / 3600 AS INTEGER) * 3600, state, COALESCE(delivery_state, ''), COUNT(*)
FROM operations WHERE first_sent_at IS NOT NULL GROUP BY 1, 2, 3;

CREATE TRIGGER sends_by_hour_insert AFTER INSERT ON operations WHEN NEW.first_sent_at IS NOT NULL
BEGIN
    INSERT INTO sends_by_hour (hour, state, delivery_state, count)
    VALUES (CAST(NEW.first_sent_at / 3600 AS INTEGER) * 3600, NEW.state, COALESCE(NEW.delivery_state, ''), 1)
    ON CONFLICT (hour, state, delivery_state) DO UPDATE SET count = count + 1;
END;
CREATE TRIGGER sends_by_hour_update AFTER UPDATE OF first_sent_at, state, delivery_state ON operations
WHEN OLD.first_sent_at IS NOT NEW.first_sent_at OR OLD.state IS NOT NEW.state
    OR OLD.delivery_state IS NOT NEW.delivery_state
BEGIN
    INSERT INTO sends_by_hour (hour, state, delivery_state, count)
    SELECT CAST(OLD.first_sent_at / 3600 AS INTEGER) * 3600, OLD.state, COALESCE(OLD.delivery_state, ''), -1
    WHERE OLD.first_sent_at IS NOT NULL
    UNION ALL
    SELECT CAST(NEW.first_sent_at / 3600 AS INTEGER) * 3600, NEW.state, COALESCE(NEW.delivery_state, ''), 1
    WHERE NEW.first_sent_at IS NOT NULL
    ON CONFLICT (hour, state, delivery_state) DO UPDATE SET count = count + excluded.count;
END;
CREATE TRIGGER sends_by_hour_delete AFTER DELETE ON operations WHEN OLD.first_sent_at IS NOT NULL
BEGIN
    UPDATE sends_by_hour SET count = count - 1
    WHERE hour = CAST(OLD.first_sent_at / 3600 AS INTEGER) * 3600 AND state = OLD.state
      AND delivery_state = COALESCE(OLD.delivery_state, '');
END;
