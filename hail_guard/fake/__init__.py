"""Generic fake upstreams: MCP servers that send, read back and list messages, with the sandbox's faults
and outbox, for every upstream hail-guard guards but Hail (whose fake is `hail_guard.sandbox`).

- `surfaces`: what a fake shows and how it words its answers (`Surface`, plain data).
- `servers`: hand-written fakes of real servers' public tool schemas (Resend's, AgentMail's).
- `engine`: `FakeUpstream`, the fake itself: messages, keys, faults, outbox; in process or over a transport.

The fakes read no hail-guard settings or profiles: they take what they need as data (`Surface`).
`hail_guard.cli.fake` is `hail-guard fake` and its `from_profile`, the fake a profile describes.

    fake = FakeUpstream(from_profile(load_profile("examples/chat.toml")), faults=[...])  # cli.fake.from_profile
    async with mcp.Client(fake.server(), mode="legacy") as client: ...
"""

from hail_guard.fake.engine import FakeUpstream
from hail_guard.fake.surfaces import Get, Lister, Send, Surface

__all__ = ["FakeUpstream", "Get", "Lister", "Send", "Surface"]
