-- hail-guard ledger (PostgreSQL), version 9: what the operator console reads, each list by an index.
-- As SQLite's version 7: newest first, overall and by state (the review queue); a recipient's
-- operations; keys and opt-outs by prefix (in byte order, "C", whatever the database's collation);
-- batches newest first; and the definitions of upstream tools by fingerprint, so that a changed
-- tool is shown as a diff.
CREATE INDEX operations_by_created ON operations (created_at, seq);
CREATE INDEX operations_by_state_created ON operations (state, created_at, seq);
CREATE INDEX operations_by_key_prefix ON operations (idempotency_key COLLATE "C");
CREATE INDEX operation_recipients_by_recipient ON operation_recipients (recipient COLLATE "C");
CREATE INDEX suppressions_by_recipient ON suppressions (recipient COLLATE "C", channel COLLATE "C");
CREATE INDEX batches_by_created ON batches (created_at);
CREATE TABLE upstream_tool_definitions (
    fingerprint TEXT PRIMARY KEY,
    definition  TEXT NOT NULL              -- canonical JSON: name, description and schemas
);

-- Sends per hour, as SQLite's: how many operations first left in each hour (UTC), by their state and
-- delivery state now, kept by the trigger below in the transaction of every write to `operations`.
-- Each writer adds to its own shard of every count (its backend pid modulo 16), so concurrent
-- workers never queue on one hot row; a count is the sum of its shards (one of which may be
-- negative: a send counted in by one connection and out by another). A change moves both of an
-- operation's rows in one statement, in key order, so two writers never lock them crosswise.
-- Writes to `operations` wait while this version fills the counts (the lock), so none is missed.
LOCK TABLE operations IN SHARE ROW EXCLUSIVE MODE;
CREATE TABLE sends_by_hour (
    hour           TIMESTAMPTZ NOT NULL,   -- the hour (UTC) in which the send first left
    state          TEXT NOT NULL,
    delivery_state TEXT NOT NULL,          -- '' before any delivery fact
    shard          SMALLINT NOT NULL,
    count          BIGINT NOT NULL,
    PRIMARY KEY (hour, state, delivery_state, shard)
);
INSERT INTO sends_by_hour (hour, state, delivery_state, shard, count)
SELECT date_trunc('hour', first_sent_at, 'UTC'), state, COALESCE(delivery_state, ''), 0, count(*)
FROM operations WHERE first_sent_at IS NOT NULL GROUP BY 1, 2, 3;

CREATE FUNCTION hg_count_sends() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO sends_by_hour AS c (hour, state, delivery_state, shard, count)
    SELECT moved.hour, moved.state, moved.delivery_state, pg_backend_pid() % 16, moved.change
    FROM (
        SELECT date_trunc('hour', OLD.first_sent_at, 'UTC') AS hour, OLD.state AS state,
               COALESCE(OLD.delivery_state, '') AS delivery_state, -1 AS change
        WHERE TG_OP <> 'INSERT' AND OLD.first_sent_at IS NOT NULL
        UNION ALL
        SELECT date_trunc('hour', NEW.first_sent_at, 'UTC'), NEW.state, COALESCE(NEW.delivery_state, ''), 1
        WHERE TG_OP <> 'DELETE' AND NEW.first_sent_at IS NOT NULL
    ) AS moved
    ORDER BY moved.hour, moved.state, moved.delivery_state
    ON CONFLICT (hour, state, delivery_state, shard) DO UPDATE SET count = c.count + excluded.count;
    RETURN NULL;
END
$$;
CREATE TRIGGER sends_by_hour_insert AFTER INSERT ON operations
    FOR EACH ROW WHEN (NEW.first_sent_at IS NOT NULL) EXECUTE FUNCTION hg_count_sends();
CREATE TRIGGER sends_by_hour_update AFTER UPDATE OF first_sent_at, state, delivery_state ON operations
    FOR EACH ROW WHEN (OLD.first_sent_at IS DISTINCT FROM NEW.first_sent_at OR OLD.state IS DISTINCT FROM NEW.state
                       OR OLD.delivery_state IS DISTINCT FROM NEW.delivery_state)
    EXECUTE FUNCTION hg_count_sends();
CREATE TRIGGER sends_by_hour_delete AFTER DELETE ON operations
    FOR EACH ROW WHEN (OLD.first_sent_at IS NOT NULL) EXECUTE FUNCTION hg_count_sends();
