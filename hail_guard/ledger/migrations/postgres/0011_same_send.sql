-- hail-guard ledger (PostgreSQL), version 11: the same send by intent (hail_guard.same_send), as SQLite's 9.
-- `lead`: who a send is for in the caller's records (the profile's `lead` pointers, by default the metadata's
-- campaign_id and lead_id): while a send to a lead is unresolved, nothing new goes to that lead.
-- `operation_recipients` now holds each recipient's key (its mailbox: `recipients.key_of`), and recipients,
-- their keys and opt-outs are in the normal form of email-validator (IDNA 2008 with UTS 46, lower-cased, never
-- case-folded). The values of existing rows are recomputed from what they hold right after this script
-- (`hail_guard.ledger.backfill.renormalised`), in the same transaction. hg_begin_send's duplicate check took
-- advisory locks per message and recipient; it now takes them per recipient key and lead (hg_lock_key), as the
-- claims do (sql/postgres/claims.sql).
ALTER TABLE operations ADD COLUMN lead TEXT;
CREATE INDEX operations_by_lead ON operations (lead) WHERE lead IS NOT NULL;
DELETE FROM operation_recipients;
