-- hg_begin_send: a guarded send's first step in one round trip (see PostgresLedger.begin_send).
-- Not a migration: `migrate` (re)creates it whenever this text changes (its checksum is kept in
-- hail_guard_functions). It runs, statement by statement inside the caller's transaction: lease
-- expiry, the key's row, the opt-out check, the check for operations that already carry this message
-- to one of its recipients (under the advisory locks of its message and recipients), then the insert
-- or the claim. As in READ COMMITTED, each statement sees what other transactions committed before it.
--
-- Returns rows of `verdict` and an operation:
--   claimed     the operation is now `sending` under `owner`: forward it (a new key, or a `ready` one)
--   existing    the key's operation, untouched: the caller answers from it (or claims it, if it is the
--               same message in another form and still `ready`)
--   suppressed  a new key to a recipient who opted out; nothing recorded (no operation)
--   matches     a new key for a message that live operations already carry for one of its recipients
--               (one row each, newest first); nothing recorded: the caller decides (policy.repeat_of)
--   vanished    the key's row was there and then gone (only a prune could do that): retry
CREATE OR REPLACE FUNCTION hg_begin_send(
    p_id text, p_key text, p_tool text, p_channel text, p_recipients jsonb, p_recipient_keys text[],
    p_request text, p_request_fingerprint text, p_content_fingerprint text, p_sender jsonb, p_campaign_id text,
    p_lead_id text, p_message_id text, p_batch_id text,
    p_owner text, p_lease_seconds float8,
    p_duplicate_window_seconds float8,  -- NULL: no check for repeats
    p_blocking_states text[], p_closed_blocks boolean,  -- policy.blocking_states
    p_lock_space integer, p_locks integer[],  -- the advisory locks of the message for each recipient, sorted
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
            PERFORM pg_advisory_xact_lock(p_lock_space, lock_) FROM unnest(p_locks) AS lock_;
            RETURN QUERY
            SELECT 'matches'::text, o FROM operations o
            WHERE o.id IN (
                SELECT r.operation_id FROM operation_recipients r
                WHERE r.content_fingerprint = p_content_fingerprint
                  AND r.recipient IN (SELECT jsonb_array_elements_text(p_recipients)))
              AND o.idempotency_key <> p_key AND o.tool = p_tool
              AND (o.state = ANY (p_blocking_states) OR (p_closed_blocks AND o.may_have_left))
              AND o.created_at >= statement_timestamp() - p_duplicate_window_seconds * interval '1 second'
              AND NOT EXISTS (  -- policy.senders_agree: they differ only where both give them
                SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each(p_sender) b ON a.key = b.key
                WHERE a.value <> b.value)
            ORDER BY o.created_at DESC, o.seq DESC
            LIMIT 20;
            IF FOUND THEN
                RETURN;
            END IF;
        END IF;
        now_ := clock_timestamp();  -- after any wait for a lock: the lease runs from the write
        INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,
            request_fingerprint, content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, state,
            attempts, lease_owner, lease_expires_at, created_at, updated_at, first_sent_at)
        VALUES (p_id, p_key, p_tool, p_channel, p_recipients, p_recipient_keys, p_request,
            p_request_fingerprint, p_content_fingerprint, p_sender, p_campaign_id, p_lead_id, p_message_id,
            p_batch_id, 'sending', 1, p_owner, now_ + p_lease_seconds * interval '1 second', now_, now_, now_)
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING * INTO written;
        IF FOUND THEN
            INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
            SELECT written.id, r, p_content_fingerprint FROM jsonb_array_elements_text(p_recipients) AS r;
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
