"""hail-guard: an MCP proxy in front of Hail that makes every email, SMS and call happen at most once."""

__version__ = "0.1.0"
