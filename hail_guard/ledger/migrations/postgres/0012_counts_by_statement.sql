-- 12: the sends counted per hour (sends_by_hour, see 0009) by one trigger call a statement, not one a row: a group
-- commit's statements move many operations at once (record_outcomes, hg_claim_ready_for), and a row's trigger call
-- cost more than the row's own update. The counts are the same: each statement adds, per hour, state and delivery
-- state, what its rows left and entered (changes that add up to nothing are not written). Sharded by writer as in 0009.
DROP TRIGGER sends_by_hour_insert ON operations;
DROP TRIGGER sends_by_hour_update ON operations;
DROP TRIGGER sends_by_hour_delete ON operations;
DROP FUNCTION hg_count_sends();

CREATE FUNCTION hg_count_sends() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO sends_by_hour AS c (hour, state, delivery_state, shard, count)
        SELECT date_trunc('hour', n.first_sent_at, 'UTC'), n.state, COALESCE(n.delivery_state, ''),
            pg_backend_pid() % 16, count(*)
        FROM new_rows n WHERE n.first_sent_at IS NOT NULL
        GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
        ON CONFLICT (hour, state, delivery_state, shard) DO UPDATE SET count = c.count + excluded.count;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO sends_by_hour AS c (hour, state, delivery_state, shard, count)
        SELECT moved.hour, moved.state, moved.delivery_state, pg_backend_pid() % 16, sum(moved.change)
        FROM (
            SELECT date_trunc('hour', o.first_sent_at, 'UTC') AS hour, o.state AS state,
                   COALESCE(o.delivery_state, '') AS delivery_state, -1 AS change
            FROM old_rows o WHERE o.first_sent_at IS NOT NULL
            UNION ALL
            SELECT date_trunc('hour', n.first_sent_at, 'UTC'), n.state, COALESCE(n.delivery_state, ''), 1
            FROM new_rows n WHERE n.first_sent_at IS NOT NULL
        ) AS moved
        GROUP BY 1, 2, 3 HAVING sum(moved.change) <> 0 ORDER BY 1, 2, 3
        ON CONFLICT (hour, state, delivery_state, shard) DO UPDATE SET count = c.count + excluded.count;
    ELSE
        INSERT INTO sends_by_hour AS c (hour, state, delivery_state, shard, count)
        SELECT date_trunc('hour', o.first_sent_at, 'UTC'), o.state, COALESCE(o.delivery_state, ''),
            pg_backend_pid() % 16, -count(*)
        FROM old_rows o WHERE o.first_sent_at IS NOT NULL
        GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
        ON CONFLICT (hour, state, delivery_state, shard) DO UPDATE SET count = c.count + excluded.count;
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER sends_by_hour_insert AFTER INSERT ON operations
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION hg_count_sends();
CREATE TRIGGER sends_by_hour_update AFTER UPDATE ON operations
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION hg_count_sends();
CREATE TRIGGER sends_by_hour_delete AFTER DELETE ON operations
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION hg_count_sends();
