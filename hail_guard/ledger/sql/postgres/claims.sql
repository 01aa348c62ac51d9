-- hg_claim_ready: claim `ready` operations to be sent (see PostgresLedger.claim_ready). Not a migration: (re)created
-- by `migrate` when this text changes, as begin_send.sql.
--
-- In one call: the leases that ran out are expired; then the oldest `ready` operations (of one batch, or the one
-- asked for) whose recipients did not opt out are taken, each under `FOR UPDATE SKIP LOCKED` (two workers never take
-- one row, nor wait for each other), unless it is held: a recipient key with an unresolved send on its channel, or
-- (`p_hold_lead`) its lead with one on any (same_send.HOLDING). A statement's snapshot cannot see a claim another
-- transaction is committing, so each candidate's recipients are locked first (hg_lock_key, as hg_begin_send locks
-- them; a try: a lock someone holds means that recipient is being sent to right now, and the candidate is left for a
-- later claim), and the hold is checked again in a statement of its own, which sees what committed before it.
-- Returns the operations claimed, oldest first. `hg_claim_ready_for` claims for several owners at once (the group
-- commit of concurrent claims, postgres_group.py): one statement, the same locks and checks for each claim.
DROP FUNCTION IF EXISTS hg_claim_ready(text, float8, integer, text, text, text, boolean);

CREATE OR REPLACE FUNCTION hg_claimable(p_id text, p_channel text, p_keys text[], p_lead text) RETURNS boolean
LANGUAGE plpgsql AS $$
-- Whether a candidate the caller holds the row lock of may be claimed: its recipients (and lead) are locked (a try:
-- another transaction sending to one of them right now leaves it for a later claim), and no unresolved send holds
-- them, checked in a statement of its own that sees what committed before it. The locks stay to the commit.
BEGIN
    RETURN NOT (EXISTS (
        SELECT 1 FROM unnest(p_keys || CASE WHEN p_lead IS NULL THEN '{}'::text[] ELSE ARRAY['lead:' || p_lead] END)
            AS subject
        WHERE NOT pg_try_advisory_xact_lock(hg_lock_key(subject))
    ) OR EXISTS (SELECT 1 FROM hg_holds(p_keys, p_channel, p_lead) AS h WHERE h.id <> p_id));
END
$$;

CREATE OR REPLACE FUNCTION hg_claim_one(
    p_id text, p_channel text, p_keys text[], p_lead text, p_owner text, p_lease_seconds float8
) RETURNS operations
LANGUAGE plpgsql AS $$
-- Claim one candidate the caller holds the row lock of, unless its recipients are held (NULL then).
DECLARE
    written operations;
    now_ timestamptz;
BEGIN
    IF NOT hg_claimable(p_id, p_channel, p_keys, p_lead) THEN  -- held: it waits
        RETURN NULL;
    END IF;
    now_ := clock_timestamp();
    UPDATE operations o SET state = 'sending', attempts = o.attempts + 1, lease_owner = p_owner,
        lease_expires_at = now_ + p_lease_seconds * interval '1 second', updated_at = now_,
        first_sent_at = COALESCE(o.first_sent_at, now_)
    WHERE o.id = p_id
    RETURNING * INTO written;
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
    VALUES (written.id, now_, 'ready', 'sending', p_owner, 'claimed; forwarding');
    RETURN written;
END
$$;

CREATE OR REPLACE FUNCTION hg_expire_leases(p_reason text) RETURNS void
LANGUAGE plpgsql AS $$
-- The leases that ran out become `unknown` (as the `expire_leases` statement), each with its event. In plpgsql, so
-- its plan is kept from call to call (a `LANGUAGE sql` function's is made again at every call).
BEGIN
    WITH picked AS MATERIALIZED (
        SELECT o.id FROM operations o WHERE o.state IN {expiring} AND o.lease_expires_at <= statement_timestamp()
        FOR UPDATE SKIP LOCKED),
    expired AS (
        UPDATE operations o SET state = 'unknown', updated_at = statement_timestamp(),
            next_check_at = statement_timestamp()
        FROM picked WHERE o.id = picked.id
        RETURNING o.id)
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
    SELECT expired.id, statement_timestamp(), 'sending', 'unknown', 'ledger', p_reason FROM expired;
END
$$;

CREATE OR REPLACE FUNCTION hg_claim_ready_for(
    p_owners text[],  -- one claim for each: the n-th operation claimed is the n-th owner's (a group commit's callers)
    p_lease_seconds float8,
    p_expired_reason text,  -- NULL: leases are not expired here
    p_batch_id text,  -- NULL: any batch
    p_hold_lead boolean
) RETURNS SETOF operations
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The candidates are walked in claim order, each checked as hg_claim_one checks it (hg_claimable), and also against
-- the ones this call chose before it: those are not `sending` yet, so no statement would see them hold it. The
-- chosen are then claimed by one statement, their events written by one more. Each way of choosing candidates is a
-- query of its own (in a batch, in any), so each keeps one plan that walks its index in claim order and reads a row
-- or two (operations_ready_by_batch, operations_ready).
DECLARE
    c record;
    wanted integer := COALESCE(cardinality(p_owners), 0);
    chosen text[] := '{}';
    chosen_keys text[] := '{}';  -- `channel key` of each recipient key of the chosen: they hold it on their channel
    chosen_leads text[] := '{}';  -- the leads of the chosen: they hold it on any channel (when leads are held)
    lead_ text;
    now_ timestamptz;
BEGIN
    IF p_expired_reason IS NOT NULL THEN
        PERFORM hg_expire_leases(p_expired_reason);
    END IF;
    IF wanted = 0 THEN
        RETURN;
    END IF;
    IF p_batch_id IS NOT NULL THEN
        FOR c IN
            SELECT o.id, o.channel, o.recipient_keys, o.lead FROM operations o
            WHERE o.state = {claimable_state} AND o.batch_id = p_batch_id
              AND (o.not_before IS NULL OR o.not_before <= statement_timestamp()) AND NOT EXISTS (
                SELECT 1 FROM unnest(o.recipient_keys) AS r (recipient), LATERAL (
                    SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (o.channel, 'all')
                    LIMIT 1) AS opted_out)
            ORDER BY o.batch_id, o.created_at, o.seq
            FOR UPDATE SKIP LOCKED
        LOOP
            lead_ := CASE WHEN p_hold_lead THEN c.lead END;
            CONTINUE WHEN ARRAY(SELECT c.channel || ' ' || k FROM unnest(c.recipient_keys) AS k) && chosen_keys
                OR COALESCE(lead_ = ANY (chosen_leads), false)
                OR NOT hg_claimable(c.id, c.channel, c.recipient_keys, lead_);
            chosen := chosen || c.id;
            chosen_keys := chosen_keys || ARRAY(SELECT c.channel || ' ' || k FROM unnest(c.recipient_keys) AS k);
            chosen_leads := chosen_leads || c.lead;
            EXIT WHEN cardinality(chosen) >= wanted;
        END LOOP;
    ELSE
        FOR c IN
            SELECT o.id, o.channel, o.recipient_keys, o.lead FROM operations o
            WHERE o.state = {claimable_state}
              AND (o.not_before IS NULL OR o.not_before <= statement_timestamp()) AND NOT EXISTS (
                SELECT 1 FROM unnest(o.recipient_keys) AS r (recipient), LATERAL (
                    SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (o.channel, 'all')
                    LIMIT 1) AS opted_out)
            ORDER BY o.created_at, o.seq
            FOR UPDATE SKIP LOCKED
        LOOP
            lead_ := CASE WHEN p_hold_lead THEN c.lead END;
            CONTINUE WHEN ARRAY(SELECT c.channel || ' ' || k FROM unnest(c.recipient_keys) AS k) && chosen_keys
                OR COALESCE(lead_ = ANY (chosen_leads), false)
                OR NOT hg_claimable(c.id, c.channel, c.recipient_keys, lead_);
            chosen := chosen || c.id;
            chosen_keys := chosen_keys || ARRAY(SELECT c.channel || ' ' || k FROM unnest(c.recipient_keys) AS k);
            chosen_leads := chosen_leads || c.lead;
            EXIT WHEN cardinality(chosen) >= wanted;
        END LOOP;
    END IF;
    IF cardinality(chosen) = 0 THEN
        RETURN;
    END IF;
    now_ := clock_timestamp();
    RETURN QUERY
    WITH picked AS (
        SELECT x.id, p_owners[x.position] AS owner, x.position FROM unnest(chosen) WITH ORDINALITY AS x (id, position)),
    claimed AS (
        UPDATE operations o SET state = 'sending', attempts = o.attempts + 1, lease_owner = picked.owner,
            lease_expires_at = now_ + p_lease_seconds * interval '1 second', updated_at = now_,
            first_sent_at = COALESCE(o.first_sent_at, now_)
        FROM picked WHERE o.id = picked.id
        RETURNING o.*),
    logged AS (
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        SELECT claimed.id, now_, 'ready', 'sending', claimed.lease_owner, 'claimed; forwarding'
        FROM claimed JOIN picked ON picked.id = claimed.id ORDER BY picked.position)
    SELECT claimed.* FROM claimed JOIN picked ON picked.id = claimed.id ORDER BY picked.position;
END
$$;

CREATE OR REPLACE FUNCTION hg_claim_ready(
    p_owner text, p_lease_seconds float8, p_limit integer,
    p_expired_reason text,  -- NULL: leases are not expired here
    p_batch_id text,  -- NULL: any batch
    p_only_id text,  -- NULL: any operation
    p_hold_lead boolean
) RETURNS SETOF operations
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- Up to `p_limit` claims for one owner (hg_claim_ready_for), or the one operation asked for.
DECLARE
    c record;
    written operations;
BEGIN
    IF p_only_id IS NULL THEN
        RETURN QUERY SELECT * FROM hg_claim_ready_for(
            array_fill(p_owner, ARRAY[GREATEST(p_limit, 0)]), p_lease_seconds, p_expired_reason, p_batch_id,
            p_hold_lead);
        RETURN;
    END IF;
    IF p_expired_reason IS NOT NULL THEN
        PERFORM hg_expire_leases(p_expired_reason);
    END IF;
    FOR c IN
        SELECT o.id, o.channel, o.recipient_keys, o.lead FROM operations o
        WHERE o.id = p_only_id AND o.state IN {claimable}
          AND (o.not_before IS NULL OR o.not_before <= statement_timestamp()) AND NOT EXISTS (
            SELECT 1 FROM unnest(o.recipient_keys) AS r (recipient), LATERAL (
                SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (o.channel, 'all')
                LIMIT 1) AS opted_out)
        FOR UPDATE SKIP LOCKED
    LOOP
        written := hg_claim_one(c.id, c.channel, c.recipient_keys, CASE WHEN p_hold_lead THEN c.lead END,
            p_owner, p_lease_seconds);
        IF written.id IS NOT NULL THEN
            RETURN NEXT written;
        END IF;
    END LOOP;
END
$$;
