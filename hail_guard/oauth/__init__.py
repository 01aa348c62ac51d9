"""Signing in to an upstream that uses OAuth (hosted Hail) instead of an API key.

    hail-guard login [--upstream URL]     # once, by a person: `login.login`
    hail-guard serve                      # uses it: `renewal.SignIn` renews the tokens, never asks anyone

Modules: `store` (one private file per upstream, and the lock shared by every process using it),
`login` (the interactive sign-in and `logout`), `loopback` (the receiver of the browser's redirect),
`renewal` (`SignIn`, the credentials `upstream` presents).
The OAuth protocol itself is the MCP SDK's (`mcp.client.auth`); nothing here re-implements it.
"""

from hail_guard.oauth.login import login, logout
from hail_guard.oauth.renewal import LOGIN_NEEDED, SignIn
from hail_guard.oauth.store import SignInRecord, TokenStore, default_folder, upstream_key

__all__ = ["LOGIN_NEEDED", "SignIn", "SignInRecord", "TokenStore", "default_folder", "login", "logout", "upstream_key"]
