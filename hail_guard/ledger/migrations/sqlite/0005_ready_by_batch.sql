-- hail-guard ledger (SQLite), version 5: claiming a batch's next send without walking other batches.
-- A claim for one batch (`worker --batch`, `batch run`) wants its oldest `ready` send. Walking
-- `operations_ready` (every batch's ready sends, oldest first), it stepped past the older ready sends
-- of other batches on every claim. Ordered by batch, a claim reads a row or two.
CREATE INDEX operations_ready_by_batch ON operations (batch_id, created_at) WHERE state = 'ready';
