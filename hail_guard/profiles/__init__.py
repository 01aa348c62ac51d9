"""Upstream profiles: an upstream's contract as data (docs/explanation/layout.md).

A profile says which of an upstream's tools are guarded and, for each, its channel, where its recipients
and its message are, the key argument if the upstream takes one, where an answer carries the upstream's
id, how to read a send back (`lookup`) and how to find it when no id came back (`search`), how answers
are sorted (`[answers]`) and which argument rules apply (`rules`). `hail` is the built-in default and
the only place that knows Hail; `resend` and `agentmail` ship too, and any TOML file is one.

- `model`: the file as written (pydantic, strict); `spec`: the `Profile` the guard reads and each tool's
  `ToolSpec`, and how answers are read; `loading`: built-in names and files, with errors naming the key;
  `drafting` and `checking`: `hail-guard profile init` and `profile check`, over an upstream's tool list.
"""

from __future__ import annotations

from hail_guard.profiles.loading import BUILT_IN, DEFAULT, built_in, load_profile, parse_profile
from hail_guard.profiles.model import PROVIDER_ID, SINCE, Lookup, Match, ProfileData, Rule, Search
from hail_guard.profiles.spec import (
    ALLOW_DUPLICATE,
    DEFAULT_RECIPIENTS,
    DEFAULT_TIMES,
    KEY_FIELD,
    FilledArguments,
    Profile,
    ToolSpec,
    read_answer,
    read_arguments,
    read_items,
)


def hail() -> Profile:
    """The built-in `hail` profile (the default)."""
    return built_in(DEFAULT)


__all__ = [
    "ALLOW_DUPLICATE",
    "BUILT_IN",
    "DEFAULT",
    "DEFAULT_RECIPIENTS",
    "DEFAULT_TIMES",
    "KEY_FIELD",
    "PROVIDER_ID",
    "SINCE",
    "FilledArguments",
    "Lookup",
    "Match",
    "Profile",
    "ProfileData",
    "Rule",
    "Search",
    "ToolSpec",
    "built_in",
    "hail",
    "load_profile",
    "parse_profile",
    "read_answer",
    "read_arguments",
    "read_items",
]
