-- hail-guard ledger (PostgreSQL), version 5: claiming a batch's next send without sorting the batch.
-- A claim for one batch (`worker --batch`, `batch run`) wants its oldest `ready` send. With only
-- (batch_id, state) to go by, PostgreSQL fetched every ready send of the batch, checked each against
-- the opt-out list and sorted them, for every claim: a 5,000-send batch cost ~12 ms a claim, and
-- draining a batch grew with the square of its size. Ordered by batch, a claim reads a row or two.
CREATE INDEX operations_ready_by_batch ON operations (batch_id, created_at, seq) WHERE state = 'ready';
