-- The SQLite ledger's statements (see hail_guard/ledger/sql.py). Times are Unix epoch seconds from the
-- database's clock ({now}); JSON values are text. The statements shared with PostgreSQL (the core's) come
-- first, in the order of sql/postgres/queries.sql; the send path's own statements follow.

-- ---------------------------------------------------------------------------------------------------
-- Shared with PostgreSQL: the same names, the same parameters.

-- name: now
SELECT {now}

-- name: operation_by_id
SELECT {columns} FROM operations WHERE id = :id

-- name: operation_by_id_for_update
SELECT {columns} FROM operations WHERE id = :id

-- name: operation_by_key
SELECT {columns} FROM operations WHERE idempotency_key = :idempotency_key

-- name: operation_by_provider_for_update
SELECT {columns} FROM operations WHERE provider_id = :provider_id ORDER BY created_at DESC, rowid DESC LIMIT 1

-- name: oldest_in_state
SELECT {columns} FROM operations WHERE state = :state ORDER BY created_at, rowid LIMIT 1

-- name: list_operations
-- :recipient is a recipient's key, :since an epoch, :before the operation a page continues after.
SELECT {columns} FROM operations
WHERE (:state IS NULL OR state = :state) AND (:campaign_id IS NULL OR campaign_id = :campaign_id)
  AND (:batch_id IS NULL OR batch_id = :batch_id)
  AND (:recipient IS NULL
       OR EXISTS (SELECT 1 FROM json_each(operations.recipient_keys) r WHERE r.value = :recipient))
  AND (:since IS NULL OR created_at >= :since)
  AND (:before IS NULL OR (created_at, rowid) < (SELECT created_at, rowid FROM operations o WHERE o.id = :before))
ORDER BY created_at DESC, rowid DESC LIMIT :limit

-- name: count_by_state
SELECT state, COUNT(*) AS count FROM operations GROUP BY state

-- name: events_of
SELECT operation_id, at, from_state, to_state, actor, reason FROM events WHERE operation_id = :operation_id
ORDER BY id

-- name: record_event
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
VALUES (:operation_id, {now}, :from_state, :to_state, :actor, :reason)

-- name: insert_operation
-- The intent's parameters are `params.intent_values`.
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, lead, state, created_at, updated_at)
VALUES (:id, :idempotency_key, :tool, :channel, :recipients, :recipient_keys, :request, :request_fingerprint,
    :content_fingerprint, :sender, :campaign_id, :lead_id, :message_id, :batch_id, :lead, :state, {now}, {now})

-- name: insert_operation_recipients
-- One row per recipient key (the mailbox: `recipients.key_of`): what every rule about the same send compares.
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT o.id, r.value, o.content_fingerprint FROM operations o, json_each(o.recipient_keys) r WHERE o.id = :id

-- name: resolve_review
UPDATE operations SET state = :state, provider_id = COALESCE(:provider_id, provider_id),
    cancel_reason = COALESCE(:cancel_reason, cancel_reason), last_error = COALESCE(:last_error, last_error),
    may_have_left = :may_have_left, lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL,
    updated_at = {now}
WHERE id = :id AND state IN {reviewable}

-- name: link_resend
UPDATE operations SET resend_of = :resend_of WHERE id = :id

-- name: supersede
-- :id is the old operation, :resent_as the new one.
UPDATE operations SET state = 'cancelled', cancel_reason = :cancel_reason, resent_as = :resent_as, may_have_left = 1,
    lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL, updated_at = {now}
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
-- Unforwarded operations (of the batch, or of all: NULL) a recipient of which opted out of their channel.
SELECT id, state FROM operations
WHERE state IN {cancellable} AND (:batch_id IS NULL OR batch_id = :batch_id) AND EXISTS (
    SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
    WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))
ORDER BY rowid

-- name: cancel_operations
-- :ids is a JSON list.
UPDATE operations SET state = 'cancelled', cancel_reason = :reason, updated_at = {now}
WHERE id IN (SELECT value FROM json_each(:ids)) AND state IN {cancellable}
RETURNING id

-- name: insert_batch
INSERT INTO batches (id, name, created_by, created_at) VALUES (:batch_id, :name, :created_by, {now})

-- name: batch_name
SELECT name FROM batches WHERE id = :batch_id

-- name: batch_counts
SELECT state, COUNT(*) AS count FROM operations WHERE batch_id = :batch_id GROUP BY state

-- name: batch_unresolved
SELECT {columns} FROM operations WHERE batch_id = :batch_id AND state IN {unresolved}
ORDER BY created_at, rowid LIMIT 100

-- name: batch_held
-- The batch's `ready` sends held by an unresolved send (same_send.HOLDING) to one of their recipient keys on their
-- channel, or (:hold_lead) to their lead: what holds each (`held_by`). Walked from the unresolved sends, which are
-- few.
SELECT * FROM (
    SELECT {o_columns}, o.rowid AS position, h.id AS held_by
    FROM operations h INDEXED BY operations_by_state_created
    JOIN operation_recipients hr ON hr.operation_id = h.id
    JOIN operation_recipients r ON r.recipient = hr.recipient
    JOIN operations o ON o.id = r.operation_id
    WHERE h.state IN {holding} AND o.batch_id = :batch_id AND o.state = {claimable_state} AND o.channel = h.channel
    UNION ALL
    SELECT {o_columns}, o.rowid AS position, h.id AS held_by
    FROM operations h INDEXED BY operations_by_state_created JOIN operations o ON o.lead = h.lead
    WHERE :hold_lead AND h.state IN {holding} AND o.batch_id = :batch_id AND o.state = {claimable_state}
      AND o.id != h.id)
ORDER BY created_at, position LIMIT 100

-- name: list_batches
-- :after is the batch a page continues after.
SELECT b.id AS batch_id, b.name, b.created_at, o.state, COUNT(o.id) AS count
FROM (SELECT id, name, created_at FROM batches
      WHERE :after IS NULL OR (created_at, id) < (SELECT created_at, id FROM batches WHERE id = :after)
      ORDER BY created_at DESC, id DESC LIMIT :limit) AS b
LEFT JOIN operations AS o ON o.batch_id = b.id
GROUP BY b.id, o.state ORDER BY b.created_at DESC, b.id DESC

-- name: approve_batch
UPDATE operations SET state = 'ready', updated_at = {now} WHERE batch_id = :batch_id AND state IN {approvable}
RETURNING id

-- name: delivery_events_of
SELECT operation_id, state, occurred_at, recorded_at, source, detail FROM delivery_events
WHERE operation_id = :operation_id ORDER BY id

-- name: record_delivery_event
-- :occurred_at is an epoch, or NULL when the source gave no time.
INSERT INTO delivery_events (operation_id, state, occurred_at, recorded_at, source, detail)
VALUES (:operation_id, :state, :occurred_at, {now}, :source, :detail) ON CONFLICT (operation_id, state) DO NOTHING

-- name: set_delivery_state
UPDATE operations SET delivery_state = :delivery_state, delivery_at = COALESCE(:delivery_at, {now}),
    updated_at = {now}
WHERE id = :id

-- name: count_delivery_check
UPDATE operations SET delivery_checks = delivery_checks + 1, delivery_next_check_at = {now} + :next_check_seconds
WHERE id = :id

-- name: signature_seen
SELECT 1 FROM webhook_deliveries WHERE signature = :signature

-- name: claim_webhook
-- Counts a delivery id (and a signature) once: nothing when either was seen. The delivery state it carries and
-- when that happened (an epoch) are kept to apply it later when no operation has its message id yet.
INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, outcome, received_at, payload,
    delivery_state, occurred_at)
VALUES (:delivery_id, :signature, :event_type, :provider_id, 'pending', {now}, :payload, :delivery_state,
    :occurred_at)
ON CONFLICT DO NOTHING RETURNING delivery_id

-- name: settle_webhook
UPDATE webhook_deliveries SET outcome = :outcome, operation_id = :operation_id WHERE delivery_id = :delivery_id

-- name: lock_provider
-- Nothing to lock: SQLite's writes run one at a time (PostgreSQL's takes an advisory lock on the message id).
SELECT :provider_id

-- name: parked_count
-- Webhooks kept for a message id no operation had, received within the last :within_seconds.
SELECT COUNT(*) AS count FROM webhook_deliveries WHERE outcome = 'parked' AND received_at >= {now} - :within_seconds

-- name: parked_webhooks
-- Those kept for a message id (received within the last :within_seconds), in the order received.
SELECT delivery_id, delivery_state, occurred_at FROM webhook_deliveries
WHERE provider_id = :provider_id AND outcome = 'parked' AND received_at >= {now} - :within_seconds
ORDER BY received_at, delivery_id

-- name: prune_cutoff
SELECT {now} - :older_than_seconds

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
DELETE FROM webhook_deliveries WHERE received_at < {now} - :older_than_seconds

-- name: observe_tool
INSERT INTO upstream_tools (name, fingerprint, accepted_fingerprint, first_seen_at)
VALUES (:name, :fingerprint, :fingerprint, {now})
ON CONFLICT (name) DO UPDATE SET
    changed_at = CASE WHEN excluded.fingerprint = upstream_tools.fingerprint THEN upstream_tools.changed_at
                      ELSE {now} END,
    fingerprint = excluded.fingerprint

-- name: tool_pins
SELECT name, fingerprint, accepted_fingerprint, first_seen_at, changed_at FROM upstream_tools ORDER BY name

-- name: accept_tools
-- :names is a JSON list, or NULL for every changed tool.
UPDATE upstream_tools SET accepted_fingerprint = fingerprint, changed_at = NULL
WHERE fingerprint != accepted_fingerprint AND (:names IS NULL OR name IN (SELECT value FROM json_each(:names)))
RETURNING name

-- ---------------------------------------------------------------------------------------------------
-- The send path (hail_guard/ledger/sqlite.py), run in group commits.

-- name: expire_leases
UPDATE operations SET state = 'unknown', updated_at = {now}, next_check_at = {now}
WHERE state IN {expiring} AND lease_expires_at <= {now}
RETURNING id

-- name: opted_out
-- Whether any of these opt-out keys (a JSON list) opted out of the channel, or of all.
SELECT 1 FROM suppressions WHERE recipient IN (SELECT value FROM json_each(:keys)) AND channel IN (:channel, 'all')
LIMIT 1

-- name: operation_by_keys
-- The operation under the key, else under the key an earlier version derived for the same send (or NULL).
SELECT {columns} FROM operations WHERE idempotency_key IN (:idempotency_key, :legacy_key)
ORDER BY idempotency_key = :idempotency_key DESC LIMIT 1

-- name: matches
-- The same message to one of its recipient keys (a JSON list), under another key, of the same tool, whose senders
-- agree, in a state that blocks it (same_send.Rules.match_states): one of :always at any age, or one of :windowed
-- (or closed by an operator after it may have left, when :closed_block) first sent within :window_seconds.
SELECT {o_columns} FROM operation_recipients r JOIN operations o ON o.id = r.operation_id
WHERE r.content_fingerprint = :content_fingerprint AND r.recipient IN (SELECT value FROM json_each(:recipient_keys))
  AND o.idempotency_key != :idempotency_key AND o.tool = :tool
  AND (o.state IN (SELECT value FROM json_each(:always))
       OR ((o.state IN (SELECT value FROM json_each(:windowed)) OR (:closed_block AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - :window_seconds))
  AND NOT EXISTS (
    SELECT 1 FROM json_each(o.sender) a, json_each(:sender) b WHERE a.key = b.key AND a.value IS NOT b.value)
GROUP BY o.id ORDER BY o.created_at DESC, o.rowid DESC LIMIT 20

-- name: holds
-- Unresolved sends (same_send.HOLDING) to one of these recipient keys (a JSON list) on the channel, or to the lead
-- on any channel (NULL: leads are not held), oldest first.
SELECT * FROM (
    SELECT {o_columns}, o.rowid AS position FROM operation_recipients r JOIN operations o ON o.id = r.operation_id
    WHERE r.recipient IN (SELECT value FROM json_each(:recipient_keys)) AND o.channel = :channel
      AND o.state IN {holding}
    UNION
    SELECT {o_columns}, o.rowid AS position FROM operations o WHERE o.lead = :lead AND o.state IN {holding})
ORDER BY created_at, position LIMIT 5

-- name: near
-- Other messages (not this one) that one of these recipient keys has on the channel under another key, counted as
-- sent: waiting (same_send.WAITING) at any age, or settled (same_send.SETTLED_LIVE, or closed by an operator after it
-- may have left) first sent within :window_seconds; newest first, compared by similarity.
SELECT {o_columns} FROM operations o
WHERE o.id IN (
    SELECT operation_id FROM operation_recipients WHERE recipient IN (SELECT value FROM json_each(:recipient_keys)))
  AND o.channel = :channel AND o.content_fingerprint != :content_fingerprint AND o.idempotency_key != :idempotency_key
  AND (o.state IN {waiting}
       OR ((o.state IN {settled_live} OR o.may_have_left)
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - :window_seconds))
ORDER BY o.created_at DESC, o.rowid DESC LIMIT 20

-- name: insert_sending
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, lead, state, attempts, lease_owner,
    lease_expires_at, created_at, updated_at, first_sent_at)
VALUES (:id, :idempotency_key, :tool, :channel, :recipients, :recipient_keys, :request, :request_fingerprint,
    :content_fingerprint, :sender, :campaign_id, :lead_id, :message_id, :batch_id, :lead, 'sending', 1, :owner,
    {now} + :lease_seconds, {now}, {now}, {now})
RETURNING {columns}

-- name: claim_ready_by_id
-- :hold_lead: whether a lead's unresolved send holds it.
UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = :owner,
    lease_expires_at = {now} + :lease_seconds, updated_at = {now}, first_sent_at = COALESCE(first_sent_at, {now})
WHERE id = :id AND state IN {claimable} AND COALESCE(not_before, 0) <= {now} AND NOT EXISTS (
    SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
    WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))
      AND NOT EXISTS (  -- held: a recipient key has an unresolved send on the channel (same_send.HOLDING)
        SELECT 1 FROM operation_recipients mine
        JOIN operation_recipients theirs ON theirs.recipient = mine.recipient
        JOIN operations h ON h.id = theirs.operation_id
        WHERE mine.operation_id = operations.id AND h.id != operations.id AND h.channel = operations.channel
          AND h.state IN {holding})
      AND NOT (:hold_lead AND operations.lead IS NOT NULL AND EXISTS (  -- held: the lead has an unresolved send
        SELECT 1 FROM operations h WHERE h.lead = operations.lead AND h.id != operations.id AND h.state IN {holding}))
RETURNING {columns}

-- name: claim_ready_any
-- Walk the ready rows oldest first and stop at the first that may go. Without INDEXED BY, SQLite (no ANALYZE
-- statistics) picks operations_by_state, checks every ready row for opt-outs and sorts them all, so a drain of
-- N sends cost O(N^2) (seen by `python -m bench --only drain`). :hold_lead: whether a lead's unresolved send holds a
-- send.
UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = :owner,
    lease_expires_at = {now} + :lease_seconds, updated_at = {now}, first_sent_at = COALESCE(first_sent_at, {now})
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
      AND NOT (:hold_lead AND operations.lead IS NOT NULL AND EXISTS (  -- held: the lead has an unresolved send
        SELECT 1 FROM operations h WHERE h.lead = operations.lead AND h.id != operations.id AND h.state IN {holding}))
    ORDER BY created_at, rowid LIMIT :limit)
RETURNING {columns}

-- name: claim_ready_in_batch
UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = :owner,
    lease_expires_at = {now} + :lease_seconds, updated_at = {now}, first_sent_at = COALESCE(first_sent_at, {now})
WHERE id IN (
    SELECT id FROM operations INDEXED BY operations_ready_by_batch
    WHERE state = {claimable_state} AND batch_id = :batch_id AND COALESCE(not_before, 0) <= {now} AND NOT EXISTS (
        SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
        WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))
      AND NOT EXISTS (  -- held: a recipient key has an unresolved send on the channel (same_send.HOLDING)
        SELECT 1 FROM operation_recipients mine
        JOIN operation_recipients theirs ON theirs.recipient = mine.recipient
        JOIN operations h ON h.id = theirs.operation_id
        WHERE mine.operation_id = operations.id AND h.id != operations.id AND h.channel = operations.channel
          AND h.state IN {holding})
      AND NOT (:hold_lead AND operations.lead IS NOT NULL AND EXISTS (  -- held: the lead has an unresolved send
        SELECT 1 FROM operations h WHERE h.lead = operations.lead AND h.id != operations.id AND h.state IN {holding}))
    ORDER BY batch_id, created_at, rowid LIMIT :limit)
RETURNING {columns}

-- name: state_of
SELECT state FROM operations WHERE id = :id

-- name: provider_id_holder
-- Another operation (not :id) that holds the upstream's message id.
SELECT id FROM operations WHERE provider_id = :provider_id AND id != :id LIMIT 1

-- name: record_outcome
-- Fenced on the lease owner. :attempts_back counts the claim's attempt back when none was made.
UPDATE operations SET state = :state, provider_id = COALESCE(:provider_id, provider_id),
    result = COALESCE(:result, result), last_error = COALESCE(:error, last_error), review_reason = :review_reason,
    attempts = attempts - :attempts_back,
    not_before = CASE WHEN :not_before_seconds IS NULL THEN NULL ELSE {now} + :not_before_seconds END,
    next_check_at = CASE WHEN :check_after_seconds IS NULL THEN NULL ELSE {now} + :check_after_seconds END,
    lease_expires_at = NULL, updated_at = {now}
WHERE id = :id AND state IN {recordable} AND lease_owner = :owner
RETURNING {columns}

-- name: claim_unknown_due
UPDATE operations SET attempts = attempts + 1, lease_owner = :owner, lease_expires_at = {now} + :lease_seconds,
    updated_at = {now}
WHERE id IN (
    SELECT id FROM operations
    WHERE state = 'unknown' AND (:batch_id IS NULL OR batch_id = :batch_id) AND COALESCE(next_check_at, 0) <= {now}
      AND COALESCE(lease_expires_at, 0) <= {now}
    ORDER BY next_check_at LIMIT :limit)
RETURNING {columns}

-- name: claim_unknown_by_id
UPDATE operations SET attempts = attempts + 1, lease_owner = :owner, lease_expires_at = {now} + :lease_seconds,
    updated_at = {now}
WHERE id = :id AND state = 'unknown' AND (:batch_id IS NULL OR batch_id = :batch_id)
  AND COALESCE(lease_expires_at, 0) <= {now}
RETURNING {columns}

-- name: quick_check
PRAGMA quick_check

-- name: claim_delivery_checks
-- Accepted operations of these channels (a JSON list) with a provider id, whose delivery has not settled (in one of
-- the :settled states), first sent within :max_age_seconds and due: held :hold_seconds, :limit at most.
UPDATE operations SET delivery_next_check_at = {now} + :hold_seconds
WHERE id IN (
    SELECT id FROM operations
    WHERE state = 'accepted' AND provider_id IS NOT NULL AND channel IN (SELECT value FROM json_each(:channels))
      AND (delivery_state IS NULL OR delivery_state NOT IN (SELECT value FROM json_each(:settled)))
      AND COALESCE(delivery_next_check_at, 0) <= {now}
      AND COALESCE(first_sent_at, created_at) >= {now} - :max_age_seconds
    ORDER BY COALESCE(delivery_next_check_at, 0), created_at LIMIT :limit)
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
INSERT INTO hg_plan_stage (position, id, idempotency_key, tool, channel, recipients, recipient_keys, request,
    request_fingerprint, content_fingerprint, sender, campaign_id, lead_id, message_id, lead, allow_duplicate)
VALUES (:position, :id, :idempotency_key, :tool, :channel, :recipients, :recipient_keys, :request,
    :request_fingerprint, :content_fingerprint, :sender, :campaign_id, :lead_id, :message_id, :lead, :allow_duplicate)

-- name: staged_known_keys
SELECT p.position, p.idempotency_key, o.id, COUNT(*) OVER () AS taken
FROM hg_plan_stage p JOIN operations o ON o.idempotency_key = p.idempotency_key
ORDER BY p.position LIMIT 10

-- name: staged_repeat
-- The first staged send whose message an operation under another key already has for one of its recipient keys,
-- in a state that blocks it (as `matches`: `same_send.Rules.match_states`), of the staged sends that allow a
-- duplicate or of those that do not.
SELECT p.position FROM hg_plan_stage p, json_each(p.recipient_keys) pr
JOIN operation_recipients r ON r.content_fingerprint = p.content_fingerprint AND r.recipient = pr.value
JOIN operations o ON o.id = r.operation_id
WHERE p.allow_duplicate = :allow_duplicate AND o.idempotency_key != p.idempotency_key AND o.tool = p.tool
  AND (o.state IN (SELECT value FROM json_each(:always))
       OR ((o.state IN (SELECT value FROM json_each(:windowed)) OR (:closed_block AND o.may_have_left))
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - :window_seconds))
  AND NOT EXISTS (
    SELECT 1 FROM json_each(o.sender) a, json_each(p.sender) b WHERE a.key = b.key AND a.value IS NOT b.value)
ORDER BY p.position LIMIT 1

-- name: staged_near
-- Staged sends (positions :first to :last) and the other messages one of their recipient keys has on their channel
-- that count as sent (same_send.WAITING at any age; SETTLED_LIVE, or closed after it may have left, first sent within
-- :window_seconds), to compare by similarity; by position.
SELECT p.position, p.tool AS staged_tool, {o_columns}
FROM hg_plan_stage p, json_each(p.recipient_keys) pr
JOIN operation_recipients r ON r.recipient = pr.value
JOIN operations o ON o.id = r.operation_id
WHERE p.position BETWEEN :first AND :last AND NOT p.allow_duplicate AND o.channel = p.channel
  AND o.content_fingerprint != p.content_fingerprint AND o.idempotency_key != p.idempotency_key
  AND (o.state IN {waiting}
       OR ((o.state IN {settled_live} OR o.may_have_left)
           AND COALESCE(o.first_sent_at, o.created_at) >= {now} - :window_seconds))
ORDER BY p.position, o.created_at DESC

-- name: staged_intent
SELECT idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint, sender,
    campaign_id, lead_id, message_id, lead, allow_duplicate
FROM hg_plan_stage WHERE position = :position

-- name: plan_staged
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, lead, batch_id, state, created_at, updated_at)
SELECT id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, sender, campaign_id, lead_id, message_id, lead, :batch_id, :state, {now}, {now}
FROM hg_plan_stage ORDER BY position

-- name: plan_staged_recipients
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT p.id, r.value, p.content_fingerprint FROM hg_plan_stage p, json_each(p.recipient_keys) r

-- name: plan_staged_events
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
SELECT id, {now}, NULL, :state, :actor, :reason FROM hg_plan_stage ORDER BY position

-- ---------------------------------------------------------------------------------------------------
-- The operator console's reads (hail_guard.console): each walks an index (schema 7).

-- name: sends_by_hour
-- From an hour's start (an epoch): what first left in it and in each hour since, by state and delivery state
-- ('' none).
SELECT hour, state, delivery_state, count FROM sends_by_hour WHERE hour >= :since AND count <> 0 ORDER BY hour

-- name: count_in_state
SELECT COUNT(*) AS count FROM operations INDEXED BY operations_by_state_created WHERE state = :state

-- name: search_anchor
SELECT created_at, rowid AS position, idempotency_key FROM operations WHERE id = :id

-- A search: :key_low and :key_high are a key prefix's range, :since an epoch, :after_created_at, :after_position and
-- :after_key the operation to continue after. The filter named drives (its index, walked in order); the others are
-- checked on the rows it yields. Each search takes every parameter (one it has no use for is only read as NOT NULL).

-- name: search_by_key
SELECT {columns} FROM operations
WHERE idempotency_key >= :key_low AND idempotency_key < :key_high
  AND (:recipient IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = :recipient))
  AND (:batch_id IS NULL OR batch_id = :batch_id)
  AND (:campaign_id IS NULL OR campaign_id = :campaign_id)
  AND (:state IS NULL OR state = :state)
  AND (:since IS NULL OR created_at >= :since)
  AND idempotency_key > :after_key AND :after_created_at IS NOT NULL AND :after_position IS NOT NULL
ORDER BY idempotency_key LIMIT :limit

-- name: search_by_recipient
SELECT {columns} FROM operations
WHERE (:key_low IS NULL OR (idempotency_key >= :key_low AND idempotency_key < :key_high))
  AND id IN (SELECT operation_id FROM operation_recipients WHERE recipient = :recipient)
  AND (:batch_id IS NULL OR batch_id = :batch_id)
  AND (:campaign_id IS NULL OR campaign_id = :campaign_id)
  AND (:state IS NULL OR state = :state)
  AND (:since IS NULL OR created_at >= :since)
  AND created_at <= :after_created_at AND (created_at < :after_created_at OR rowid < :after_position)
  AND :after_key IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT :limit

-- name: search_by_batch
SELECT {columns} FROM operations INDEXED BY operations_by_batch
WHERE (:key_low IS NULL OR (idempotency_key >= :key_low AND idempotency_key < :key_high))
  AND (:recipient IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = :recipient))
  AND batch_id = :batch_id
  AND (:campaign_id IS NULL OR campaign_id = :campaign_id)
  AND (:state IS NULL OR state = :state)
  AND (:since IS NULL OR created_at >= :since)
  AND created_at <= :after_created_at AND (created_at < :after_created_at OR rowid < :after_position)
  AND :after_key IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT :limit

-- name: search_by_campaign
SELECT {columns} FROM operations INDEXED BY operations_by_campaign
WHERE (:key_low IS NULL OR (idempotency_key >= :key_low AND idempotency_key < :key_high))
  AND (:recipient IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = :recipient))
  AND (:batch_id IS NULL OR batch_id = :batch_id)
  AND campaign_id = :campaign_id
  AND (:state IS NULL OR state = :state)
  AND (:since IS NULL OR created_at >= :since)
  AND created_at <= :after_created_at AND (created_at < :after_created_at OR rowid < :after_position)
  AND :after_key IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT :limit

-- name: search_by_state
SELECT {columns} FROM operations INDEXED BY operations_by_state_created
WHERE (:key_low IS NULL OR (idempotency_key >= :key_low AND idempotency_key < :key_high))
  AND (:recipient IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = :recipient))
  AND (:batch_id IS NULL OR batch_id = :batch_id)
  AND (:campaign_id IS NULL OR campaign_id = :campaign_id)
  AND state = :state
  AND (:since IS NULL OR created_at >= :since)
  AND created_at <= :after_created_at AND (created_at < :after_created_at OR rowid < :after_position)
  AND :after_key IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT :limit

-- name: search_all
SELECT {columns} FROM operations INDEXED BY operations_by_created
WHERE (:key_low IS NULL OR (idempotency_key >= :key_low AND idempotency_key < :key_high))
  AND (:recipient IS NULL OR id IN (SELECT operation_id FROM operation_recipients WHERE recipient = :recipient))
  AND (:batch_id IS NULL OR batch_id = :batch_id)
  AND (:campaign_id IS NULL OR campaign_id = :campaign_id)
  AND (:state IS NULL OR state = :state)
  AND (:since IS NULL OR created_at >= :since)
  AND created_at <= :after_created_at AND (created_at < :after_created_at OR rowid < :after_position)
  AND :after_key IS NOT NULL
ORDER BY created_at DESC, rowid DESC LIMIT :limit

-- name: unsent_in_batch
SELECT id, state FROM operations WHERE batch_id = :batch_id AND state IN {cancellable} ORDER BY created_at, rowid

-- name: search_suppressions
-- :low and :high are a recipient prefix's range; a page continues after (:after_recipient, :after_channel).
SELECT recipient, channel, reason, source, created_at FROM suppressions
WHERE recipient >= :low AND recipient < :high AND (recipient, channel) > (:after_recipient, :after_channel)
ORDER BY recipient, channel LIMIT :limit

-- name: opt_out_cancelled
-- The recipient's sends, and its sub-addresses' (a range and a LIKE pattern), cancelled by an opt-out of the channel
-- (:cancel_like: how such a cancel reason reads).
SELECT {columns} FROM operations
WHERE id IN (
    SELECT operation_id FROM operation_recipients WHERE recipient = :recipient
    UNION
    SELECT operation_id FROM operation_recipients
    WHERE recipient >= :sub_low AND recipient < :sub_high AND recipient LIKE :sub_like ESCAPE '\')
  AND state = 'cancelled' AND NOT may_have_left AND cancel_reason LIKE :cancel_like
  AND (:channel = 'all' OR channel = :channel)
ORDER BY updated_at DESC LIMIT :limit

-- name: remember_tool_definition
INSERT INTO upstream_tool_definitions (fingerprint, definition) VALUES (:fingerprint, :definition)
ON CONFLICT DO NOTHING

-- name: start_session
-- :digest is a hash of the session id, :seconds how long it lasts.
INSERT INTO console_sessions (digest, name, created_at, expires_at) VALUES (:digest, :name, {now}, {now} + :seconds)

-- name: forget_sessions
DELETE FROM console_sessions WHERE expires_at <= {now}

-- name: find_session
SELECT name, created_at, expires_at FROM console_sessions WHERE digest = :digest AND expires_at > {now}

-- name: end_session
DELETE FROM console_sessions WHERE digest = :digest

-- name: record_heartbeat
-- :who is host:pid; :batch_id NULL for any batch.
INSERT INTO heartbeats (id, who, role, batch_id, started_at, seen_at)
VALUES (:id, :who, :role, :batch_id, {now}, {now})
ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at

-- name: forget_heartbeats
-- Those silent for :silent_seconds: their process ended without taking its row away.
DELETE FROM heartbeats WHERE seen_at < {now} - :silent_seconds

-- name: end_heartbeat
DELETE FROM heartbeats WHERE id = :id

-- name: heartbeats
SELECT id, who, role, batch_id, started_at, seen_at FROM heartbeats ORDER BY started_at, id

-- name: tool_definitions
SELECT fingerprint, definition FROM upstream_tool_definitions
WHERE fingerprint IN (SELECT value FROM json_each(:fingerprints))

-- ---------------------------------------------------------------------------------------------------
-- The migrations' backfills (hail_guard/ledger/backfill.py), in the transaction of the migration that needs them
-- (versions 6 and 9), on the tables as that version left them.

-- name: backfill_facts_rows
SELECT id, tool, channel, request FROM operations ORDER BY rowid

-- name: backfill_facts
UPDATE operations SET recipients = :recipients, recipient_keys = :recipient_keys,
    content_fingerprint = :content_fingerprint, sender = :sender
WHERE id = :id

-- name: backfill_keys_rows
SELECT id, channel, recipients, request, content_fingerprint FROM operations ORDER BY rowid

-- name: backfill_keys
UPDATE operations SET recipients = :recipients, recipient_keys = :recipient_keys, lead = :lead WHERE id = :id

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
