"""The operator console: the review queue, campaigns and every send's story, in a browser.

Served at `/console` beside `/mcp` by `hail-guard serve --transport http` (`web` mounts
`console_routes`), or alone on loopback by `hail-guard console` (`command`). Operators sign in with
their own token or a one-time link (`auth`); the pages (`pages`) read the ledger through its
protocol only (`reads`), and every decision (`actions`) goes through the function the CLI and the
agent's tools use. Server-rendered Jinja2 with autoescape; htmx (vendored in `static/`) only
refreshes a campaign's progress; charts are SVG drawn on the server (`chart`).
"""
