-- hail-guard ledger (PostgreSQL), version 4: delivery after acceptance, processed webhooks, and
-- operator resends.
-- The current delivery state of an operation (its `state` never changes because of delivery).
ALTER TABLE operations ADD COLUMN delivery_state TEXT;
ALTER TABLE operations ADD COLUMN delivery_at TIMESTAMPTZ;             -- when that state happened
ALTER TABLE operations ADD COLUMN delivery_checks INTEGER NOT NULL DEFAULT 0;   -- polls made
ALTER TABLE operations ADD COLUMN delivery_next_check_at TIMESTAMPTZ;  -- the next poll, or a tracker's hold
-- An operator's resend: the new operation names the old one, the old one names the new one.
ALTER TABLE operations ADD COLUMN resend_of TEXT;
ALTER TABLE operations ADD COLUMN resent_as TEXT;
CREATE INDEX operations_by_provider ON operations (provider_id) WHERE provider_id IS NOT NULL;
CREATE INDEX operations_delivery_due ON operations (delivery_next_check_at) WHERE state = 'accepted';

-- Each delivery state an operation reached, once, with its time and where it was learnt.
CREATE TABLE delivery_events (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id TEXT NOT NULL REFERENCES operations (id),
    state        TEXT NOT NULL,
    occurred_at  TIMESTAMPTZ,               -- as the source said (NULL: it gave no time)
    recorded_at  TIMESTAMPTZ NOT NULL,
    source       TEXT NOT NULL,             -- poll | webhook
    detail       TEXT,                      -- the tool polled, or the webhook delivery id
    UNIQUE (operation_id, state)
);

-- Every verified webhook, once per X-Hail-Delivery; its signature, so a replay is recognised.
CREATE TABLE webhook_deliveries (
    delivery_id  TEXT PRIMARY KEY,
    signature    TEXT NOT NULL UNIQUE,
    event_type   TEXT NOT NULL,
    provider_id  TEXT,
    operation_id TEXT,
    outcome      TEXT NOT NULL,             -- applied | opted_out | unknown_operation | ignored
    received_at  TIMESTAMPTZ NOT NULL,
    payload      TEXT NOT NULL              -- the body as received
);
CREATE INDEX webhook_deliveries_by_time ON webhook_deliveries (received_at);
