-- hg_begin_send: a guarded send's first step in one round trip (see PostgresLedger.begin_send).
-- Not a migration: `migrate` (re)creates it whenever this text changes (its checksum is kept in
-- hail_guard_functions). It runs, statement by statement inside the caller's transaction: lease expiry, the
-- key's row, the advisory locks of the send's recipient keys and lead (hg_lock_key), the opt-out check, and what
-- the rules about the same send compare (hail_guard.same_send): the same message to a shared recipient key, the
-- unresolved sends that hold the recipients or the lead, the other messages they have; then the insert or the
-- claim. As in READ COMMITTED, each statement sees what other transactions committed before it, and the checks
-- run after the locks are held, so two sends to one recipient take turns with each other and with the claims
-- (claims.sql), which take the same locks.
--
-- Returns rows of `verdict` and an operation:
--   claimed     the operation is now `sending` under `owner`: forward it (a new key, or a `ready` one)
--   existing    the key's operation (or the legacy key's), untouched: the caller answers from it (or claims it, if
--               it is the same message in another form and still `ready`), or refuses another message under it
--   suppressed  a new key to a recipient who opted out; nothing recorded (no operation)
--   matches     the same message to a shared recipient key (one row each, newest first); nothing recorded: the
--               caller decides (same_send.judge)
--   holds       unresolved sends to a shared recipient key on the channel, or to the lead; nothing recorded
--   near        other messages the recipients have that the caller has not compared yet (`p_compared`); nothing
--               recorded: the caller compares them (same_send.similarity) and calls again with their ids
--   vanished    the key's row was there and then gone (only a prune could do that): retry
DROP FUNCTION IF EXISTS hg_begin_send(
    text, text, text, text, jsonb, text[], text, text, text, jsonb, text, text, text, text, text, float8, float8,
    text[], boolean, integer, integer[], text);

CREATE OR REPLACE FUNCTION hg_lock_key(subject text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('hail-guard:' || subject, 0)
$$;

CREATE OR REPLACE FUNCTION hg_holds(p_keys text[], p_channel text, p_lead text) RETURNS SETOF operations
LANGUAGE sql STABLE AS $$
    -- Unresolved sends (same_send.HOLDING) to one of these recipient keys on the channel, or to the lead. Found
    -- from the recipients' and the lead's sends (their indexes), each then read by its id (OFFSET 0 keeps that
    -- order: otherwise the planner starts from every send in a holding state, and the state index also holds the
    -- old versions of rows that left it until a vacuum: a busy drain leaves thousands).
    SELECT o.* FROM (
        SELECT f.id, bool_or(f.by_key) AS by_key FROM (
            SELECT r.operation_id AS id, true AS by_key FROM operation_recipients r
            WHERE r.recipient COLLATE "C" = ANY (p_keys)
            UNION ALL
            SELECT l.id, false FROM operations l WHERE l.lead = p_lead) AS f
        GROUP BY f.id) AS c,
    LATERAL (SELECT x.* FROM operations x WHERE x.id = c.id OFFSET 0) AS o
    WHERE o.state IN {holding} AND ((c.by_key AND o.channel = p_channel) OR o.lead = p_lead)
    ORDER BY o.created_at, o.seq LIMIT 5
$$;

CREATE OR REPLACE FUNCTION hg_begin_send(
    p_id text, p_key text, p_tool text, p_channel text, p_recipients jsonb, p_recipient_keys text[],
    p_request text, p_request_fingerprint text, p_content_fingerprint text, p_sender jsonb, p_campaign_id text,
    p_lead_id text, p_message_id text, p_batch_id text, p_lead text,
    p_owner text, p_lease_seconds float8,
    p_legacy_key text,  -- the key an earlier version derived for this send, or NULL
    p_always text[], p_windowed text[], p_closed_blocks boolean, p_window_seconds float8,  -- Rules.match_states
    p_hold_lead boolean,  -- Rules.hold_lead
    p_near boolean,  -- whether other messages are compared (Rules.compares_near, and no allow_duplicate)
    p_compared text[],  -- the other messages the caller compared already
    p_expired_reason text
) RETURNS TABLE (verdict text, operation operations)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    existing operations;
    written operations;
    held operations;
    now_ timestamptz;
    hold_lead text := CASE WHEN p_hold_lead THEN p_lead END;
BEGIN
    -- Leases run out first (as `expire_leases`), so an expired send under this key is seen `unknown`.
    PERFORM hg_expire_leases(p_expired_reason);

    -- The recipients' and the lead's locks, first and in one order: a transaction that holds one never waits for
    -- another one's (the claims only try them), so two sends to one recipient take turns and never deadlock.
    PERFORM pg_advisory_xact_lock(lock_) FROM (
        SELECT DISTINCT hg_lock_key(subject) AS lock_
        FROM unnest(p_recipient_keys || CASE WHEN hold_lead IS NULL THEN '{}'::text[] ELSE ARRAY['lead:' || hold_lead] END)
            AS subject) AS locks
    ORDER BY lock_;
    SELECT * INTO existing FROM operations o WHERE o.idempotency_key IN (p_key, p_legacy_key)
    ORDER BY o.idempotency_key = p_key DESC LIMIT 1 FOR UPDATE;

    IF existing.id IS NULL THEN
        IF EXISTS (  -- as `_opted_out` in postgres.py: one probe of the opt-out list's key per recipient
            SELECT 1 FROM unnest(p_recipient_keys) AS r (recipient), LATERAL (
                SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (p_channel, 'all')
                LIMIT 1) AS opted_out
        ) THEN
            RETURN QUERY SELECT 'suppressed'::text, NULL::operations;
            RETURN;
        END IF;
        RETURN QUERY  -- the same message to a shared recipient key, in a state that blocks it
        SELECT 'matches'::text, o FROM operations o
        WHERE o.id IN (
            SELECT r.operation_id FROM operation_recipients r
            WHERE r.content_fingerprint = p_content_fingerprint AND r.recipient = ANY (p_recipient_keys))
          AND o.idempotency_key <> p_key AND o.tool = p_tool
          AND (o.state = ANY (p_always)
               OR ((o.state = ANY (p_windowed) OR (p_closed_blocks AND o.may_have_left))
                   AND COALESCE(o.first_sent_at, o.created_at)
                       >= statement_timestamp() - p_window_seconds * interval '1 second'))
          AND NOT EXISTS (  -- same_send.senders_agree: they differ only where both give them
            SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each(p_sender) b ON a.key = b.key
            WHERE a.value <> b.value)
        ORDER BY o.created_at DESC, o.seq DESC
        LIMIT 20;
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY SELECT 'holds'::text, h FROM hg_holds(p_recipient_keys, p_channel, hold_lead) AS h;
        IF FOUND THEN
            RETURN;
        END IF;
        IF p_near AND EXISTS (  -- another message the recipients have, that the caller has not compared
            SELECT 1 FROM operations o
            WHERE o.id IN (
                SELECT r.operation_id FROM operation_recipients r WHERE r.recipient COLLATE "C" = ANY (p_recipient_keys))
              AND o.channel = p_channel AND o.content_fingerprint <> p_content_fingerprint
              AND o.idempotency_key <> p_key AND NOT (o.id = ANY (COALESCE(p_compared, '{}')))
              AND (o.state IN {waiting}
                   OR ((o.state IN {settled_live} OR o.may_have_left)
                       AND COALESCE(o.first_sent_at, o.created_at)
                           >= statement_timestamp() - p_window_seconds * interval '1 second'))
        ) THEN
            RETURN QUERY
            SELECT 'near'::text, o FROM operations o
            WHERE o.id IN (
                SELECT r.operation_id FROM operation_recipients r WHERE r.recipient COLLATE "C" = ANY (p_recipient_keys))
              AND o.channel = p_channel AND o.content_fingerprint <> p_content_fingerprint
              AND o.idempotency_key <> p_key
              AND (o.state IN {waiting}
                   OR ((o.state IN {settled_live} OR o.may_have_left)
                       AND COALESCE(o.first_sent_at, o.created_at)
                           >= statement_timestamp() - p_window_seconds * interval '1 second'))
            ORDER BY o.created_at DESC, o.seq DESC
            LIMIT 20;
            RETURN;
        END IF;
        now_ := clock_timestamp();  -- after any wait for a lock: the lease runs from the write
        INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,
            request_fingerprint, content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, lead, state,
            attempts, lease_owner, lease_expires_at, created_at, updated_at, first_sent_at)
        VALUES (p_id, p_key, p_tool, p_channel, p_recipients, p_recipient_keys, p_request,
            p_request_fingerprint, p_content_fingerprint, p_sender, p_campaign_id, p_lead_id, p_message_id,
            p_batch_id, p_lead, 'sending', 1, p_owner, now_ + p_lease_seconds * interval '1 second', now_, now_, now_)
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING * INTO written;
        IF FOUND THEN
            INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
            SELECT written.id, r, p_content_fingerprint FROM unnest(p_recipient_keys) AS r;
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

    -- The key exists: a `ready` operation with the same request is claimed unless its recipients are held, anything
    -- else answered from.
    SELECT * INTO held FROM hg_holds(existing.recipient_keys, existing.channel, hold_lead) AS h
    WHERE h.id <> existing.id LIMIT 1;
    now_ := clock_timestamp();
    UPDATE operations o SET state = 'sending', attempts = o.attempts + 1, lease_owner = p_owner,
        lease_expires_at = now_ + p_lease_seconds * interval '1 second', updated_at = now_,
        first_sent_at = COALESCE(o.first_sent_at, now_)
    WHERE o.id = existing.id AND o.state = 'ready' AND o.request_fingerprint = p_request_fingerprint
      AND held.id IS NULL
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
