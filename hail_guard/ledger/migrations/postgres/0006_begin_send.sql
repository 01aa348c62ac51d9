-- hail-guard ledger (PostgreSQL), version 6: a guarded send's first step in one round trip.
-- `begin_send` took eight statements (lease expiry, the key's row, the opt-out and duplicate checks,
-- the insert, its event, a claim of a `ready` one, its event), each a round trip to the server. Here
-- they are one call that does the same, statement by statement, inside the caller's transaction.
-- As in READ COMMITTED, each statement below sees what other transactions committed before it ran,
-- so the duplicate check still reads after the content's advisory lock is held.
--
-- Returns one row: `verdict` and an operation.
--   claimed     the operation is now `sending` under `owner`: forward it (a new key, or a `ready` one)
--   existing    the key's operation, untouched: answer from it
--   suppressed  a new key to a recipient who opted out; nothing recorded (no operation)
--   duplicate   a new key for content a live operation already has; nothing recorded (that operation)
--   vanished    the key's row was there and then gone (only a prune could do that): retry
CREATE FUNCTION hg_begin_send(
    p_id text, p_key text, p_tool text, p_channel text, p_recipients jsonb, p_recipient_keys text[],
    p_request text, p_request_fingerprint text, p_content_fingerprint text, p_campaign_id text,
    p_lead_id text, p_message_id text, p_batch_id text,
    p_owner text, p_lease_seconds float8,
    p_duplicate_window_seconds float8,  -- NULL: no duplicate check
    p_content_lock_space integer, p_content_lock integer,  -- the content's advisory lock
    p_expired_reason text
) RETURNS TABLE (verdict text, operation operations)
LANGUAGE plpgsql AS $$
DECLARE
    existing operations;
    written operations;
    now_ timestamptz;
BEGIN
    -- Leases run out first (as `expire_leases`), so an expired send under this key is seen `unknown`.
    WITH picked AS MATERIALIZED (
        SELECT o.id FROM operations o WHERE o.state = 'sending' AND o.lease_expires_at <= statement_timestamp()
        FOR UPDATE SKIP LOCKED),
    expired AS (
        UPDATE operations o SET state = 'unknown', updated_at = statement_timestamp(),
            next_check_at = statement_timestamp()
        FROM picked WHERE o.id = picked.id
        RETURNING o.id)
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
    SELECT expired.id, statement_timestamp(), 'sending', 'unknown', 'ledger', p_expired_reason FROM expired;

    SELECT * INTO existing FROM operations o WHERE o.idempotency_key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        IF EXISTS (  -- as `_opted_out` in postgres.py: one probe of the opt-out list's key per recipient
            SELECT 1 FROM unnest(p_recipient_keys) AS r (recipient), LATERAL (
                SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (p_channel, 'all')
                LIMIT 1) AS opted_out
        ) THEN
            RETURN QUERY SELECT 'suppressed'::text, NULL::operations;
            RETURN;
        END IF;
        IF p_duplicate_window_seconds IS NOT NULL THEN
            PERFORM pg_advisory_xact_lock(p_content_lock_space, p_content_lock);
            SELECT * INTO existing FROM operations o
            WHERE o.content_fingerprint = p_content_fingerprint AND o.idempotency_key <> p_key
              AND o.state IN ('planned', 'ready', 'sending', 'accepted', 'unknown', 'needs_review')
              AND o.created_at >= statement_timestamp() - p_duplicate_window_seconds * interval '1 second'
            ORDER BY o.created_at DESC
            LIMIT 1;
            IF FOUND THEN
                RETURN QUERY SELECT 'duplicate'::text, existing;
                RETURN;
            END IF;
        END IF;
        now_ := clock_timestamp();  -- after any wait for a lock: the lease runs from the write
        INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,
            request_fingerprint, content_fingerprint, campaign_id, lead_id, message_id, batch_id, state, attempts,
            lease_owner, lease_expires_at, created_at, updated_at, first_sent_at)
        VALUES (p_id, p_key, p_tool, p_channel, p_recipients, p_recipient_keys, p_request,
            p_request_fingerprint, p_content_fingerprint, p_campaign_id, p_lead_id, p_message_id, p_batch_id,
            'sending', 1, p_owner, now_ + p_lease_seconds * interval '1 second', now_, now_, now_)
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING * INTO written;
        IF FOUND THEN
            INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
            VALUES (written.id, now_, NULL, 'sending', p_owner, 'intent recorded; forwarding');
            RETURN QUERY SELECT 'claimed'::text, written;
            RETURN;
        END IF;
        -- Another transaction inserted the key since we looked: take its row (committed by now).
        SELECT * INTO existing FROM operations o WHERE o.idempotency_key = p_key FOR UPDATE;
        IF NOT FOUND THEN  -- inserted and deleted again between two statements: only a prune could do that
            RETURN QUERY SELECT 'vanished'::text, NULL::operations;
            RETURN;
        END IF;
    END IF;

    -- The key exists: a `ready` operation with the same request is claimed, anything else answered from.
    now_ := clock_timestamp();
    UPDATE operations o SET state = 'sending', attempts = o.attempts + 1, lease_owner = p_owner,
        lease_expires_at = now_ + p_lease_seconds * interval '1 second', updated_at = now_,
        first_sent_at = COALESCE(o.first_sent_at, now_)
    WHERE o.id = existing.id AND o.state = 'ready' AND o.request_fingerprint = p_request_fingerprint
      AND (o.not_before IS NULL OR o.not_before <= now_)
      AND NOT EXISTS (
        SELECT 1 FROM unnest(o.recipient_keys) AS r (recipient), LATERAL (
            SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (o.channel, 'all')
            LIMIT 1) AS opted_out)
    RETURNING * INTO written;
    IF FOUND THEN
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        VALUES (written.id, now_, 'ready', 'sending', p_owner, 'claimed; forwarding');
        RETURN QUERY SELECT 'claimed'::text, written;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'existing'::text, existing;
END
$$;
