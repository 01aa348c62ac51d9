-- hail-guard ledger, version 3: what each upstream tool looked like when it was accepted.
CREATE TABLE upstream_tools (
    name                 TEXT PRIMARY KEY,
    fingerprint          TEXT NOT NULL,          -- of name, description and schemas, as last seen
    accepted_fingerprint TEXT NOT NULL,          -- as last accepted (first seen, or `upstream accept`)
    first_seen_at        REAL NOT NULL,
    changed_at           REAL                    -- when `fingerprint` last moved away from accepted
);
