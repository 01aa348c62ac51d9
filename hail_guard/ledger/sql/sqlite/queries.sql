-- The SQLite ledger's statements (see hail_guard/ledger/sql.py). Times are Unix epoch seconds from the
-- database's clock ({now}); JSON values are text. The statements shared with PostgreSQL (the core's) come
-- first, in the order of sql/postgres/queries.sql; the send path's own statements follow.

-- ---------------------------------------------------------------------------------------------------
-- Shared with PostgreSQL: the same names, the same parameters in the same order.

-- name: now
SELECT {now}

-- name: operation_by_id
SELECT {columns} FROM operations WHERE id = ?1

-- name: operation_by_id_for_update
SELECT {columns} FROM operations WHERE id = ?1

-- name: operation_by_key
SELECT {columns} FROM operations WHERE idempotency_key = ?1

-- name: operation_by_provider_for_update
SELECT {columns} FROM operations WHERE provider_id = ?1 ORDER BY created_at DESC, rowid DESC LIMIT 1

-- name: oldest_in_state
SELECT {columns} FROM operations WHERE state = ?1 ORDER BY created_at, rowid LIMIT 1

-- name: list_operations
-- ?1 state, ?2 campaign, ?3 batch, ?4 a recipient's opt-out key, ?5 created since (epoch), ?6 after this
-- operation (paging), ?7 how many.
SELECT {columns} FROM operations
WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR campaign_id = ?2) AND (?3 IS NULL OR batch_id = ?3)
  AND (?4 IS NULL OR EXISTS (SELECT 1 FROM json_each(operations.recipient_keys) r WHERE r.value = ?4))
  AND (?5 IS NULL OR created_at >= ?5)
  AND (?6 IS NULL OR (created_at, rowid) < (SELECT created_at, rowid FROM operations o WHERE o.id = ?6))
ORDER BY created_at DESC, rowid DESC LIMIT ?7

-- name: count_by_state
SELECT state, COUNT(*) AS count FROM operations GROUP BY state

-- name: events_of
SELECT operation_id, at, from_state, to_state, actor, reason FROM events WHERE operation_id = ?1 ORDER BY id

-- name: record_event
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason) VALUES (?1, {now}, ?2, ?3, ?4, ?5)

-- name: insert_operation
-- ?1 id, ?2-?15 the intent (`core.intent_values`), ?16 state.
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, lead, state, created_at, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, {now}, {now})

-- name: insert_operation_recipients
-- One row per recipient key (the mailbox: `recipients.key_of`): what every rule about the same send compares.
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT o.id, r.value, o.content_fingerprint FROM operations o, json_each(o.recipient_keys) r WHERE o.id = ?1

-- name: resolve_review
-- ?1 state, ?2 provider id, ?3 cancel reason, ?4 last error, ?5 id, ?6 may have left.
UPDATE operations SET state = ?1, provider_id = COALESCE(?2, provider_id), cancel_reason = COALESCE(?3, cancel_reason),
    last_error = COALESCE(?4, last_error), may_have_left = ?6, lease_owner = NULL, lease_expires_at = NULL,
    next_check_at = NULL, updated_at = {now}
WHERE id = ?5 AND state IN {reviewable}

-- name: link_resend
UPDATE operations SET resend_of = ?2 WHERE id = ?1

-- name: supersede
-- ?1 cancel reason, ?2 the new operation, ?3 the old one.
UPDATE operations SET state = 'cancelled', cancel_reason = ?1, resent_as = ?2, may_have_left = 1, lease_owner = NULL,
    lease_expires_at = NULL, next_check_at = NULL, updated_at = {now}
WHERE id = ?3 AND state IN {reviewable}

-- name: suppressions
SELECT recipient, channel, reason, source, created_at FROM suppressions ORDER BY created_at, recipient, channel

-- name: add_suppression
INSERT INTO suppressions (recipient, channel, reason, source, created_at) VALUES (?1, ?2, ?3, ?4, {now})
ON CONFLICT (recipient, channel) DO UPDATE SET reason = excluded.reason, source = excluded.source

-- name: remove_suppression
DELETE FROM suppressions WHERE recipient = ?1 AND channel = ?2 RETURNING recipient

-- name: opted_out_pending
-- Unforwarded operations (of batch ?1, or of all) a recipient of which opted out of their channel.
SELECT id, state FROM operations
WHERE state IN {cancellable} AND (?1 IS NULL OR batch_id = ?1) AND EXISTS (
    SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
    WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))
ORDER BY rowid

-- name: cancel_operations
-- ?1 the operations (a JSON list), ?2 why.
UPDATE operations SET state = 'cancelled', cancel_reason = ?2, updated_at = {now}
WHERE id IN (SELECT value FROM json_each(?1)) AND state IN {cancellable}
RETURNING id

-- name: insert_batch
INSERT INTO batches (id, name, created_by, created_at) VALUES (?1, ?2, ?3, {now})

-- name: batch_name
SELECT name FROM batches WHERE id = ?1

-- name: batch_counts
SELECT state, COUNT(*) AS count FROM operations WHERE batch_id = ?1 GROUP BY state

-- name: batch_unresolved
SELECT {columns} FROM operations WHERE batch_id = ?1 AND state IN {unresolved} ORDER BY created_at, rowid LIMIT 100

-- name: batch_held
-- The batch's `ready` sends held by an unresolved send (same_send.HOLDING) to one of their recipient keys on their
-- channel, or (?2) to their lead: what holds each (`held_by`). Walked from the unresolved sends, which are few.
SELECT * FROM (
    SELECT {o_columns}, o.rowid AS position, h.id AS held_by
    FROM operations h INDEXED BY operations_by_state_created
    JOIN operation_recipients hr ON hr.operation_id = h.id
    JOIN operation_recipients r ON r.recipient = hr.recipient
    JOIN operations o ON o.id = r.operation_id
    WHERE h.state IN {holding} AND o.batch_id = ?1 AND o.state = {claimable_state} AND o.channel = h.channel
    UNION ALL
    SELECT {o_columns}, o.rowid AS position, h.id AS held_by
    FROM operations h INDEXED BY operations_by_state_created JOIN operations o ON o.lead = h.lead
    WHERE ?2 AND h.state IN {holding} AND o.batch_id = ?1 AND o.state = {claimable_state} AND o.id != h.id)
ORDER BY created_at, position LIMIT 100

-- name: list_batches
-- ?1 how many, ?2 after this batch (paging).
SELECT b.id AS batch_id, b.name, b.created_at, o.state, COUNT(o.id) AS count
FROM (SELECT id, name, created_at FROM batches
      WHERE ?2 IS NULL OR (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?2)
      ORDER BY created_at DESC, id DESC LIMIT ?1) AS b
LEFT JOIN operations AS o ON o.batch_id = b.id
GROUP BY b.id, o.state ORDER BY b.created_at DESC, b.id DESC

-- name: approve_batch
UPDATE operations SET state = 'ready', updated_at = {now} WHERE batch_id = ?1 AND state IN {approvable} RETURNING id

-- name: delivery_events_of
SELECT operation_id, state, occurred_at, recorded_at, source, detail FROM delivery_events
WHERE operation_id = ?1 ORDER BY id

-- name: record_delivery_event
-- ?3 when it happened (epoch, or NULL when the source gave no time).
INSERT INTO delivery_events (operation_id, state, occurred_at, recorded_at, source, detail)
VALUES (?1, ?2, ?3, {now}, ?4, ?5) ON CONFLICT (operation_id, state) DO NOTHING

-- name: set_delivery_state
UPDATE operations SET delivery_state = ?1, delivery_at = COALESCE(?2, {now}), updated_at = {now} WHERE id = ?3

-- name: count_delivery_check
UPDATE operations SET delivery_checks = delivery_checks + 1, delivery_next_check_at = {now} + ?1 WHERE id = ?2

-- name: signature_seen
SELECT 1 FROM webhook_deliveries WHERE signature = ?1

-- name: claim_webhook
-- Counts a delivery id (and a signature) once: nothing when either was seen. ?6 ?7 the delivery state it carries
-- and when that happened (epoch), kept to apply it later when no operation has its message id yet.
INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, outcome, received_at, payload,
    delivery_state, occurred_at)
VALUES (?1, ?2, ?3, ?4, 'pending', {now}, ?5, ?6, ?7) ON CONFLICT DO NOTHING RETURNING delivery_id

-- name: settle_webhook
UPDATE webhook_deliveries SET outcome = ?1, operation_id = ?2 WHERE delivery_id = ?3

-- name: lock_provider
-- Nothing to lock: SQLite's writes run one at a time (PostgreSQL's takes an advisory lock on the message id).
SELECT ?1

-- name: parked_count
-- Webhooks kept for a message id no operation had, received within ?1 seconds.
SELECT COUNT(*) AS count FROM webhook_deliveries WHERE outcome = 'parked' AND received_at >= {now} - ?1

-- name: parked_webhooks
-- Those kept for message id ?1 (within ?2 seconds), in the order received.
SELECT delivery_id, delivery_state, occurred_at FROM webhook_deliveries
WHERE provider_id = ?1 AND outcome = 'parked' AND received_at >= {now} - ?2 ORDER BY received_at, delivery_id

-- name: prune_cutoff
SELECT {now} - ?1

-- name: prune_events
DELETE FROM events WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < ?1 AND created_at < ?1)

-- name: prune_delivery_events
DELETE FROM delivery_events WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < ?1 AND created_at < ?1)

-- name: prune_recipients
DELETE FROM operation_recipients WHERE operation_id IN (
    SELECT id FROM operations WHERE state IN {terminal} AND updated_at < ?1 AND created_at < ?1)

-- name: prune_operations
DELETE FROM operations WHERE state IN {terminal} AND updated_at < ?1 AND created_at < ?1

-- name: prune_send_counts
-- The hours' counts that fell to 0 (their sends were pruned, or all moved to other states).
DELETE FROM sends_by_hour WHERE count = 0

-- name: prune_webhooks
DELETE FROM webhook_deliveries WHERE received_at < {now} - ?1

-- name: observe_tool
INSERT INTO upstream_tools (name, fingerprint, accepted_fingerprint, first_seen_at) VALUES (?1, ?2, ?2, {now})
ON CONFLICT (name) DO UPDATE SET
    changed_at = CASE WHEN excluded.fingerprint = upstream_tools.fingerprint THEN upstream_tools.changed_at
                      ELSE {now} END,
    fingerprint = excluded.fingerprint

-- name: tool_pins
SELECT name, fingerprint, accepted_fingerprint, first_seen_at, changed_at FROM upstream_tools ORDER BY name

-- name: accept_tools
-- ?1 the names (a JSON list), or NULL for every changed tool.
UPDATE upstream_tools SET accepted_fingerprint = fingerprint, changed_at = NULL
WHERE fingerprint != accepted_fingerprint AND (?1 IS NULL OR name IN (SELECT value FROM json_each(?1)))
RETURNING name

-- ---------------------------------------------------------------------------------------------------
-- The send path (hail_guard/ledger/sqlite.py), run in group commits.

-- name: expire_leases
UPDATE operations SET state = 'unknown', updated_at = {now}, next_check_at = {now}
WHERE state IN {expiring} AND lease_expires_at <= {now}
RETURNING id

-- name: opted_out
-- Whether any of these opt-out keys (a JSON list) opted out of channel ?2, or of all.
SELECT 1 FROM suppressions WHERE recipient IN (SELECT value FROM json_each(?1)) AND channel IN (?2, 'all') LIMIT 1

-- name: operation_by_keys
-- The operation under key ?1, else under the key an earlier version derived for the same send (?2, or NULL).
SELECT {columns} FROM operations WHERE idempotency_key IN (?1, ?2) ORDER BY idempotency_key = ?1 DESC LIMIT 1

-- name: matches
-- The same message (?1) to one of its recipient keys (?2, a JSON list), under another key (?3), of the same tool
-- (?4), whose senders agree with ?9, in a state that blocks it (same_send.Rules.match_states): one of ?5 at any
-- age, or one of ?6 (or closed by an operator after it may have left, when ?7) first sent within ?8 seconds.
SELECT {o_columns} FROM operation_recipients r JOIN operations o ON o.id = r.operation_id
WHERE r.content_fingerprint = ?1 AND r.recipient IN (SELECT value FROM json_each(?2))
  AND o.idempotency_key != ?3 AND o.tool = ?4
  AND (o.state IN (SELECT value FROM json_each(?5))
       OR ((o.state IN (SELECT value FROM json_each(?6)) OR (?7 AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - ?8))
  AND NOT EXISTS (
    SELECT 1 FROM json_each(o.sender) a, json_each(?9) b WHERE a.key = b.key AND a.value IS NOT b.value)
GROUP BY o.id ORDER BY o.created_at DESC, o.rowid DESC LIMIT 20

-- name: holds
-- Unresolved sends (same_send.HOLDING) to one of these recipient keys (?1, a JSON list) on channel ?2, or to the
-- lead ?3 on any channel (NULL: leads are not held), oldest first.
SELECT * FROM (
    SELECT {o_columns}, o.rowid AS position FROM operation_recipients r JOIN operations o ON o.id = r.operation_id
    WHERE r.recipient IN (SELECT value FROM json_each(?1)) AND o.channel = ?2 AND o.state IN {holding}
    UNION
    SELECT {o_columns}, o.rowid AS position FROM operations o WHERE o.lead = ?3 AND o.state IN {holding})
ORDER BY created_at, position LIMIT 5

-- name: near
-- Other messages (not ?3) that one of these recipient keys (?1) has on channel ?2 under another key (?5), counted
-- as sent: waiting (same_send.WAITING) at any age, or settled (same_send.SETTLED_LIVE, or closed by an operator
-- after it may have left) first sent within ?4 seconds; newest first, compared by similarity.
SELECT {o_columns} FROM operations o
WHERE o.id IN (SELECT operation_id FROM operation_recipients WHERE recipient IN (SELECT value FROM json_each(?1)))
  AND o.channel = ?2 AND o.content_fingerprint != ?3 AND o.idempotency_key != ?5
  AND (o.state IN {waiting}
       OR ((o.state IN {settled_live} OR o.may_have_left) AND COALESCE(o.first_sent_at, o.created_at) >= {now} - ?4))
ORDER BY o.created_at DESC, o.rowid DESC LIMIT 20

-- name: insert_sending
-- ?1 id, ?2-?15 the intent, ?16 owner, ?17 lease seconds.
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, lead, state, attempts, lease_owner,
    lease_expires_at, created_at, updated_at, first_sent_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, 'sending', 1, ?16, {now} + ?17, {now},
    {now}, {now})
RETURNING {columns}

-- name: claim_ready_by_id
-- ?1 owner, ?2 lease seconds, ?3 the operation, ?4 whether a lead's unresolved send holds it.
UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = ?1, lease_expires_at = {now} + ?2,
    updated_at = {now}, first_sent_at = COALESCE(first_sent_at, {now})
WHERE id = ?3 AND state IN {claimable} AND COALESCE(not_before, 0) <= {now} AND NOT EXISTS (
    SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
    WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))
      AND NOT EXISTS (  -- held: a recipient key has an unresolved send on the channel (same_send.HOLDING)
        SELECT 1 FROM operation_recipients mine
        JOIN operation_recipients theirs ON theirs.recipient = mine.recipient
        JOIN operations h ON h.id = theirs.operation_id
        WHERE mine.operation_id = operations.id AND h.id != operations.id AND h.channel = operations.channel
          AND h.state IN {holding})
      AND NOT (?4 AND operations.lead IS NOT NULL AND EXISTS (  -- held: the lead has an unresolved send
        SELECT 1 FROM operations h WHERE h.lead = operations.lead AND h.id != operations.id AND h.state IN {holding}))
RETURNING {columns}

-- name: claim_ready_any
-- Walk the ready rows oldest first and stop at the first that may go. Without INDEXED BY, SQLite (no ANALYZE
-- statistics) picks operations_by_state, checks every ready row for opt-outs and sorts them all, so a drain of
-- N sends cost O(N^2) (seen by `python -m bench --only drain`). ?4: whether a lead's unresolved send holds a send.
UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = ?1, lease_expires_at = {now} + ?2,
    updated_at = {now}, first_sent_at = COALESCE(first_sent_at, {now})
WHERE id IN (
    SELECT id FROM operations INDEXED BY operations_ready
    WHERE state = {claimable_state} AND COALESCE(not_before, 0) <= {now} AND NOT EXISTS (
        SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
        WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))
      AND NOT EXISTS (  -- held: a recipient key has an unresolved send on the channel (same_send.HOLDING)
        SELECT 1 FROM operation_recipients mine
        JOIN operation_recipients theirs ON theirs.recipient = mine.recipient
        JOIN operations h ON h.id = theirs.operation_id
        WHERE mine.operation_id = operations.id AND h.id != operations.id AND h.channel = operations.channel
          AND h.state IN {holding})
      AND NOT (?4 AND operations.lead IS NOT NULL AND EXISTS (  -- held: the lead has an unresolved send
        SELECT 1 FROM operations h WHERE h.lead = operations.lead AND h.id != operations.id AND h.state IN {holding}))
    ORDER BY created_at, rowid LIMIT ?3)
RETURNING {columns}

-- name: claim_ready_in_batch
UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = ?1, lease_expires_at = {now} + ?2,
    updated_at = {now}, first_sent_at = COALESCE(first_sent_at, {now})
WHERE id IN (
    SELECT id FROM operations INDEXED BY operations_ready_by_batch
    WHERE state = {claimable_state} AND batch_id = ?5 AND COALESCE(not_before, 0) <= {now} AND NOT EXISTS (
        SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
        WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))
      AND NOT EXISTS (  -- held: a recipient key has an unresolved send on the channel (same_send.HOLDING)
        SELECT 1 FROM operation_recipients mine
        JOIN operation_recipients theirs ON theirs.recipient = mine.recipient
        JOIN operations h ON h.id = theirs.operation_id
        WHERE mine.operation_id = operations.id AND h.id != operations.id AND h.channel = operations.channel
          AND h.state IN {holding})
      AND NOT (?4 AND operations.lead IS NOT NULL AND EXISTS (  -- held: the lead has an unresolved send
        SELECT 1 FROM operations h WHERE h.lead = operations.lead AND h.id != operations.id AND h.state IN {holding}))
    ORDER BY batch_id, created_at, rowid LIMIT ?3)
RETURNING {columns}

-- name: state_of
SELECT state FROM operations WHERE id = ?1

-- name: provider_id_holder
-- Another operation (not ?2) that holds the upstream's message id ?1.
SELECT id FROM operations WHERE provider_id = ?1 AND id != ?2 LIMIT 1

-- name: record_outcome
-- Fenced on the lease owner (?10). ?6 counts the claim's attempt back when none was made.
UPDATE operations SET state = ?1, provider_id = COALESCE(?2, provider_id), result = COALESCE(?3, result),
    last_error = COALESCE(?4, last_error), review_reason = ?5, attempts = attempts - ?6,
    not_before = CASE WHEN ?7 IS NULL THEN NULL ELSE {now} + ?7 END,
    next_check_at = CASE WHEN ?8 IS NULL THEN NULL ELSE {now} + ?8 END,
    lease_expires_at = NULL, updated_at = {now}
WHERE id = ?9 AND state IN {recordable} AND lease_owner = ?10
RETURNING {columns}

-- name: claim_unknown_due
UPDATE operations SET attempts = attempts + 1, lease_owner = ?1, lease_expires_at = {now} + ?2, updated_at = {now}
WHERE id IN (
    SELECT id FROM operations
    WHERE state = 'unknown' AND (?3 IS NULL OR batch_id = ?3) AND COALESCE(next_check_at, 0) <= {now}
      AND COALESCE(lease_expires_at, 0) <= {now}
    ORDER BY next_check_at LIMIT ?4)
RETURNING {columns}

-- name: claim_unknown_by_id
UPDATE operations SET attempts = attempts + 1, lease_owner = ?1, lease_expires_at = {now} + ?2, updated_at = {now}
WHERE id = ?4 AND state = 'unknown' AND (?3 IS NULL OR batch_id = ?3) AND COALESCE(lease_expires_at, 0) <= {now}
RETURNING {columns}

-- name: quick_check
PRAGMA quick_check

-- name: claim_delivery_checks
-- Accepted operations of channels ?2 (a JSON list) with a provider id, whose delivery has not settled (?3, the
-- settled states), first sent within ?4 seconds and due: held ?1 seconds, ?5 at most.
UPDATE operations SET delivery_next_check_at = {now} + ?1
WHERE id IN (
    SELECT id FROM operations
    WHERE state = 'accepted' AND provider_id IS NOT NULL AND channel IN (SELECT value FROM json_each(?2))
      AND (delivery_state IS NULL OR delivery_state NOT IN (SELECT value FROM json_each(?3)))
      AND COALESCE(delivery_next_check_at, 0) <= {now} AND COALESCE(first_sent_at, created_at) >= {now} - ?4
    ORDER BY COALESCE(delivery_next_check_at, 0), created_at LIMIT ?5)
RETURNING {columns}

-- ---------------------------------------------------------------------------------------------------
-- Planning a batch, on a connection of its own: the sends are staged in a temporary table (no lock on the
-- ledger), then checked and copied in one transaction.

-- name: create_stage
CREATE TEMPORARY TABLE IF NOT EXISTS hg_plan_stage (
    position INTEGER PRIMARY KEY, id TEXT NOT NULL, idempotency_key TEXT NOT NULL, tool TEXT NOT NULL,
    channel TEXT NOT NULL, recipients TEXT NOT NULL, recipient_keys TEXT NOT NULL, request TEXT NOT NULL,
    request_fingerprint TEXT NOT NULL, content_fingerprint TEXT NOT NULL, sender TEXT NOT NULL, campaign_id TEXT,
    lead_id TEXT, message_id TEXT, lead TEXT, allow_duplicate INTEGER NOT NULL)

-- name: stage_send
INSERT INTO hg_plan_stage VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)

-- name: drop_stage
DROP TABLE IF EXISTS temp.hg_plan_stage

-- name: staged_known_keys
SELECT p.position, p.idempotency_key, o.id, COUNT(*) OVER () AS taken
FROM hg_plan_stage p JOIN operations o ON o.idempotency_key = p.idempotency_key
ORDER BY p.position LIMIT 10

-- name: staged_repeat
-- The first staged send whose message an operation under another key already has for one of its recipient keys,
-- in a state that blocks it (core.match_args: ?1 the window, ?2 for sends that allow a duplicate or not, ?3 the
-- states compared at any age, ?4 those compared within the window, ?5 whether closes count).
SELECT p.position FROM hg_plan_stage p, json_each(p.recipient_keys) pr
JOIN operation_recipients r ON r.content_fingerprint = p.content_fingerprint AND r.recipient = pr.value
JOIN operations o ON o.id = r.operation_id
WHERE p.allow_duplicate = ?2 AND o.idempotency_key != p.idempotency_key AND o.tool = p.tool
  AND (o.state IN (SELECT value FROM json_each(?3))
       OR ((o.state IN (SELECT value FROM json_each(?4)) OR (?5 AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - ?1))
  AND NOT EXISTS (
    SELECT 1 FROM json_each(o.sender) a, json_each(p.sender) b WHERE a.key = b.key AND a.value IS NOT b.value)
ORDER BY p.position LIMIT 1

-- name: staged_near
-- Staged sends (positions ?2 to ?3) and the other messages one of their recipient keys has on their channel that
-- count as sent (same_send.WAITING at any age; SETTLED_LIVE, or closed after it may have left, first sent within ?1
-- seconds), to compare by similarity; by position.
SELECT p.position, p.tool AS staged_tool, {o_columns}
FROM hg_plan_stage p, json_each(p.recipient_keys) pr
JOIN operation_recipients r ON r.recipient = pr.value
JOIN operations o ON o.id = r.operation_id
WHERE p.position BETWEEN ?2 AND ?3 AND NOT p.allow_duplicate AND o.channel = p.channel
  AND o.content_fingerprint != p.content_fingerprint AND o.idempotency_key != p.idempotency_key
  AND (o.state IN {waiting}
       OR ((o.state IN {settled_live} OR o.may_have_left) AND COALESCE(o.first_sent_at, o.created_at) >= {now} - ?1))
ORDER BY p.position, o.created_at DESC

-- name: staged_intent
SELECT idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint, sender,
    campaign_id, lead_id, message_id, lead, allow_duplicate
FROM hg_plan_stage WHERE position = ?1

-- name: plan_staged
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, lead, batch_id, state, created_at, updated_at)
SELECT id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, lead, ?1, ?2, {now}, {now}
FROM hg_plan_stage ORDER BY position

-- name: plan_staged_recipients
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT p.id, r.value, p.content_fingerprint FROM hg_plan_stage p, json_each(p.recipient_keys) r

-- name: plan_staged_events
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
SELECT id, {now}, NULL, ?1, ?2, ?3 FROM hg_plan_stage ORDER BY position

-- name: clear_stage
DELETE FROM hg_plan_stage

-- ---------------------------------------------------------------------------------------------------
-- The operator console's reads (hail_guard.console): each walks an index (schema 7).

-- name: sends_by_hour
-- ?1 an hour's start (epoch): what first left in it and in each hour since, by state and delivery state ('' none).
SELECT hour, state, delivery_state, count FROM sends_by_hour WHERE hour >= ?1 AND count <> 0 ORDER BY hour

-- name: count_in_state
SELECT COUNT(*) AS count FROM operations INDEXED BY operations_by_state_created WHERE state = ?1

-- name: search_anchor
SELECT created_at, rowid AS position, idempotency_key FROM operations WHERE id = ?1

-- A search: ?1 and ?2 a key prefix's range, ?3 a recipient, ?4 a batch, ?5 a campaign, ?6 a state, ?7 created
-- since (epoch), ?8 ?9 ?10 the (created at, position, key) of the operation to continue after, ?11 how many.
-- The filter named drives (its index, walked in order); the others are checked on the rows it yields.

-- name: search_by_key
SELECT {columns} FROM operations
WHERE idempotency_key >= ?1 AND idempotency_key < ?2
  AND (?3 IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = ?3))
  AND (?4 IS NULL OR batch_id = ?4)
  AND (?5 IS NULL OR campaign_id = ?5)
  AND (?6 IS NULL OR state = ?6)
  AND (?7 IS NULL OR created_at >= ?7)
  AND idempotency_key > ?10 AND ?8 IS NOT NULL AND ?9 IS NOT NULL
ORDER BY idempotency_key LIMIT ?11

-- name: search_by_recipient
SELECT {columns} FROM operations
WHERE (?1 IS NULL OR (idempotency_key >= ?1 AND idempotency_key < ?2))
  AND id IN (SELECT operation_id FROM operation_recipients WHERE recipient = ?3)
  AND (?4 IS NULL OR batch_id = ?4)
  AND (?5 IS NULL OR campaign_id = ?5)
  AND (?6 IS NULL OR state = ?6)
  AND (?7 IS NULL OR created_at >= ?7)
  AND created_at <= ?8 AND (created_at < ?8 OR rowid < ?9) AND ?10 IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT ?11

-- name: search_by_batch
SELECT {columns} FROM operations INDEXED BY operations_by_batch
WHERE (?1 IS NULL OR (idempotency_key >= ?1 AND idempotency_key < ?2))
  AND (?3 IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = ?3))
  AND batch_id = ?4
  AND (?5 IS NULL OR campaign_id = ?5)
  AND (?6 IS NULL OR state = ?6)
  AND (?7 IS NULL OR created_at >= ?7)
  AND created_at <= ?8 AND (created_at < ?8 OR rowid < ?9) AND ?10 IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT ?11

-- name: search_by_campaign
SELECT {columns} FROM operations INDEXED BY operations_by_campaign
WHERE (?1 IS NULL OR (idempotency_key >= ?1 AND idempotency_key < ?2))
  AND (?3 IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = ?3))
  AND (?4 IS NULL OR batch_id = ?4)
  AND campaign_id = ?5
  AND (?6 IS NULL OR state = ?6)
  AND (?7 IS NULL OR created_at >= ?7)
  AND created_at <= ?8 AND (created_at < ?8 OR rowid < ?9) AND ?10 IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT ?11

-- name: search_by_state
SELECT {columns} FROM operations INDEXED BY operations_by_state_created
WHERE (?1 IS NULL OR (idempotency_key >= ?1 AND idempotency_key < ?2))
  AND (?3 IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = ?3))
  AND (?4 IS NULL OR batch_id = ?4)
  AND (?5 IS NULL OR campaign_id = ?5)
  AND state = ?6
  AND (?7 IS NULL OR created_at >= ?7)
  AND created_at <= ?8 AND (created_at < ?8 OR rowid < ?9) AND ?10 IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT ?11

-- name: search_all
SELECT {columns} FROM operations INDEXED BY operations_by_created
WHERE (?1 IS NULL OR (idempotency_key >= ?1 AND idempotency_key < ?2))
  AND (?3 IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = ?3))
  AND (?4 IS NULL OR batch_id = ?4)
  AND (?5 IS NULL OR campaign_id = ?5)
  AND (?6 IS NULL OR state = ?6)
  AND (?7 IS NULL OR created_at >= ?7)
  AND created_at <= ?8 AND (created_at < ?8 OR rowid < ?9) AND ?10 IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT ?11

-- name: unsent_in_batch
SELECT id, state FROM operations WHERE batch_id = ?1 AND state IN {cancellable} ORDER BY created_at, rowid

-- name: search_suppressions
-- ?1 ?2 a recipient prefix's range, ?3 ?4 after this (recipient, channel), ?5 how many.
SELECT recipient, channel, reason, source, created_at FROM suppressions
WHERE recipient >= ?1 AND recipient < ?2 AND (recipient, channel) > (?3, ?4)
ORDER BY recipient, channel LIMIT ?5

-- name: opt_out_cancelled
-- ?1 the recipient, ?2 ?3 ?4 its sub-addresses (range and LIKE pattern), ?5 how an opt-out's cancel reads (LIKE),
-- ?6 the opt-out's channel, ?7 how many.
SELECT {columns} FROM operations
WHERE id IN (
    SELECT operation_id FROM operation_recipients WHERE recipient = ?1
    UNION
    SELECT operation_id FROM operation_recipients WHERE recipient >= ?2 AND recipient < ?3 AND recipient LIKE ?4 ESCAPE '\')
  AND state = 'cancelled' AND NOT may_have_left AND cancel_reason LIKE ?5 AND (?6 = 'all' OR channel = ?6)
ORDER BY updated_at DESC LIMIT ?7

-- name: remember_tool_definition
INSERT INTO upstream_tool_definitions (fingerprint, definition) VALUES (?1, ?2) ON CONFLICT DO NOTHING

-- name: start_session
-- ?1 a hash of the session id, ?2 the operator's name, ?3 how many seconds it lasts.
INSERT INTO console_sessions (digest, name, created_at, expires_at) VALUES (?1, ?2, {now}, {now} + ?3)

-- name: forget_sessions
DELETE FROM console_sessions WHERE expires_at <= {now}

-- name: find_session
SELECT name, created_at, expires_at FROM console_sessions WHERE digest = ?1 AND expires_at > {now}

-- name: end_session
DELETE FROM console_sessions WHERE digest = ?1

-- name: record_heartbeat
-- ?1 the beat's id, ?2 who (host:pid), ?3 its role, ?4 its batch (NULL: any).
INSERT INTO heartbeats (id, who, role, batch_id, started_at, seen_at) VALUES (?1, ?2, ?3, ?4, {now}, {now})
ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at

-- name: forget_heartbeats
-- Those silent for ?1 seconds: their process ended without taking its row away.
DELETE FROM heartbeats WHERE seen_at < {now} - ?1

-- name: end_heartbeat
DELETE FROM heartbeats WHERE id = ?1

-- name: heartbeats
SELECT id, who, role, batch_id, started_at, seen_at FROM heartbeats ORDER BY started_at, id

-- name: tool_definitions
SELECT fingerprint, definition FROM upstream_tool_definitions WHERE fingerprint IN (SELECT value FROM json_each(?1))
