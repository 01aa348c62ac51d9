-- The PostgreSQL ledger's statements (see hail_guard/ledger/sql.py). The clock is statement_timestamp()
-- ({now}): fixed within one statement, fresh for each. Parameters come as SQLite's do: JSON values and lists
-- as JSON text, times as Unix epoch seconds. The statements shared with SQLite (the core's) come first, in the
-- order of sql/sqlite/queries.sql; the send path's own statements follow. hg_begin_send is in begin_send.sql.

-- ---------------------------------------------------------------------------------------------------
-- Shared with SQLite: the same names, the same parameters in the same order.

-- name: now
SELECT {now}

-- name: operation_by_id
SELECT {columns} FROM operations WHERE id = $1

-- name: operation_by_id_for_update
SELECT {columns} FROM operations WHERE id = $1 FOR UPDATE

-- name: operation_by_key
SELECT {columns} FROM operations WHERE idempotency_key = $1

-- name: operation_by_provider_for_update
SELECT {columns} FROM operations WHERE provider_id = $1 ORDER BY created_at DESC, seq DESC LIMIT 1 FOR UPDATE

-- name: oldest_in_state
SELECT {columns} FROM operations WHERE state = $1 ORDER BY created_at, seq LIMIT 1

-- name: list_operations
SELECT {columns} FROM operations
WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR campaign_id = $2) AND ($3::text IS NULL OR batch_id = $3)
  AND ($4::text IS NULL OR $4 = ANY (recipient_keys))
  AND ($5::float8 IS NULL OR created_at >= to_timestamp($5))
  AND ($6::text IS NULL OR (created_at, seq) < (SELECT o.created_at, o.seq FROM operations o WHERE o.id = $6))
ORDER BY created_at DESC, seq DESC LIMIT $7

-- name: count_by_state
SELECT state, count(*) AS count FROM operations GROUP BY state

-- name: events_of
SELECT operation_id, at, from_state, to_state, actor, reason FROM events WHERE operation_id = $1 ORDER BY id

-- name: record_event
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason) VALUES ($1, {now}, $2, $3, $4, $5)

-- name: insert_operation
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, lead, state, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5::jsonb, ARRAY(SELECT jsonb_array_elements_text($6::jsonb)), $7, $8, $9, $10::jsonb, $11,
    $12, $13, $14, $15, $16, {now}, {now})

-- name: insert_operation_recipients
-- One row per recipient key (the mailbox: `recipients.key_of`): what every rule about the same send compares.
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT o.id, r, o.content_fingerprint FROM operations o, unnest(o.recipient_keys) AS r WHERE o.id = $1

-- name: resolve_review
UPDATE operations SET state = $1, provider_id = COALESCE($2, provider_id), cancel_reason = COALESCE($3, cancel_reason),
    last_error = COALESCE($4, last_error), may_have_left = $6, lease_owner = NULL, lease_expires_at = NULL,
    next_check_at = NULL, updated_at = {now}
WHERE id = $5 AND state IN {reviewable}

-- name: link_resend
UPDATE operations SET resend_of = $2 WHERE id = $1

-- name: supersede
UPDATE operations SET state = 'cancelled', cancel_reason = $1, resent_as = $2, may_have_left = true,
    lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL, updated_at = {now}
WHERE id = $3 AND state IN {reviewable}

-- name: suppressions
SELECT recipient, channel, reason, source, created_at FROM suppressions ORDER BY created_at, recipient, channel

-- name: add_suppression
INSERT INTO suppressions (recipient, channel, reason, source, created_at) VALUES ($1, $2, $3, $4, {now})
ON CONFLICT (recipient, channel) DO UPDATE SET reason = excluded.reason, source = excluded.source

-- name: remove_suppression
DELETE FROM suppressions WHERE recipient = $1 AND channel = $2 RETURNING recipient

-- name: opted_out_pending
SELECT id, state FROM operations
WHERE state IN {cancellable} AND ($1::text IS NULL OR batch_id = $1) AND EXISTS (
    SELECT 1 FROM unnest(operations.recipient_keys) AS r (recipient), LATERAL (
        SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN (operations.channel, 'all')
        LIMIT 1) AS opted_out)
ORDER BY seq
FOR UPDATE

-- name: cancel_operations
UPDATE operations SET state = 'cancelled', cancel_reason = $2, updated_at = {now}
WHERE id IN (SELECT jsonb_array_elements_text($1::jsonb)) AND state IN {cancellable}
RETURNING id

-- name: insert_batch
INSERT INTO batches (id, name, created_by, created_at) VALUES ($1, $2, $3, {now})

-- name: batch_name
SELECT name FROM batches WHERE id = $1

-- name: batch_counts
SELECT state, count(*) AS count FROM operations WHERE batch_id = $1 GROUP BY state

-- name: batch_unresolved
SELECT {columns} FROM operations WHERE batch_id = $1 AND state IN {unresolved} ORDER BY created_at, seq LIMIT 100

-- name: batch_held
-- As SQLite's: the batch's `ready` sends held by an unresolved send, with what holds each (`held_by`).
SELECT * FROM (
    SELECT {o_columns}, o.seq AS position, h.id AS held_by
    FROM operations h
    JOIN operation_recipients hr ON hr.operation_id = h.id
    JOIN operation_recipients r ON r.recipient COLLATE "C" = hr.recipient
    JOIN operations o ON o.id = r.operation_id
    WHERE h.state IN {holding} AND o.batch_id = $1 AND o.state = {claimable_state} AND o.channel = h.channel
    UNION ALL
    SELECT {o_columns}, o.seq AS position, h.id AS held_by
    FROM operations h JOIN operations o ON o.lead = h.lead
    WHERE $2 AND h.state IN {holding} AND o.batch_id = $1 AND o.state = {claimable_state} AND o.id <> h.id) AS held
ORDER BY created_at, position LIMIT 100

-- name: list_batches
SELECT b.id AS batch_id, b.name, b.created_at, o.state, count(o.id) AS count
FROM (SELECT id, name, created_at FROM batches
      WHERE $2::text IS NULL OR (created_at, id) < (SELECT created_at, id FROM batches WHERE id = $2)
      ORDER BY created_at DESC, id DESC LIMIT $1) AS b
LEFT JOIN operations AS o ON o.batch_id = b.id
GROUP BY b.id, b.name, b.created_at, o.state ORDER BY b.created_at DESC, b.id DESC

-- name: approve_batch
UPDATE operations SET state = 'ready', updated_at = {now} WHERE batch_id = $1 AND state IN {approvable} RETURNING id

-- name: delivery_events_of
SELECT operation_id, state, occurred_at, recorded_at, source, detail FROM delivery_events
WHERE operation_id = $1 ORDER BY id

-- name: record_delivery_event
INSERT INTO delivery_events (operation_id, state, occurred_at, recorded_at, source, detail)
VALUES ($1, $2, to_timestamp($3::float8), {now}, $4, $5) ON CONFLICT (operation_id, state) DO NOTHING

-- name: set_delivery_state
UPDATE operations SET delivery_state = $1, delivery_at = COALESCE(to_timestamp($2::float8), {now}), updated_at = {now}
WHERE id = $3

-- name: count_delivery_check
UPDATE operations SET delivery_checks = delivery_checks + 1,
    delivery_next_check_at = {now} + $1::float8 * interval '1 second'
WHERE id = $2

-- name: signature_seen
SELECT 1 FROM webhook_deliveries WHERE signature = $1

-- name: claim_webhook
INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, outcome, received_at, payload,
    delivery_state, occurred_at)
VALUES ($1, $2, $3, $4, 'pending', {now}, $5, $6, to_timestamp($7::float8)) ON CONFLICT DO NOTHING
RETURNING delivery_id

-- name: settle_webhook
UPDATE webhook_deliveries SET outcome = $1, operation_id = $2 WHERE delivery_id = $3

-- name: lock_provider
-- Held to the end of the transaction by a webhook for message id $1 (before it looks for the operation) and by
-- whatever records that id (before it looks for webhooks kept for it): one of them always sees the other's commit.
-- Lock space "HGPW"; the second key is the id's hash.
SELECT pg_advisory_xact_lock(1212633175, hashtext($1))

-- name: parked_count
SELECT count(*) AS count FROM webhook_deliveries
WHERE outcome = 'parked' AND received_at >= {now} - $1::float8 * interval '1 second'

-- name: parked_webhooks
SELECT delivery_id, delivery_state, occurred_at FROM webhook_deliveries
WHERE provider_id = $1 AND outcome = 'parked' AND received_at >= {now} - $2::float8 * interval '1 second'
ORDER BY received_at, delivery_id

-- name: prune_cutoff
SELECT {now} - $1::float8 * interval '1 second' AS cutoff

-- name: prune_events
DELETE FROM events WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < $1 AND created_at < $1)

-- name: prune_delivery_events
DELETE FROM delivery_events WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < $1 AND created_at < $1)

-- name: prune_recipients
DELETE FROM operation_recipients WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < $1 AND created_at < $1)

-- name: prune_operations
DELETE FROM operations WHERE state IN {terminal} AND updated_at < $1 AND created_at < $1

-- name: prune_send_counts
-- The hours' counts that fell to 0 (their sends were pruned, or all moved to other states).
DELETE FROM sends_by_hour WHERE count = 0

-- name: prune_webhooks
DELETE FROM webhook_deliveries WHERE received_at < {now} - $1::float8 * interval '1 second'

-- name: observe_tool
INSERT INTO upstream_tools (name, fingerprint, accepted_fingerprint, first_seen_at) VALUES ($1, $2, $2, {now})
ON CONFLICT (name) DO UPDATE SET
    changed_at = CASE WHEN excluded.fingerprint = upstream_tools.fingerprint THEN upstream_tools.changed_at
                      ELSE {now} END,
    fingerprint = excluded.fingerprint

-- name: tool_pins
SELECT name, fingerprint, accepted_fingerprint, first_seen_at, changed_at FROM upstream_tools ORDER BY name COLLATE "C"

-- name: accept_tools
UPDATE upstream_tools SET accepted_fingerprint = fingerprint, changed_at = NULL
WHERE fingerprint <> accepted_fingerprint
  AND ($1::jsonb IS NULL OR name IN (SELECT jsonb_array_elements_text($1::jsonb)))
RETURNING name

-- name: opted_out
-- One probe of the opt-out list's key per recipient: the LIMIT keeps PostgreSQL from planning it as a join,
-- which it did as a scan of the whole list.
SELECT 1 FROM unnest(ARRAY(SELECT jsonb_array_elements_text($1::jsonb))) AS r (recipient), LATERAL (
    SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN ($2, 'all') LIMIT 1) AS opted_out
LIMIT 1

-- name: matches
-- As SQLite's: the same message ($1) to one of its recipient keys ($2), under another key ($3), of the same tool
-- ($4), whose senders agree with $9, in a state that blocks it: one of $5 at any age, or one of $6 (or closed by an
-- operator after it may have left, when $7) first sent within $8 seconds.
SELECT {o_columns} FROM operations o
WHERE o.id IN (
    SELECT r.operation_id FROM operation_recipients r
    WHERE r.content_fingerprint = $1 AND r.recipient IN (SELECT jsonb_array_elements_text($2::jsonb)))
  AND o.idempotency_key <> $3 AND o.tool = $4
  AND (o.state IN (SELECT jsonb_array_elements_text($5::jsonb))
       OR ((o.state IN (SELECT jsonb_array_elements_text($6::jsonb)) OR ($7 AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - $8::float8 * interval '1 second'))
  AND NOT EXISTS (
    SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each($9::jsonb) b ON a.key = b.key WHERE a.value <> b.value)
ORDER BY o.created_at DESC, o.seq DESC
LIMIT 20

-- name: holds
-- As SQLite's: unresolved sends to one of these recipient keys ($1) on channel $2, or to the lead $3.
SELECT * FROM hg_holds(ARRAY(SELECT jsonb_array_elements_text($1::jsonb)), $2, $3::text)

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
WHERE p.allow_duplicate = $2 AND o.idempotency_key <> p.idempotency_key AND o.tool = p.tool
  AND (o.state IN (SELECT jsonb_array_elements_text($3::jsonb))
       OR ((o.state IN (SELECT jsonb_array_elements_text($4::jsonb)) OR ($5 AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - $1::float8 * interval '1 second'))
  AND NOT EXISTS (
    SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each(p.sender) b ON a.key = b.key WHERE a.value <> b.value)
ORDER BY p.position
LIMIT 1

-- name: staged_near
-- As SQLite's: staged sends ($2 to $3) and the other messages their recipients have that count as sent.
SELECT p.position, p.tool AS staged_tool, {o_columns}
FROM hg_plan_stage p
CROSS JOIN LATERAL jsonb_array_elements_text(p.recipient_keys) AS pr (recipient)
JOIN operation_recipients r ON r.recipient COLLATE "C" = pr.recipient
JOIN operations o ON o.id = r.operation_id
WHERE p.position BETWEEN $2 AND $3 AND NOT p.allow_duplicate AND o.channel = p.channel
  AND o.content_fingerprint <> p.content_fingerprint AND o.idempotency_key <> p.idempotency_key
  AND (o.state IN {waiting}
       OR ((o.state IN {settled_live} OR o.may_have_left)
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - $1::float8 * interval '1 second'))
ORDER BY p.position, o.created_at DESC

-- name: staged_intent
SELECT idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint,
    sender::text AS sender, campaign_id, lead_id, message_id, lead, allow_duplicate
FROM hg_plan_stage WHERE position = $1

-- name: plan_staged
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, lead, batch_id, state, created_at, updated_at)
SELECT id, idempotency_key, tool, channel, recipients, ARRAY(SELECT jsonb_array_elements_text(recipient_keys)),
    request, request_fingerprint, content_fingerprint, sender, campaign_id, lead_id, message_id, lead, $1, $2, {now},
    {now}
FROM hg_plan_stage ORDER BY position

-- name: plan_staged_recipients
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT p.id, r, p.content_fingerprint FROM hg_plan_stage p, jsonb_array_elements_text(p.recipient_keys) AS r

-- name: plan_staged_events
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
SELECT p.id, {now}, NULL, $1, $2, $3 FROM hg_plan_stage p JOIN operations o ON o.id = p.id ORDER BY o.seq

-- name: lock_recipients
-- The advisory locks of these recipient keys (and leads), sorted (see hg_begin_send): the sends to them wait for
-- this plan's transaction.
SELECT pg_advisory_xact_lock(hg_lock_key(subject)) FROM unnest($1::text[]) AS subject ORDER BY hg_lock_key(subject)

-- ---------------------------------------------------------------------------------------------------
-- The send path (hail_guard/ledger/postgres.py): each write one statement, committed on its own.

-- name: begin_send
-- Everything `begin_send` does, in one round trip (two when near messages are compared): see begin_send.sql.
SELECT b.verdict, (b.operation).*
FROM hg_begin_send($1, $2, $3, $4, $5::jsonb, ARRAY(SELECT jsonb_array_elements_text($6::jsonb)), $7, $8, $9,
    $10::jsonb, $11, $12, $13, $14, $15, $16, $17, $18, ARRAY(SELECT jsonb_array_elements_text($19::jsonb)),
    ARRAY(SELECT jsonb_array_elements_text($20::jsonb)), $21, $22, $23, $24, $25::text[], $26) b

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
    SELECT id, {now}, 'sending', 'unknown', 'ledger', $1 FROM expired)
SELECT count(*) AS expired FROM expired

-- name: claim_ready_by_id
-- $1 owner, $2 lease seconds, $3 the operation, $4 whether a lead's unresolved send holds it (see claims.sql).
SELECT {columns} FROM hg_claim_ready($1, $2::float8, 1, NULL, NULL, $3, $4)

-- name: claim_ready_any
-- Expire the leases that ran out, and claim the oldest `ready` operations whose recipients did not opt out and are
-- not held: see claims.sql. $1 owner, $2 lease seconds, $3 how many, $4 the expiry's reason, $5 hold leads.
SELECT {columns} FROM hg_claim_ready($1, $2::float8, $3, $4, NULL, NULL, $5)

-- name: claim_ready_in_batch
-- As claim_ready_any, in batch $6.
SELECT {columns} FROM hg_claim_ready($1, $2::float8, $3, $4, $6, NULL, $5)

-- name: record_outcomes
-- The outcomes of one or many sends, in one round trip: see outcomes.sql. $1 to $13 are arrays (record_outcome's
-- parameters, an element for each), $14 how long a webhook stays parked, $15 whether one parked raises HG001.
SELECT r.given_id, r.before_state, (r.operation).*, r.parked
FROM hg_record_outcomes($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::integer[], $7::float8[],
    $8::float8[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::float8, $15::boolean) AS r

-- name: claim_ready_for
-- Claims for several owners at once (the group commit): the n-th operation claimed is owner n's ($1), see claims.sql.
-- $2 lease seconds, $3 the expiry's reason, $4 the batch (NULL: any), $5 hold leads.
SELECT {columns} FROM hg_claim_ready_for($1::text[], $2::float8, $3, $4, $5)

-- name: claim_unknown_due
WITH picked AS MATERIALIZED (
    SELECT id FROM operations
    WHERE state = 'unknown' AND ($3::text IS NULL OR batch_id = $3)
      AND (next_check_at IS NULL OR next_check_at <= {now})
      AND (lease_expires_at IS NULL OR lease_expires_at <= {now})
    ORDER BY next_check_at NULLS FIRST, seq LIMIT $4
    FOR UPDATE SKIP LOCKED),
claimed AS (
    UPDATE operations SET attempts = attempts + 1, lease_owner = $1,
        lease_expires_at = {now} + $2::float8 * interval '1 second', updated_at = {now}
    FROM picked WHERE operations.id = picked.id
    RETURNING operations.*)
SELECT {columns} FROM claimed ORDER BY next_check_at NULLS FIRST, seq

-- name: claim_unknown_by_id
UPDATE operations SET attempts = attempts + 1, lease_owner = $1,
    lease_expires_at = {now} + $2::float8 * interval '1 second', updated_at = {now}
WHERE id = $4 AND state = 'unknown' AND ($3::text IS NULL OR batch_id = $3)
  AND (lease_expires_at IS NULL OR lease_expires_at <= {now})
RETURNING {columns}

-- name: claim_delivery_checks
WITH picked AS MATERIALIZED (
    SELECT id FROM operations
    WHERE state = 'accepted' AND provider_id IS NOT NULL
      AND channel IN (SELECT jsonb_array_elements_text($2::jsonb))
      AND (delivery_state IS NULL OR delivery_state NOT IN (SELECT jsonb_array_elements_text($3::jsonb)))
      AND (delivery_next_check_at IS NULL OR delivery_next_check_at <= {now})
      AND COALESCE(first_sent_at, created_at) >= {now} - $4::float8 * interval '1 second'
    ORDER BY delivery_next_check_at NULLS FIRST, created_at, seq LIMIT $5
    FOR UPDATE SKIP LOCKED),
claimed AS (
    UPDATE operations SET delivery_next_check_at = {now} + $1::float8 * interval '1 second'
    FROM picked WHERE operations.id = picked.id
    RETURNING operations.*)
SELECT {columns} FROM claimed ORDER BY created_at, seq

-- ---------------------------------------------------------------------------------------------------
-- The operator console's reads (hail_guard.console), as SQLite's: each walks an index (schema 9). Key and
-- recipient ranges compare in byte order (COLLATE "C", as their indexes), whatever the database's collation.

-- name: sends_by_hour
-- Each count is the sum of its shards (see migration 9).
SELECT hour, state, delivery_state, sum(count) AS count FROM sends_by_hour WHERE hour >= to_timestamp($1)
GROUP BY hour, state, delivery_state HAVING sum(count) <> 0 ORDER BY hour

-- name: count_in_state
SELECT count(*) AS count FROM operations WHERE state = $1

-- name: search_anchor
SELECT extract(epoch FROM created_at) AS created_at, seq AS position, idempotency_key FROM operations WHERE id = $1

-- name: search_by_key
SELECT {columns} FROM operations
WHERE idempotency_key COLLATE "C" >= $1::text AND idempotency_key COLLATE "C" < $2::text
  AND ($3::text IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = $3::text))
  AND ($4::text IS NULL OR batch_id = $4::text)
  AND ($5::text IS NULL OR campaign_id = $5::text)
  AND ($6::text IS NULL OR state = $6::text)
  AND ($7::float8 IS NULL OR created_at >= to_timestamp($7))
  AND idempotency_key COLLATE "C" > $10::text AND $8::float8 IS NOT NULL AND $9::bigint IS NOT NULL
ORDER BY idempotency_key COLLATE "C" LIMIT $11

-- name: search_by_recipient
SELECT {columns} FROM operations
WHERE ($1::text IS NULL OR (idempotency_key COLLATE "C" >= $1::text AND idempotency_key COLLATE "C" < $2::text))
  AND id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = $3::text)
  AND ($4::text IS NULL OR batch_id = $4::text)
  AND ($5::text IS NULL OR campaign_id = $5::text)
  AND ($6::text IS NULL OR state = $6::text)
  AND ($7::float8 IS NULL OR created_at >= to_timestamp($7))
  AND (created_at, seq) < (to_timestamp($8::float8), $9::bigint) AND $10::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT $11

-- name: search_by_batch
SELECT {columns} FROM operations
WHERE ($1::text IS NULL OR (idempotency_key COLLATE "C" >= $1::text AND idempotency_key COLLATE "C" < $2::text))
  AND ($3::text IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = $3::text))
  AND batch_id = $4::text
  AND ($5::text IS NULL OR campaign_id = $5::text)
  AND ($6::text IS NULL OR state = $6::text)
  AND ($7::float8 IS NULL OR created_at >= to_timestamp($7))
  AND (created_at, seq) < (to_timestamp($8::float8), $9::bigint) AND $10::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT $11

-- name: search_by_campaign
SELECT {columns} FROM operations
WHERE ($1::text IS NULL OR (idempotency_key COLLATE "C" >= $1::text AND idempotency_key COLLATE "C" < $2::text))
  AND ($3::text IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = $3::text))
  AND ($4::text IS NULL OR batch_id = $4::text)
  AND campaign_id = $5::text
  AND ($6::text IS NULL OR state = $6::text)
  AND ($7::float8 IS NULL OR created_at >= to_timestamp($7))
  AND (created_at, seq) < (to_timestamp($8::float8), $9::bigint) AND $10::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT $11

-- name: search_by_state
SELECT {columns} FROM operations
WHERE ($1::text IS NULL OR (idempotency_key COLLATE "C" >= $1::text AND idempotency_key COLLATE "C" < $2::text))
  AND ($3::text IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = $3::text))
  AND ($4::text IS NULL OR batch_id = $4::text)
  AND ($5::text IS NULL OR campaign_id = $5::text)
  AND state = $6::text
  AND ($7::float8 IS NULL OR created_at >= to_timestamp($7))
  AND (created_at, seq) < (to_timestamp($8::float8), $9::bigint) AND $10::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT $11

-- name: search_all
SELECT {columns} FROM operations
WHERE ($1::text IS NULL OR (idempotency_key COLLATE "C" >= $1::text AND idempotency_key COLLATE "C" < $2::text))
  AND ($3::text IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = $3::text))
  AND ($4::text IS NULL OR batch_id = $4::text)
  AND ($5::text IS NULL OR campaign_id = $5::text)
  AND ($6::text IS NULL OR state = $6::text)
  AND ($7::float8 IS NULL OR created_at >= to_timestamp($7))
  AND (created_at, seq) < (to_timestamp($8::float8), $9::bigint) AND $10::text IS NOT NULL
ORDER BY created_at DESC, seq DESC LIMIT $11

-- name: unsent_in_batch
SELECT id, state FROM operations WHERE batch_id = $1 AND state IN {cancellable} ORDER BY created_at, seq FOR UPDATE

-- name: search_suppressions
SELECT recipient, channel, reason, source, created_at FROM suppressions
WHERE recipient COLLATE "C" >= $1::text AND recipient COLLATE "C" < $2::text AND (recipient COLLATE "C", channel COLLATE "C") > ($3::text, $4::text)
ORDER BY recipient COLLATE "C", channel COLLATE "C" LIMIT $5

-- name: opt_out_cancelled
SELECT {columns} FROM operations
WHERE id IN (
    SELECT operation_id FROM operation_recipients WHERE recipient COLLATE "C" = $1::text
    UNION
    SELECT operation_id FROM operation_recipients
    WHERE recipient COLLATE "C" >= $2::text AND recipient COLLATE "C" < $3::text AND recipient LIKE $4::text)
  AND state = 'cancelled' AND NOT may_have_left AND cancel_reason LIKE $5 AND ($6::text = 'all' OR channel = $6::text)
ORDER BY updated_at DESC LIMIT $7

-- name: remember_tool_definition
INSERT INTO upstream_tool_definitions (fingerprint, definition) VALUES ($1, $2) ON CONFLICT DO NOTHING

-- name: start_session
INSERT INTO console_sessions (digest, name, created_at, expires_at)
VALUES ($1, $2, {now}, {now} + $3::float8 * interval '1 second')

-- name: forget_sessions
DELETE FROM console_sessions WHERE expires_at <= {now}

-- name: find_session
SELECT name, created_at, expires_at FROM console_sessions WHERE digest = $1 AND expires_at > {now}

-- name: end_session
DELETE FROM console_sessions WHERE digest = $1

-- name: record_heartbeat
INSERT INTO heartbeats (id, who, role, batch_id, started_at, seen_at) VALUES ($1, $2, $3, $4, {now}, {now})
ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at

-- name: forget_heartbeats
DELETE FROM heartbeats WHERE seen_at < {now} - $1::float8 * interval '1 second'

-- name: end_heartbeat
DELETE FROM heartbeats WHERE id = $1

-- name: heartbeats
SELECT id, who, role, batch_id, started_at, seen_at FROM heartbeats ORDER BY started_at, id

-- name: tool_definitions
SELECT fingerprint, definition FROM upstream_tool_definitions
WHERE fingerprint IN (SELECT jsonb_array_elements_text($1::jsonb))
