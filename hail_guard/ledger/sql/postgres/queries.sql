-- The PostgreSQL ledger's statements (see hail_guard/ledger/sql.py). The clock is statement_timestamp()
-- ({now}): fixed within one statement, fresh for each. Parameters come as SQLite's do: JSON values and lists
-- as JSON text, times as Unix epoch seconds. The statements shared with SQLite (the core's) come first, in the
-- order of sql/sqlite/queries.sql; the send path's own statements follow. hg_begin_send is in begin_send.sql.

-- ---------------------------------------------------------------------------------------------------
-- Shared with SQLite: the same names, the same parameters.

-- name: now
SELECT {now}

-- name: operation_by_id
SELECT {columns} FROM operations WHERE id = :id

-- name: operation_by_id_for_update
SELECT {columns} FROM operations WHERE id = :id FOR UPDATE

-- name: operation_by_key
SELECT {columns} FROM operations WHERE idempotency_key = :idempotency_key

-- name: operation_by_provider_for_update
SELECT {columns} FROM operations WHERE provider_id = :provider_id ORDER BY created_at DESC, seq DESC LIMIT 1
FOR UPDATE

-- name: oldest_in_state
SELECT {columns} FROM operations WHERE state = :state ORDER BY created_at, seq LIMIT 1

-- name: list_operations
SELECT {columns} FROM operations
WHERE (:state::text IS NULL OR state = :state) AND (:campaign_id::text IS NULL OR campaign_id = :campaign_id)
  AND (:batch_id::text IS NULL OR batch_id = :batch_id)
  AND (:recipient::text IS NULL OR :recipient = ANY (recipient_keys))
  AND (:since::float8 IS NULL OR created_at >= to_timestamp(:since))
  AND (:before::text IS NULL
       OR (created_at, seq) < (SELECT o.created_at, o.seq FROM operations o WHERE o.id = :before))
ORDER BY created_at DESC, seq DESC LIMIT :limit

-- name: count_by_state
SELECT state, count(*) AS count FROM operations GROUP BY state

-- name: events_of
SELECT operation_id, at, from_state, to_state, actor, reason FROM events WHERE operation_id = :operation_id
ORDER BY id

-- name: record_event
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
VALUES (:operation_id, {now}, :from_state, :to_state, :actor, :reason)

-- name: insert_operation
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, lead, state, created_at, updated_at)
VALUES (:id, :idempotency_key, :tool, :channel, :recipients::jsonb,
    ARRAY(SELECT jsonb_array_elements_text(:recipient_keys::jsonb)), :request, :request_fingerprint,
    :content_fingerprint, :sender::jsonb, :campaign_id, :lead_id, :message_id, :batch_id, :lead, :state, {now}, {now})

-- name: insert_operation_recipients
-- One row per recipient key (the mailbox: `recipients.key_of`): what every rule about the same send compares.
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT o.id, r, o.content_fingerprint FROM operations o, unnest(o.recipient_keys) AS r WHERE o.id = :id

-- name: resolve_review
UPDATE operations SET state = :state, provider_id = COALESCE(:provider_id, provider_id),
    cancel_reason = COALESCE(:cancel_reason, cancel_reason), last_error = COALESCE(:last_error, last_error),
    may_have_left = :may_have_left, lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL,
    updated_at = {now}
WHERE id = :id AND state IN {reviewable}

-- name: link_resend
UPDATE operations SET resend_of = :resend_of WHERE id = :id

-- name: supersede
UPDATE operations SET state = 'cancelled', cancel_reason = :cancel_reason, resent_as = :resent_as,
    may_have_left = true, lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL, updated_at = {now}
WHERE id = :id AND state IN {reviewable}

-- name: suppressions
SELECT recipient, channel, reason, source, created_at FROM suppressions ORDER BY created_at, recipient, channel

-- name: add_suppression
INSERT INTO suppressions (recipient, channel, reason, source, created_at)
VALUES (:recipient, :channel, :reason, :source, {now})
ON CONFLICT (recipient, channel) DO UPDATE SET reason = excluded.reason, source = excluded.source

-- name: remove_suppression
DELETE FROM suppressions WHERE recipient = :recipient AND channel = :channel RETURNING recipient

-- name: opted_out_pending
SELECT id, state FROM operations
WHERE state IN {cancellable} AND (:batch_id::text IS NULL OR batch_id = :batch_id) AND EXISTS (
    SELECT 1 FROM unnest(operations.recipient_keys) AS r (recipient), LATERAL (
        SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (operations.channel, 'all')
        LIMIT 1) AS opted_out)
ORDER BY seq
FOR UPDATE

-- name: cancel_operations
UPDATE operations SET state = 'cancelled', cancel_reason = :reason, updated_at = {now}
WHERE id IN (SELECT jsonb_array_elements_text(:ids::jsonb)) AND state IN {cancellable}
RETURNING id

-- name: insert_batch
INSERT INTO batches (id, name, created_by, created_at) VALUES (:batch_id, :name, :created_by, {now})

-- name: batch_name
SELECT name FROM batches WHERE id = :batch_id

-- name: batch_counts
SELECT state, count(*) AS count FROM operations WHERE batch_id = :batch_id GROUP BY state

-- name: batch_unresolved
SELECT {columns} FROM operations WHERE batch_id = :batch_id AND state IN {unresolved}
ORDER BY created_at, seq LIMIT 100

-- name: batch_held
-- As SQLite's: the batch's `ready` sends held by an unresolved send, with what holds each (`held_by`).
SELECT * FROM (
    SELECT {o_columns}, o.seq AS position, h.id AS held_by
    FROM operations h
    JOIN operation_recipients hr ON hr.operation_id = h.id
    JOIN operation_recipients r ON r.recipient COLLATE "C" = hr.recipient
    JOIN operations o ON o.id = r.operation_id
    WHERE h.state IN {holding} AND o.batch_id = :batch_id AND o.state = {claimable_state} AND o.channel = h.channel
    UNION ALL
    SELECT {o_columns}, o.seq AS position, h.id AS held_by
    FROM operations h JOIN operations o ON o.lead = h.lead
    WHERE :hold_lead AND h.state IN {holding} AND o.batch_id = :batch_id AND o.state = {claimable_state}
      AND o.id <> h.id) AS held
ORDER BY created_at, position LIMIT 100

-- name: list_batches
SELECT b.id AS batch_id, b.name, b.created_at, o.state, count(o.id) AS count
FROM (SELECT id, name, created_at FROM batches
      WHERE :after::text IS NULL OR (created_at, id) < (SELECT created_at, id FROM batches WHERE id = :after)
      ORDER BY created_at DESC, id DESC LIMIT :limit) AS b
LEFT JOIN operations AS o ON o.batch_id = b.id
GROUP BY b.id, b.name, b.created_at, o.state ORDER BY b.created_at DESC, b.id DESC

-- name: approve_batch
UPDATE operations SET state = 'ready', updated_at = {now} WHERE batch_id = :batch_id AND state IN {approvable}
RETURNING id

-- name: delivery_events_of
SELECT operation_id, state, occurred_at, recorded_at, source, detail FROM delivery_events
WHERE operation_id = :operation_id ORDER BY id

-- name: record_delivery_event
INSERT INTO delivery_events (operation_id, state, occurred_at, recorded_at, source, detail)
VALUES (:operation_id, :state, to_timestamp(:occurred_at::float8), {now}, :source, :detail)
ON CONFLICT (operation_id, state) DO NOTHING

-- name: set_delivery_state
UPDATE operations SET delivery_state = :delivery_state,
    delivery_at = COALESCE(to_timestamp(:delivery_at::float8), {now}), updated_at = {now}
WHERE id = :id

-- name: count_delivery_check
UPDATE operations SET delivery_checks = delivery_checks + 1,
    delivery_next_check_at = {now} + :next_check_seconds::float8 * interval '1 second'
WHERE id = :id

-- name: signature_seen
SELECT 1 FROM webhook_deliveries WHERE signature = :signature

-- name: claim_webhook
INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, outcome, received_at, payload,
    delivery_state, occurred_at)
VALUES (:delivery_id, :signature, :event_type, :provider_id, 'pending', {now}, :payload, :delivery_state,
    to_timestamp(:occurred_at::float8))
ON CONFLICT DO NOTHING
RETURNING delivery_id

-- name: settle_webhook
UPDATE webhook_deliveries SET outcome = :outcome, operation_id = :operation_id WHERE delivery_id = :delivery_id

-- name: lock_provider
-- Held to the end of the transaction by a webhook for a message id (before it looks for the operation) and by
-- whatever records that id (before it looks for webhooks kept for it): one of them always sees the other's commit.
-- Lock space "HGPW"; the second key is the id's hash.
SELECT pg_advisory_xact_lock(1212633175, hashtext(:provider_id))

-- name: parked_count
SELECT count(*) AS count FROM webhook_deliveries
WHERE outcome = 'parked' AND received_at >= {now} - :within_seconds::float8 * interval '1 second'

-- name: parked_webhooks
SELECT delivery_id, delivery_state, occurred_at FROM webhook_deliveries
WHERE provider_id = :provider_id AND outcome = 'parked'
  AND received_at >= {now} - :within_seconds::float8 * interval '1 second'
ORDER BY received_at, delivery_id

-- name: prune_cutoff
SELECT {now} - :older_than_seconds::float8 * interval '1 second' AS cutoff

-- name: prune_events
DELETE FROM events WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < :cutoff AND created_at < :cutoff)

-- name: prune_delivery_events
DELETE FROM delivery_events WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < :cutoff AND created_at < :cutoff)

-- name: prune_recipients
DELETE FROM operation_recipients WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < :cutoff AND created_at < :cutoff)

-- name: prune_operations
DELETE FROM operations WHERE state IN {terminal} AND updated_at < :cutoff AND created_at < :cutoff

-- name: prune_send_counts
-- The hours' counts that fell to 0 (their sends were pruned, or all moved to other states).
DELETE FROM sends_by_hour WHERE count = 0

-- name: prune_webhooks
DELETE FROM webhook_deliveries WHERE received_at < {now} - :older_than_seconds::float8 * interval '1 second'

-- name: observe_tool
INSERT INTO upstream_tools (name, fingerprint, accepted_fingerprint, first_seen_at)
VALUES (:name, :fingerprint, :fingerprint, {now})
ON CONFLICT (name) DO UPDATE SET
    changed_at = CASE WHEN excluded.fingerprint = upstream_tools.fingerprint THEN upstream_tools.changed_at
                      ELSE {now} END,
    fingerprint = excluded.fingerprint

-- name: tool_pins
SELECT name, fingerprint, accepted_fingerprint, first_seen_at, changed_at FROM upstream_tools
ORDER BY name COLLATE "C"

-- name: accept_tools
UPDATE upstream_tools SET accepted_fingerprint = fingerprint, changed_at = NULL
WHERE fingerprint <> accepted_fingerprint
  AND (:names::jsonb IS NULL OR name IN (SELECT jsonb_array_elements_text(:names::jsonb)))
RETURNING name

-- name: opted_out
-- One probe of the opt-out list's key per recipient: the LIMIT keeps PostgreSQL from planning it as a join,
-- which it did as a scan of the whole list.
SELECT 1 FROM unnest(ARRAY(SELECT jsonb_array_elements_text(:keys::jsonb))) AS r (recipient), LATERAL (
    SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (:channel, 'all') LIMIT 1)
    AS opted_out
LIMIT 1

-- name: matches
-- As SQLite's: the same message to one of its recipient keys, under another key, of the same tool, whose senders
-- agree, in a state that blocks it: one of :always at any age, or one of :windowed (or closed by an operator after
-- it may have left, when :closed_block) first sent within :window_seconds.
SELECT {o_columns} FROM operations o
WHERE o.id IN (
    SELECT r.operation_id FROM operation_recipients r
    WHERE r.content_fingerprint = :content_fingerprint
      AND r.recipient IN (SELECT jsonb_array_elements_text(:recipient_keys::jsonb)))
  AND o.idempotency_key <> :idempotency_key AND o.tool = :tool
  AND (o.state IN (SELECT jsonb_array_elements_text(:always::jsonb))
       OR ((o.state IN (SELECT jsonb_array_elements_text(:windowed::jsonb)) OR (:closed_block AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - :window_seconds::float8 * interval '1 second'))
  AND NOT EXISTS (
    SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each(:sender::jsonb) b ON a.key = b.key WHERE a.value <> b.value)
ORDER BY o.created_at DESC, o.seq DESC
LIMIT 20

-- name: holds
-- As SQLite's: unresolved sends to one of these recipient keys on the channel, or to the lead.
SELECT * FROM hg_holds(ARRAY(SELECT jsonb_array_elements_text(:recipient_keys::jsonb)), :channel, :lead::text)

-- ---------------------------------------------------------------------------------------------------
-- Planning a batch, in one transaction: the sends are staged (COPY) into a temporary table dropped at its end.

-- name: create_stage
CREATE TEMPORARY TABLE hg_plan_stage (
    position INTEGER NOT NULL, id TEXT NOT NULL, idempotency_key TEXT NOT NULL, tool TEXT NOT NULL,
    channel TEXT NOT NULL, recipients JSONB NOT NULL, recipient_keys JSONB NOT NULL, request TEXT NOT NULL,
    request_fingerprint TEXT NOT NULL, content_fingerprint TEXT NOT NULL, sender JSONB NOT NULL, campaign_id TEXT,
    lead_id TEXT, message_id TEXT, lead TEXT, allow_duplicate BOOLEAN NOT NULL
) ON COMMIT DROP

-- name: staged_known_keys
SELECT p.position, p.idempotency_key, o.id, count(*) OVER () AS taken
FROM hg_plan_stage p JOIN operations o ON o.idempotency_key = p.idempotency_key
ORDER BY p.position LIMIT 10

-- name: staged_repeat
SELECT p.position FROM hg_plan_stage p
CROSS JOIN LATERAL jsonb_array_elements_text(p.recipient_keys) AS pr (recipient)
JOIN operation_recipients r ON r.content_fingerprint = p.content_fingerprint AND r.recipient = pr.recipient
JOIN operations o ON o.id = r.operation_id
WHERE p.allow_duplicate = :allow_duplicate AND o.idempotency_key <> p.idempotency_key AND o.tool = p.tool
  AND (o.state IN (SELECT jsonb_array_elements_text(:always::jsonb))
       OR ((o.state IN (SELECT jsonb_array_elements_text(:windowed::jsonb)) OR (:closed_block AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - :window_seconds::float8 * interval '1 second'))
  AND NOT EXISTS (
    SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each(p.sender) b ON a.key = b.key WHERE a.value <> b.value)
ORDER BY p.position
LIMIT 1

-- name: staged_near
-- As SQLite's: staged sends (positions :first to :last) and the other messages their recipients have that count as
-- sent.
SELECT p.position, p.tool AS staged_tool, {o_columns}
FROM hg_plan_stage p
CROSS JOIN LATERAL jsonb_array_elements_text(p.recipient_keys) AS pr (recipient)
JOIN operation_recipients r ON r.recipient COLLATE "C" = pr.recipient
JOIN operations o ON o.id = r.operation_id
WHERE p.position BETWEEN :first AND :last AND NOT p.allow_duplicate AND o.channel = p.channel
  AND o.content_fingerprint <> p.content_fingerprint AND o.idempotency_key <> p.idempotency_key
  AND (o.state IN {waiting}
       OR ((o.state IN {settled_live} OR o.may_have_left)
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - :window_seconds::float8 * interval '1 second'))
ORDER BY p.position, o.created_at DESC

-- name: staged_intent
SELECT idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint,
    sender::text AS sender, campaign_id, lead_id, message_id, lead, allow_duplicate
FROM hg_plan_stage WHERE position = :position

-- name: plan_staged
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, lead, batch_id, state, created_at, updated_at)
SELECT id, idempotency_key, tool, channel, recipients, ARRAY(SELECT jsonb_array_elements_text(recipient_keys)),
    request, request_fingerprint, content_fingerprint, sender, campaign_id, lead_id, message_id, lead, :batch_id,
    :state, {now}, {now}
FROM hg_plan_stage ORDER BY position

-- name: plan_staged_recipients
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT p.id, r, p.content_fingerprint FROM hg_plan_stage p, jsonb_array_elements_text(p.recipient_keys) AS r

-- name: plan_staged_events
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
SELECT p.id, {now}, NULL, :state, :actor, :reason FROM hg_plan_stage p JOIN operations o ON o.id = p.id ORDER BY o.seq

-- name: lock_recipients
-- The advisory locks of these recipient keys (and leads), sorted (see hg_begin_send): the sends to them wait for
-- this plan's transaction.
SELECT pg_advisory_xact_lock(hg_lock_key(subject)) FROM unnest(:subjects::text[]) AS subject
ORDER BY hg_lock_key(subject)

-- ---------------------------------------------------------------------------------------------------
-- The send path (hail_guard/ledger/postgres.py): each write one statement, committed on its own.

-- name: begin_send
-- Everything `begin_send` does, in one round trip (two when near messages are compared): see begin_send.sql.
SELECT b.verdict, (b.operation).*
FROM hg_begin_send(:id, :idempotency_key, :tool, :channel, :recipients::jsonb,
    ARRAY(SELECT jsonb_array_elements_text(:recipient_keys::jsonb)), :request, :request_fingerprint,
    :content_fingerprint, :sender::jsonb, :campaign_id, :lead_id, :message_id, :batch_id, :lead, :owner,
    :lease_seconds, :legacy_key, ARRAY(SELECT jsonb_array_elements_text(:always::jsonb)),
    ARRAY(SELECT jsonb_array_elements_text(:windowed::jsonb)), :closed_block, :window_seconds, :hold_lead,
    :compares_near, :compared::text[], :expired_reason) b

-- name: expire_leases
-- The rows are picked once, locked, and updated by id (as `id IN (subquery)`, PostgreSQL could run the subquery
-- again for every `sending` row); the partial index on `sending` leases makes it one short probe when none is due.
WITH expiring AS MATERIALIZED (
    SELECT id FROM operations WHERE state IN {expiring} AND lease_expires_at <= {now} FOR UPDATE SKIP LOCKED),
expired AS (
    UPDATE operations SET state = 'unknown', updated_at = {now}, next_check_at = {now}
    FROM expiring WHERE operations.id = expiring.id
    RETURNING operations.id),
logged AS (
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
    SELECT id, {now}, 'sending', 'unknown', 'ledger', :expired_reason FROM expired)
SELECT count(*) AS expired FROM expired

-- name: claim_ready_by_id
-- :hold_lead: whether a lead's unresolved send holds it (see claims.sql).
SELECT {columns} FROM hg_claim_ready(:owner, :lease_seconds::float8, 1, NULL, NULL, :id, :hold_lead)

-- name: claim_ready_any
-- Expire the leases that ran out (with :expired_reason), and claim the oldest `ready` operations whose recipients did
-- not opt out and are not held: see claims.sql.
SELECT {columns} FROM hg_claim_ready(:owner, :lease_seconds::float8, :limit, :expired_reason, NULL, NULL, :hold_lead)

-- name: claim_ready_in_batch
-- As claim_ready_any, in one batch.
SELECT {columns}
FROM hg_claim_ready(:owner, :lease_seconds::float8, :limit, :expired_reason, :batch_id, NULL, :hold_lead)

-- name: record_outcomes
-- The outcomes of one or many sends, in one round trip: see outcomes.sql. Each of record_outcome's parameters is an
-- array (an element for each outcome); :parked_seconds is how long a webhook stays parked, :refuse_parked whether
-- one parked raises HG001.
SELECT r.given_id, r.before_state, (r.operation).*, r.parked
FROM hg_record_outcomes(:state::text[], :provider_id::text[], :result::text[], :error::text[],
    :review_reason::text[], :attempts_back::integer[], :not_before_seconds::float8[], :check_after_seconds::float8[],
    :id::text[], :owner::text[], :actor::text[], :reason::text[], :taken::text[], :parked_seconds::float8,
    :refuse_parked::boolean) AS r

-- name: claim_ready_for
-- Claims for several owners at once (the group commit): the n-th operation claimed is the n-th owner's, see
-- claims.sql. :batch_id NULL for any batch.
SELECT {columns}
FROM hg_claim_ready_for(:owners::text[], :lease_seconds::float8, :expired_reason, :batch_id, :hold_lead)

-- name: claim_unknown_due
WITH picked AS MATERIALIZED (
    SELECT id FROM operations
    WHERE state = 'unknown' AND (:batch_id::text IS NULL OR batch_id = :batch_id)
      AND (next_check_at IS NULL OR next_check_at <= {now})
      AND (lease_expires_at IS NULL OR lease_expires_at <= {now})
    ORDER BY next_check_at NULLS FIRST, seq LIMIT :limit
    FOR UPDATE SKIP LOCKED),
claimed AS (
    UPDATE operations SET attempts = attempts + 1, lease_owner = :owner,
        lease_expires_at = {now} + :lease_seconds::float8 * interval '1 second', updated_at = {now}
    FROM picked WHERE operations.id = picked.id
    RETURNING operations.*)
SELECT {columns} FROM claimed ORDER BY next_check_at NULLS FIRST, seq

-- name: claim_unknown_by_id
UPDATE operations SET attempts = attempts + 1, lease_owner = :owner,
    lease_expires_at = {now} + :lease_seconds::float8 * interval '1 second', updated_at = {now}
WHERE id = :id AND state = 'unknown' AND (:batch_id::text IS NULL OR batch_id = :batch_id)
  AND (lease_expires_at IS NULL OR lease_expires_at <= {now})
RETURNING {columns}

-- name: claim_delivery_checks
WITH picked AS MATERIALIZED (
    SELECT id FROM operations
    WHERE state = 'accepted' AND provider_id IS NOT NULL
      AND channel IN (SELECT jsonb_array_elements_text(:channels::jsonb))
      AND (delivery_state IS NULL OR delivery_state NOT IN (SELECT jsonb_array_elements_text(:settled::jsonb)))
      AND (delivery_next_check_at IS NULL OR delivery_next_check_at <= {now})
      AND COALESCE(first_sent_at, created_at) >= {now} - :max_age_seconds::float8 * interval '1 second'
    ORDER BY delivery_next_check_at NULLS FIRST, created_at, seq LIMIT :limit
    FOR UPDATE SKIP LOCKED),
claimed AS (
    UPDATE operations SET delivery_next_check_at = {now} + :hold_seconds::float8 * interval '1 second'
    FROM picked WHERE operations.id = picked.id
    RETURNING operations.*)
SELECT {columns} FROM claimed ORDER BY created_at, seq

-- ---------------------------------------------------------------------------------------------------
-- The operator console's reads (hail_guard.console), as SQLite's: each walks an index (schema 9). Key and
-- recipient ranges compare in byte order (COLLATE "C", as their indexes), whatever the database's collation.

-- name: sends_by_hour
-- Each count is the sum of its shards (see migration 9).
SELECT hour, state, delivery_state, sum(count) AS count FROM sends_by_hour WHERE hour >= to_timestamp(:since)
GROUP BY hour, state, delivery_state HAVING sum(count) <> 0 ORDER BY hour

-- name: count_in_state
SELECT count(*) AS count FROM operations WHERE state = :state

-- name: search_anchor
SELECT extract(epoch FROM created_at) AS created_at, seq AS position, idempotency_key FROM operations WHERE id = :id

-- name: search_by_key
SELECT {columns} FROM operations
WHERE idempotency_key COLLATE "C" >= :key_low::text AND idempotency_key COLLATE "C" < :key_high::text
  AND (:recipient::text IS NULL
       OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = :recipient::text))
  AND (:batch_id::text IS NULL OR batch_id = :batch_id::text)
  AND (:campaign_id::text IS NULL OR campaign_id = :campaign_id::text)
  AND (:state::text IS NULL OR state = :state::text)
  AND (:since::float8 IS NULL OR created_at >= to_timestamp(:since))
  AND idempotency_key COLLATE "C" > :after_key::text
  AND :after_created_at::float8 IS NOT NULL AND :after_position::bigint IS NOT NULL
ORDER BY idempotency_key COLLATE "C" LIMIT :limit

-- name: search_by_recipient
SELECT {columns} FROM operations
WHERE (:key_low::text IS NULL
       OR (idempotency_key COLLATE "C" >= :key_low::text AND idempotency_key COLLATE "C" < :key_high::text))
  AND id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = :recipient::text)
  AND (:batch_id::text IS NULL OR batch_id = :batch_id::text)
  AND (:campaign_id::text IS NULL OR campaign_id = :campaign_id::text)
  AND (:state::text IS NULL OR state = :state::text)
  AND (:since::float8 IS NULL OR created_at >= to_timestamp(:since))
  AND (created_at, seq) < (to_timestamp(:after_created_at::float8), :after_position::bigint)
  AND :after_key::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT :limit

-- name: search_by_batch
SELECT {columns} FROM operations
WHERE (:key_low::text IS NULL
       OR (idempotency_key COLLATE "C" >= :key_low::text AND idempotency_key COLLATE "C" < :key_high::text))
  AND (:recipient::text IS NULL
       OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = :recipient::text))
  AND batch_id = :batch_id::text
  AND (:campaign_id::text IS NULL OR campaign_id = :campaign_id::text)
  AND (:state::text IS NULL OR state = :state::text)
  AND (:since::float8 IS NULL OR created_at >= to_timestamp(:since))
  AND (created_at, seq) < (to_timestamp(:after_created_at::float8), :after_position::bigint)
  AND :after_key::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT :limit

-- name: search_by_campaign
SELECT {columns} FROM operations
WHERE (:key_low::text IS NULL
       OR (idempotency_key COLLATE "C" >= :key_low::text AND idempotency_key COLLATE "C" < :key_high::text))
  AND (:recipient::text IS NULL
       OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = :recipient::text))
  AND (:batch_id::text IS NULL OR batch_id = :batch_id::text)
  AND campaign_id = :campaign_id::text
  AND (:state::text IS NULL OR state = :state::text)
  AND (:since::float8 IS NULL OR created_at >= to_timestamp(:since))
  AND (created_at, seq) < (to_timestamp(:after_created_at::float8), :after_position::bigint)
  AND :after_key::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT :limit

-- name: search_by_state
SELECT {columns} FROM operations
WHERE (:key_low::text IS NULL
       OR (idempotency_key COLLATE "C" >= :key_low::text AND idempotency_key COLLATE "C" < :key_high::text))
  AND (:recipient::text IS NULL
       OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = :recipient::text))
  AND (:batch_id::text IS NULL OR batch_id = :batch_id::text)
  AND (:campaign_id::text IS NULL OR campaign_id = :campaign_id::text)
  AND state = :state::text
  AND (:since::float8 IS NULL OR created_at >= to_timestamp(:since))
  AND (created_at, seq) < (to_timestamp(:after_created_at::float8), :after_position::bigint)
  AND :after_key::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT :limit

-- name: search_all
SELECT {columns} FROM operations
WHERE (:key_low::text IS NULL
       OR (idempotency_key COLLATE "C" >= :key_low::text AND idempotency_key COLLATE "C" < :key_high::text))
  AND (:recipient::text IS NULL
       OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = :recipient::text))
  AND (:batch_id::text IS NULL OR batch_id = :batch_id::text)
  AND (:campaign_id::text IS NULL OR campaign_id = :campaign_id::text)
  AND (:state::text IS NULL OR state = :state::text)
  AND (:since::float8 IS NULL OR created_at >= to_timestamp(:since))
  AND (created_at, seq) < (to_timestamp(:after_created_at::float8), :after_position::bigint)
  AND :after_key::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT :limit

-- name: unsent_in_batch
SELECT id, state FROM operations WHERE batch_id = :batch_id AND state IN {cancellable} ORDER BY created_at, seq
FOR UPDATE

-- name: search_suppressions
SELECT recipient, channel, reason, source, created_at FROM suppressions
WHERE recipient COLLATE "C" >= :low::text AND recipient COLLATE "C" < :high::text
  AND (recipient COLLATE "C", channel COLLATE "C") > (:after_recipient::text, :after_channel::text)
ORDER BY recipient COLLATE "C", channel COLLATE "C" LIMIT :limit

-- name: opt_out_cancelled
SELECT {columns} FROM operations
WHERE id IN (
    SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = :recipient::text
    UNION
    SELECT operation_id FROM operation_recipients
    WHERE recipient COLLATE "C" >= :sub_low::text AND recipient COLLATE "C" < :sub_high::text
      AND recipient LIKE :sub_like::text)
  AND state = 'cancelled' AND NOT may_have_left AND cancel_reason LIKE :cancel_like
  AND (:channel::text = 'all' OR channel = :channel::text)
ORDER BY updated_at DESC LIMIT :limit

-- name: remember_tool_definition
INSERT INTO upstream_tool_definitions (fingerprint, definition) VALUES (:fingerprint, :definition)
ON CONFLICT DO NOTHING

-- name: start_session
INSERT INTO console_sessions (digest, name, created_at, expires_at)
VALUES (:digest, :name, {now}, {now} + :seconds::float8 * interval '1 second')

-- name: forget_sessions
DELETE FROM console_sessions WHERE expires_at <= {now}

-- name: find_session
SELECT name, created_at, expires_at FROM console_sessions WHERE digest = :digest AND expires_at > {now}

-- name: end_session
DELETE FROM console_sessions WHERE digest = :digest

-- name: record_heartbeat
INSERT INTO heartbeats (id, who, role, batch_id, started_at, seen_at)
VALUES (:id, :who, :role, :batch_id, {now}, {now})
ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at

-- name: forget_heartbeats
DELETE FROM heartbeats WHERE seen_at < {now} - :silent_seconds::float8 * interval '1 second'

-- name: end_heartbeat
DELETE FROM heartbeats WHERE id = :id

-- name: heartbeats
SELECT id, who, role, batch_id, started_at, seen_at FROM heartbeats ORDER BY started_at, id

-- name: tool_definitions
SELECT fingerprint, definition FROM upstream_tool_definitions
WHERE fingerprint IN (SELECT jsonb_array_elements_text(:fingerprints::jsonb))

-- ---------------------------------------------------------------------------------------------------
-- Migrating (hail_guard/ledger/postgres.py `migrate`), in one transaction under an advisory lock.

-- name: lock_migrations
SELECT pg_advisory_xact_lock(:lock)

-- name: record_version
INSERT INTO hail_guard_schema_version (version) VALUES (:version)

-- name: record_function
INSERT INTO hail_guard_functions (name, checksum) VALUES (:name, :checksum)
ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum

-- The migrations' backfills (hail_guard/ledger/backfill.py), in the transaction of the migration that needs them
-- (versions 8 and 11), on the tables as that version left them.

-- name: backfill_facts_rows
SELECT id, tool, channel, request FROM operations ORDER BY seq

-- name: backfill_facts
UPDATE operations SET recipients = :recipients::jsonb,
    recipient_keys = ARRAY(SELECT jsonb_array_elements_text(:recipient_keys::jsonb)),
    content_fingerprint = :content_fingerprint, sender = :sender::jsonb
WHERE id = :id

-- name: backfill_keys_rows
SELECT id, channel, recipients, request, content_fingerprint FROM operations ORDER BY seq

-- name: backfill_keys
UPDATE operations SET recipients = :recipients::jsonb,
    recipient_keys = ARRAY(SELECT jsonb_array_elements_text(:recipient_keys::jsonb)), lead = :lead
WHERE id = :id

-- name: backfill_recipient
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
VALUES (:operation_id, :recipient, :content_fingerprint)

-- name: backfill_opt_outs
SELECT recipient, channel FROM suppressions ORDER BY created_at

-- name: backfill_opt_out_key
-- Nothing when another opt-out already reads :key on its channel: that one is kept, and this one dropped next.
UPDATE suppressions SET recipient = :key WHERE recipient = :recipient AND channel = :channel
  AND NOT EXISTS (SELECT 1 FROM suppressions WHERE recipient = :key AND channel = :channel)

-- name: backfill_drop_opt_out
DELETE FROM suppressions WHERE recipient = :recipient AND channel = :channel
