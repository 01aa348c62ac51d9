-- hg_record_outcomes: record the outcomes of one or many sends in one round trip (see PostgresLedger.record_outcome
-- and postgres_group.py). Not a migration: `migrate` (re)creates it whenever this text changes, as begin_send.sql.
--
-- Its arguments are arrays, an element for each operation (record_outcome's parameters, in order); the caller never
-- gives one operation or one message id twice. First the message ids are locked (lock_provider's lock, in one order:
-- their hashes'), so a webhook for one of them either committed before (and is seen parked now) or waits for this
-- commit (and then finds the id). With `p_refuse_parked`, a webhook parked for one of them raises HG001, rolling
-- everything back: the caller records again in a transaction that applies it (core.apply_parked). Then each outcome
-- is recorded as record_outcome records one: fenced on its owner, its event written, an accepted answer whose
-- message id another operation holds sent to review naming that one ({holder}).
--
-- Returns a row for each given id: the state it was in (NULL: no such operation), the operation as recorded (NULL:
-- it was not ours to record), and whether webhooks are parked for its message id.
CREATE OR REPLACE FUNCTION hg_record_outcomes(
    p_states text[], p_provider_ids text[], p_results text[], p_errors text[], p_review_reasons text[],
    p_attempts_back integer[], p_not_before float8[], p_next_check float8[], p_ids text[], p_owners text[],
    p_actors text[], p_reasons text[], p_taken text[],
    p_parked_seconds float8, p_refuse_parked boolean
) RETURNS TABLE (given_id text, before_state text, operation operations, parked boolean)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(1212633175, ids.h)
    FROM (SELECT DISTINCT hashtext(p) AS h FROM unnest(p_provider_ids) AS p WHERE p IS NOT NULL) AS ids
    ORDER BY ids.h;
    IF p_refuse_parked AND EXISTS (
        SELECT 1 FROM webhook_deliveries w
        WHERE w.provider_id = ANY (p_provider_ids) AND w.outcome = 'parked'
          AND w.received_at >= statement_timestamp() - p_parked_seconds * interval '1 second'
    ) THEN
        RAISE EXCEPTION 'webhooks are kept for a message id being recorded' USING ERRCODE = 'HG001';
    END IF;
    RETURN QUERY
    WITH given AS (
        SELECT * FROM unnest(p_states, p_provider_ids, p_results, p_errors, p_review_reasons, p_attempts_back,
            p_not_before, p_next_check, p_ids, p_owners, p_actors, p_reasons, p_taken)
            AS g (state, provider_id, result, last_error, review_reason, attempts_back, not_before, next_check, id,
                owner, actor, reason, taken)),
    before AS MATERIALIZED (
        SELECT o.id, o.state FROM operations o WHERE o.id IN (SELECT g.id FROM given g) ORDER BY o.id FOR UPDATE),
    holder AS MATERIALIZED (
        SELECT g.id, h.id AS holder_id, replace(g.taken, '{holder}', h.id) AS reason
        FROM given g, LATERAL (
            SELECT o.id FROM operations o WHERE o.provider_id = g.provider_id AND o.id <> g.id LIMIT 1) AS h
        WHERE g.state = 'accepted' AND g.provider_id IS NOT NULL),
    recorded AS (
        UPDATE operations SET state = CASE WHEN holder.holder_id IS NULL THEN g.state ELSE 'needs_review' END,
            provider_id = CASE WHEN holder.holder_id IS NULL THEN COALESCE(g.provider_id, operations.provider_id)
                ELSE operations.provider_id END,
            result = COALESCE(g.result::json, operations.result),
            last_error = COALESCE(g.last_error, operations.last_error),
            review_reason = COALESCE(holder.reason, g.review_reason),
            attempts = operations.attempts - g.attempts_back,
            not_before = statement_timestamp() + g.not_before * interval '1 second',
            next_check_at = statement_timestamp() + g.next_check * interval '1 second',
            lease_expires_at = NULL, updated_at = statement_timestamp()
        FROM given g JOIN before b ON b.id = g.id LEFT JOIN holder ON holder.id = g.id
        WHERE operations.id = g.id AND operations.lease_owner = g.owner AND operations.state IN {recordable}
        RETURNING operations AS op, operations.id, operations.state, operations.provider_id, b.state AS from_state,
            holder.reason AS taken_reason, g.actor, g.reason),
    logged AS (
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        SELECT r.id, statement_timestamp(), r.from_state, r.state, r.actor, COALESCE(r.taken_reason, r.reason)
        FROM recorded r)
    SELECT g.id, b.state, r.op, EXISTS (
        SELECT 1 FROM webhook_deliveries w WHERE w.provider_id = r.provider_id AND w.outcome = 'parked'
          AND w.received_at >= statement_timestamp() - p_parked_seconds * interval '1 second')
    FROM given g LEFT JOIN before b ON b.id = g.id LEFT JOIN recorded r ON r.id = g.id;
END
$$;
