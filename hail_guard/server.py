"""The downstream MCP server: the upstream's tools re-exposed, guarded ones routed through the guard.

Upstream tools pass through verbatim (names, descriptions, schemas, annotations, results). The tools
the profile guards (Hail's: every tool that takes an idempotency key) go through `Guard.send`, and are
listed taking `allow_duplicate` too (and hail-guard's own key, where the upstream takes none);
hail-guard's own tools are the entries of `tools.OWN` (the review queue only when the config exposes
it). Fail closed: a tool that sends (`profiles.sending`) which the profile neither guards nor names in
`pass_through` is refused, never forwarded; while the profile does not fit the upstream's tools
(`profiles.checking`: `misfits`), guarded sends are refused too (and `serve` does not start). A call's name
resolves to one route (`Proxy.routes`: own, guarded, refused or passed through); whatever it raises is
answered as `policy.failure_of` says. This is the only module that turns our errors into MCP
results (built by `views`).

`Proxy` holds one ledger and one upstream, and the guard and batches over them; every session of a
server shares it. It counts each call for `CallObserver` (metrics) under a small fixed set of
outcomes, read off what the route did (a guarded send's state, `replayed`), never off the answer.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, Protocol

import structlog
from mcp import types
from mcp.server import Server, ServerRequestContext

from hail_guard import __version__, keys, policy, views
from hail_guard.batch import Batches, Progress
from hail_guard.errors import BadInput, RefusedByPolicy, UpstreamError
from hail_guard.guard import Guard, GuardSettings, SendReport, UpstreamCaller
from hail_guard.ledger import Ledger
from hail_guard.models import State
from hail_guard.profiles import Profile, sending
from hail_guard.profiles.checking import CHECK_COMMAND, Finding, check, unguarded_senders
from hail_guard.tools import Context, OwnTool, listed_as_guarded, offered

log = structlog.get_logger(__name__)

_GUARD_FIELDS = frozenset({"operation_id", "idempotency_key", "state", "replayed", "next_step", "not_before"})
"""What a guarded send's answer says of the operation, under `hail_guard`."""


class UpstreamTools(UpstreamCaller, Protocol):
    """The one upstream a proxy talks to (`hail_guard.upstream.Upstream`): the guard's calls, and its tools."""

    @property
    def connected(self) -> bool:
        """True while a connection to Hail is up (readiness probes read it)."""

    @property
    def sign_in_problem(self) -> str | None:
        """Why an operator must run `hail-guard login` before anything is sent; None: no need."""

    async def list_tools(self) -> list[types.Tool]: ...


class CallObserver(Protocol):
    """Told about every tool call the proxy serves (metrics); must not raise or block."""

    def tool_called(self, tool: str, outcome: str, seconds: float) -> None: ...


@dataclass(frozen=True)
class Answered:
    """What a route answered, and how the call is counted."""

    result: types.CallToolResult
    outcome: str
    """The metric label: a guarded send's state (or `replayed`), else `ok` / `error`."""


Route = Callable[[str, dict[str, Any], Progress | None], Awaitable[Answered]]


@dataclass
class Proxy:
    """Everything one hail-guard server needs; shared by all its sessions. It gives the ledger to the parts it
    makes (the guard, the batches, the handlers' `Context`) and keeps none of it for anyone else to use."""

    ledger: InitVar[Ledger]
    upstream: UpstreamTools
    settings: GuardSettings = field(default_factory=GuardSettings)
    guarded_tools: Sequence[str] | None = None
    """Tools to guard; None: those the profile guards (`settings.profile`)."""
    require_approval: bool = False
    observer: CallObserver | None = None
    pin_tools: bool = False
    """Refuse a guarded tool whose name, description or schemas changed since it was accepted."""
    expose_review: bool = False
    """Offer the review queue to the agent (`[review] expose_to_agent`)."""
    record_tools: bool = True
    """Record the upstream's tools in the ledger, for pinning; off for the drill, whose sandbox is not Hail."""
    tools: dict[str, types.Tool] = field(default_factory=dict)
    """The upstream's tools, verbatim."""
    guarded: set[str] = field(default_factory=set)
    changed: set[str] = field(default_factory=set)
    """Upstream tools that differ from what was accepted (`hail-guard upstream accept`)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Tools that send but that the profile neither guards nor lets pass, and why (fail closed)."""
    misfits: list[Finding] = field(default_factory=list)
    """Where the profile does not fit the upstream's tools (`profile check`'s errors); guarded sends wait."""
    listing_failed: UpstreamError | None = None
    """Why the upstream's tools could not be listed, while they never were."""
    _fingerprints: dict[str, str] = field(default_factory=dict)
    _unlisted: set[str] = field(default_factory=set)
    guard: Guard = field(init=False)
    batches: Batches = field(init=False)
    _ledger: Ledger = field(init=False, repr=False)
    _context: Context = field(init=False, repr=False)

    def __post_init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.guard = Guard(ledger, self.upstream, self.settings)
        self.batches = Batches(
            ledger,
            self.guard,
            self.guarded_schema,
            require_approval=self.require_approval,
            hold_lead=self.settings.hold_lead_across_channels,
        )
        self._context = Context(ledger, self.guard, self.batches, self.know_tools, self.region)

    def guarded_schema(self, name: str) -> dict[str, Any] | None:
        tool = self.tools.get(name) if name in self.guarded else None
        return dict(tool.input_schema) if tool is not None else None

    @property
    def profile(self) -> Profile:
        """The upstream's contract this proxy guards by (`GuardSettings.profile`)."""
        return self.settings.profile

    @property
    def region(self) -> str | None:
        """Where a phone number without its country code is read (`[guard] default_region`)."""
        return self.settings.default_region

    @property
    def upstream_name(self) -> str:
        """How every text names the upstream: the profile's display name."""
        return self.settings.profile.display_name

    def own_tools(self) -> dict[str, OwnTool]:
        """hail-guard's own tools, the review queue included when it is exposed."""
        return offered(review=self.expose_review, upstream=self.upstream_name)

    def listed_tools(self) -> list[types.Tool]:
        """What the agent sees: upstream tools verbatim (guarded ones also take allow_duplicate), then ours."""
        return [self._as_listed(tool) for tool in self.tools.values()] + [own.tool for own in self.own_tools().values()]

    def _as_listed(self, tool: types.Tool) -> types.Tool:
        return listed_as_guarded(tool, self.guard.spec(tool.name)) if tool.name in self.guarded else tool

    def input_schema(self, name: str) -> dict[str, Any] | None:
        own = self.own_tools().get(name)
        tool = own.tool if own is not None else self.tools.get(name)
        return dict(self._as_listed(tool).input_schema) if tool is not None else None

    def routes(self) -> dict[str, Route]:
        """Every tool an agent may call now, by name, and what answers it."""
        upstream = {name: self._route_of(name) for name in self.tools}
        own = {name: functools.partial(self._own, entry) for name, entry in self.own_tools().items()}
        return {**upstream, **own}

    def _route_of(self, name: str) -> Route:
        if name in self.guarded:
            return self._guarded
        return self._refused if name in self.refused else self._passed

    async def know_tools(self) -> None:
        if not self.tools:
            await self.refresh_tools()

    async def refresh_tools(self) -> None:
        try:
            listed = await self.upstream.list_tools()
        except UpstreamError as exc:
            log.warning("upstream_tools_unavailable", error=str(exc))
            self.listing_failed = exc if not self.tools else None
            return
        self.listing_failed = None
        own = self.own_tools()
        shadowed = [tool.name for tool in listed if tool.name in own]
        if shadowed:
            log.warning("upstream_tools_shadowed", tools=shadowed)
        self.tools = {tool.name: tool for tool in listed if tool.name not in own}
        schemas = {name: tool.input_schema for name, tool in self.tools.items()}
        profile = self.settings.profile
        self.guarded = profile.guarded(schemas, self.guarded_tools)
        self.guard.know_schemas({name: schemas[name] for name in self.guarded})
        self._fit(listed)
        wanted = profile.tools if self.guarded_tools is None else self.guarded_tools
        self._warn_unlisted(set(wanted) - set(self.tools))
        await self._observe(self.tools)

    def _fit(self, listed: Sequence[types.Tool]) -> None:
        """Hold the profile against the tools listed: refuse the senders it forgets, note where it misfits."""
        profile = self.settings.profile
        senders = unguarded_senders(profile, self.tools.values(), self.guarded)
        refused = {tool.name: sending.why_it_sends(tool) for tool in senders}
        if refused and set(refused) != set(self.refused):
            log.warning("unguarded_senders_refused", tools=sorted(refused), profile=profile.source)
        self.refused = refused
        misfits = [finding for finding in check(profile, listed) if finding.level == "error" and not finding.per_call]
        if misfits and misfits != self.misfits:
            log.error("profile_does_not_fit", profile=profile.source, misfits=[f"{f.where}: {f.what}" for f in misfits])
        self.misfits = misfits

    def misfit_text(self) -> str | None:
        """The profile's misfits in words, and the command that checks them; None when it fits."""
        if not self.misfits:
            return None
        said = "; ".join(f"{finding.where}: {finding.what}" for finding in self.misfits)
        source = self.settings.profile.source
        return (
            f"the profile {source} does not fit {self.upstream_name}'s tools ({said}); check it with "
            f"`{CHECK_COMMAND.replace('PROFILE', source)}` and fix it"
        )

    def _warn_unlisted(self, unlisted: set[str]) -> None:
        """A tool to guard that the upstream does not list (a misspelt name, a server of another version)."""
        if unlisted and unlisted != self._unlisted:
            log.warning(
                "guarded_tools_not_listed",
                tools=sorted(unlisted),
                profile=self.settings.profile.source,
                hint="the upstream lists no tool of these names; check them with hail-guard profile check",
            )
        self._unlisted = unlisted

    async def _observe(self, tools: Mapping[str, types.Tool]) -> None:
        """Compare each tool with what was accepted; the ledger is written only when something moved."""
        if not self.record_tools:
            return
        definitions = {name: tool_definition(tool) for name, tool in tools.items()}
        fingerprints = {name: keys.fingerprint(text) for name, text in definitions.items()}
        if fingerprints == self._fingerprints:
            return
        await self._ledger.remember_tool_definitions({fingerprints[name]: definitions[name] for name in tools})
        pins = await self._ledger.observe_tools(fingerprints)
        self._fingerprints = fingerprints
        self.changed = {pin.name for pin in pins if pin.changed and pin.name in fingerprints}
        if self.changed:
            log.warning("upstream_tools_changed", tools=sorted(self.changed), refused=self.pin_tools)

    async def call(
        self, name: str, arguments: dict[str, Any], progress: Progress | None = None
    ) -> types.CallToolResult:
        """One tool call, with every error of ours turned into a clear MCP result; observed."""
        started, outcome = time.monotonic(), "cancelled"
        try:
            with structlog.contextvars.bound_contextvars(tool=_label(name)), policy.naming(self.upstream_name):
                answered = await self._answer(name, arguments, progress)
            outcome = answered.outcome
            return answered.result
        finally:
            if self.observer is not None:
                known = name if name in self.routes() else "unknown"
                self.observer.tool_called(known, outcome, time.monotonic() - started)

    async def _answer(self, name: str, arguments: dict[str, Any], progress: Progress | None) -> Answered:
        try:
            route = await self._route(name)
            return await route(name, arguments, progress)
        except Exception as exc:  # the per-call boundary: every error becomes an answer; cancellation passes
            failure = policy.failure_of(exc)
            if failure.crashed:
                log.exception("call_crashed", tool=_label(name))
            elif failure.logged:
                log.error(
                    "call_failed", tool=_label(name), error=str(exc)
                )  # the operator's detail; the agent's may be generic
            return Answered(views.error_result(failure.message, failure.details), "error")

    async def _route(self, name: str) -> Route:
        route = self.routes().get(name)
        if route is None and not self.tools:  # the upstream's tools were never listed: list them first
            await self.refresh_tools()
            route = self.routes().get(name)
        if route is None and self.listing_failed is not None:
            raise self.listing_failed  # not an unknown tool: the upstream never said what it has
        if route is None:
            raise BadInput(f"unknown tool {_quoted(name)}; list the tools to see what hail-guard offers")
        return route

    async def _own(self, entry: OwnTool, name: str, arguments: dict[str, Any], progress: Progress | None) -> Answered:
        policy.validate_arguments(name, arguments, entry.tool.input_schema)
        await self._ledger.expire_leases()  # what the agent sees is what is true now
        return _plain(await entry.run(self._context, arguments, progress))

    async def _guarded(self, name: str, arguments: dict[str, Any], progress: Progress | None) -> Answered:
        if (misfit := self.misfit_text()) is not None:
            raise RefusedByPolicy(f"hail-guard refuses {name} while {misfit}; nothing was sent")
        await self._refuse_if_changed(name)
        schema = self.tools[name].input_schema
        report = await self.guard.send(name, arguments, schema)
        return Answered(_send_result(report), "replayed" if report.replayed else report.operation.state.value)

    async def _refused(self, name: str, arguments: dict[str, Any], progress: Progress | None) -> Answered:
        raise RefusedByPolicy(
            f"hail-guard refuses {name}: {self.refused[name]}, so it may message someone, and the profile "
            f"({self.settings.profile.source}) neither guards it nor lets it pass; nothing was sent. An operator "
            "adds it to the profile (`hail-guard profile check` names it)"
        )

    async def _passed(self, name: str, arguments: dict[str, Any], progress: Progress | None) -> Answered:
        return _plain(await self.upstream.call_tool(name, arguments, timeout_seconds=self.settings.timeout_seconds))

    async def _refuse_if_changed(self, name: str) -> None:
        if not (self.pin_tools and name in self.changed):
            return
        pins = await self._ledger.tool_pins()  # an operator may have accepted it since
        self.changed = {pin.name for pin in pins if pin.changed and pin.name in self._fingerprints}
        if name in self.changed:
            raise RefusedByPolicy(
                f"the upstream changed {name} (its description or schema) since it was accepted; nothing was "
                f"sent. An operator reviews the change and runs `hail-guard upstream accept {name}`"
            )


MAX_SHOWN_NAME = 64
"""Characters of a tool name an answer or a log repeats: an agent's name is text from outside."""


def _quoted(name: str) -> str:
    """`name` as an answer quotes it: escaped, at most `MAX_SHOWN_NAME` characters of it."""
    cut = f" (cut from {len(name)} characters)" if len(name) > MAX_SHOWN_NAME else ""
    return repr(name[:MAX_SHOWN_NAME]) + cut


def _label(name: str) -> str:
    """`name` as a log names the call: itself when short and printable, else quoted."""
    return name if len(name) <= MAX_SHOWN_NAME and name.isprintable() else _quoted(name)


def _plain(result: types.CallToolResult) -> Answered:
    return Answered(result, "error" if result.is_error else "ok")


def _send_result(report: SendReport) -> types.CallToolResult:
    """A guarded send's answer: the upstream's own record when it has one, else what happened and the next step."""
    operation = report.operation
    view = views.operation_view(operation, replayed=report.replayed)
    guard_view = {key: value for key, value in view.items() if key in _GUARD_FIELDS}
    if operation.state is State.ACCEPTED:
        return views.data_result({**(operation.result or {}), "hail_guard": guard_view})
    if operation.state is State.FAILED:
        payload = operation.result if operation.result is not None else {"error": operation.last_error}
        return views.data_result({**payload, "hail_guard": guard_view})
    said = f"{policy.headline(operation)} {policy.sentence(guard_view['next_step'])}."
    return views.error_result(said, {"hail_guard": guard_view})


def tool_definition(tool: types.Tool) -> str:
    """What pinning compares, as canonical JSON: name, description and schemas (kept, to show a change)."""
    shape = {
        "name": tool.name,
        "description": tool.description,
        "input_schema": tool.input_schema,
        "output_schema": tool.output_schema,
    }
    return keys.canonical_json(shape)


def build_server(proxy: Proxy) -> Server[Any]:
    """A low-level MCP server over `proxy` (one per session on stdio; the proxy may be shared)."""

    async def on_list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        await proxy.refresh_tools()
        return types.ListToolsResult(tools=proxy.listed_tools())

    async def on_call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        async def progress(done: int, total: int | None) -> None:
            await ctx.session.report_progress(done, total, f"{done} sent")

        return await proxy.call(params.name, dict(params.arguments or {}), progress)

    return Server(
        "hail-guard",
        version=__version__,
        instructions=(
            f"hail-guard stands in front of {proxy.upstream_name}: sends are recorded before they are forwarded "
            "and never sent twice. When a send's outcome is unknown, do NOT resend it: call `reconcile`."
        ),
        get_tool_input_schema=proxy.input_schema,
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )
