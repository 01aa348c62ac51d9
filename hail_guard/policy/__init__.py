"""Pure decisions: what the upstream's answer means, what state follows, what is refused up front, what an
agent is told. No I/O anywhere in the package; every other part of hail-guard asks here. Every text names
the upstream by the profile's display name (`upstream_name`, set with `naming`).

- `outcomes`: an upstream's answers classified by its profile, the state that follows a first attempt or a
  replay, reconcile's next step (docs/explanation/hail.md, "How hail-guard sorts an answer";
  docs/explanation/states.md).
- `arguments`: what a send's arguments must be before anything is recorded (the schema, the profile's
  rules: Hail's own, consent).
- `repeats`: what a send that repeats one the ledger holds is answered (`same_send` decides), and whether a
  message an upstream lists is an operation's (`sighting`).
- `answers`: what an agent is told: states in words, the one next step, headlines, every failure.
- `operator`: review resolutions, resends, opt-outs and pruning, and the texts they write.

`repeats` words its refusals with `answers`, and every module names the upstream with
`answers.upstream_name`. Each reads the tool's profile (`hail_guard.profiles.ToolSpec`) where the
upstream's contract matters. Callers use the names below.
"""

from __future__ import annotations

from hail_guard.policy.answers import (
    CRASHED,
    LEDGER_UNAVAILABLE,
    Failure,
    failure_of,
    headline,
    naming,
    next_step,
    operator_step,
    sentence,
    state_phrase,
    upstream_name,
)
from hail_guard.policy.arguments import (
    check_rules,
    differing_fields,
    validate_arguments,
)
from hail_guard.policy.operator import (
    REVIEW_RESOLUTIONS,
    WEBHOOK_DEDUPE_SECONDS,
    ResendTexts,
    check_review_decision,
    found_in_upstream,
    not_in_review,
    prune_age_seconds,
    resend_key_taken,
    resend_texts,
    review_decision_text,
    suppression_reason,
)
from hail_guard.policy.outcomes import (
    CHECK_AGAIN_SECONDS,
    DEFAULT_RETRY_AFTER_SECONDS,
    NO_KEY,
    RETENTION_MARGIN_SECONDS,
    ReconcilePlan,
    ReconcileStep,
    answer_of_failure,
    classify,
    declared_fields,
    lookup_failed,
    outcome_of_replay,
    outcome_of_search,
    outcome_of_send,
    plan_reconcile,
    provider_id_taken,
    replay_not_made,
)
from hail_guard.policy.repeats import (
    SIGHTING_MARGIN_SECONDS,
    Sighted,
    already_planned,
    decide,
    key_conflict,
    meaning_differences,
    refusal,
    sighting,
    suppressed_refusal,
)

__all__ = [
    "CHECK_AGAIN_SECONDS",
    "CRASHED",
    "DEFAULT_RETRY_AFTER_SECONDS",
    "LEDGER_UNAVAILABLE",
    "NO_KEY",
    "RETENTION_MARGIN_SECONDS",
    "REVIEW_RESOLUTIONS",
    "SIGHTING_MARGIN_SECONDS",
    "WEBHOOK_DEDUPE_SECONDS",
    "Failure",
    "ReconcilePlan",
    "ReconcileStep",
    "ResendTexts",
    "Sighted",
    "already_planned",
    "answer_of_failure",
    "check_review_decision",
    "check_rules",
    "classify",
    "decide",
    "declared_fields",
    "differing_fields",
    "failure_of",
    "found_in_upstream",
    "headline",
    "key_conflict",
    "lookup_failed",
    "meaning_differences",
    "naming",
    "next_step",
    "not_in_review",
    "operator_step",
    "outcome_of_replay",
    "outcome_of_search",
    "outcome_of_send",
    "plan_reconcile",
    "provider_id_taken",
    "prune_age_seconds",
    "refusal",
    "replay_not_made",
    "resend_key_taken",
    "resend_texts",
    "review_decision_text",
    "sentence",
    "sighting",
    "state_phrase",
    "suppressed_refusal",
    "suppression_reason",
    "upstream_name",
    "validate_arguments",
]
