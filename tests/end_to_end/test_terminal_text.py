"""Text from the ledger reaches an operator's terminal as text: no markup, no escape sequence, in every command.

Recipients, keys, reasons, batch names, opt-out sources and tool names are written, in the end, by
an agent or by Hail. Each command that prints them runs here on a ledger full of rich markup
(`[/]`, which makes rich raise) and of an OSC sequence that retitles the terminal, with stdout a
terminal (rich draws its own styles then) and not.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from hail_guard import keys, same_send
from hail_guard.cli import main
from hail_guard.cli.drill import print_report
from hail_guard.drill import DrillOptions, DrillReport, ScenarioResult
from hail_guard.guard import claim_token
from hail_guard.ledger import open_ledger
from hail_guard.models import Intent, Outcome, State, Suppression
from hail_guard.profiles import hail

MARKUP = "[/]"
OSC = "\x1b]0;OWNED\x07"
"""Sets the terminal's title: harmless here, but any sequence could have been."""
SHOWN_OSC = "\\x1b]0;OWNED\\x07"
KEY = f"hostile{MARKUP}[bold]key"
"""Keys are printable (the guard refuses others), but markup is printable."""
RECIPIENTS = (f"{MARKUP}m@example.com", f"{OSC}x@example.com")
OTHERS = (f"{MARKUP}n@example.com", f"{OSC}y@example.com")
"""The second send's: one claim takes one send per recipient (an unresolved send holds its recipients)."""
REASON = f"{MARKUP} {OSC} [bold red]not bold[/bold red]"
BATCH_NAME = f"{MARKUP}spring{OSC}"
TOOL = f"evil{OSC}"


class Terminal(io.StringIO):
    """stdout (or stdin) as a terminal: rich styles its output, `isatty` is true."""

    def isatty(self) -> bool:
        return True


def intent(key: str, index: int, recipients: tuple[str, ...] = RECIPIENTS) -> Intent:
    arguments = {
        "to": list(recipients),
        "subject": "Hi",
        "body_text": f"Hello {index}",
        "recipient_consent": True,
        "idempotency_key": key,
    }
    text = keys.canonical_json(arguments)
    return Intent(
        idempotency_key=key,
        tool="send_email",
        channel="email",
        recipients=recipients,
        request=text,
        request_fingerprint=keys.fingerprint(text),
        content_fingerprint=same_send.content_fingerprint(hail().spec("send_email"), arguments),
        campaign_id=BATCH_NAME,
        batch_id="batch-hostile",
    )


async def seed(url: str) -> None:
    """A batch with a hostile name: one send in review (hostile key, recipients, reason), one unknown."""
    async with open_ledger(url) as ledger:
        await ledger.plan_batch(
            batch_id="batch-hostile",
            name=BATCH_NAME,
            intents=iter([intent(KEY, 1), intent(f"{KEY}-2", 2, OTHERS)]),
            state=State.READY,
            actor=REASON,
        )
        owner = claim_token()
        first, second = await ledger.claim_ready(owner=owner, lease_seconds=60, batch_id="batch-hostile", limit=2)
        review = Outcome(state=State.NEEDS_REVIEW, reason=REASON, review_reason=REASON)
        await ledger.record_outcome(first.id, owner=owner, outcome=review, actor=REASON)
        await ledger.record_outcome(
            second.id, owner=owner, outcome=Outcome(state=State.UNKNOWN, reason=REASON), actor="x"
        )
        opt_out = Suppression(recipient=RECIPIENTS[0], channel="email", reason=REASON, source=OSC)
        await ledger.add_suppression(opt_out, actor=REASON)
        await ledger.observe_tools({TOOL: "one look"})
        await ledger.observe_tools({TOOL: "another look"})  # changed: `status` names it


@pytest.fixture
def hostile_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    config = tmp_path / "hail-guard.toml"
    config.write_text(f'[ledger]\nurl = "{url}"\n[delivery]\npoll = false\n[log]\nlevel = "error"\n')
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(config))
    anyio.run(seed, url)
    return url


def run_on(stdout: io.StringIO, monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    with monkeypatch.context() as patched:
        patched.setattr(sys, "stdout", stdout)
        code = main(list(argv))
    assert code == 0, stdout.getvalue()
    return stdout.getvalue()


def shown_as_text(out: str, escaped: str = SHOWN_OSC) -> None:
    assert "\x1b]" not in out, "an escape sequence from the ledger reached the terminal raw"
    assert "\x07" not in out
    assert escaped in out, "the escape sequence is shown as an escape"
    assert MARKUP in out, "markup from the ledger is shown as it reads"


COMMANDS = [
    ("ops", "list", "--wide"),
    ("ops", "show", KEY, "--wide"),
    ("review", "list", "--wide"),
    ("suppress", "list", "--wide"),
    ("batch", "status", "batch-hostile", "--wide"),
    ("batch", "list", "--wide"),
    ("ops", "export", "--format", "csv"),
    ("ops", "export", "--format", "jsonl"),
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(argv[:2]) for argv in COMMANDS])
@pytest.mark.parametrize("out", [Terminal, io.StringIO], ids=["terminal", "pipe"])
def test_every_listing_shows_ledger_text_as_text(
    hostile_ledger: str, monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], out: type[io.StringIO]
) -> None:
    printed = run_on(out(), monkeypatch, *argv)
    if argv[-1] == "jsonl":  # JSON escapes every control character, wherever it goes
        shown_as_text(printed, escaped=json.dumps(OSC)[1:-1])
    elif argv[-1] == "csv" and out is io.StringIO:  # a file or a pipe gets the exact data
        assert OSC in printed
    else:
        shown_as_text(printed)


@pytest.mark.parametrize("argv", [argv[:-1] for argv in COMMANDS if argv[-1] == "--wide"])
def test_wrapped_tables_never_let_a_sequence_through(
    hostile_ledger: str, monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...]
) -> None:
    printed = run_on(Terminal(), monkeypatch, *argv)
    assert "\x1b]" not in printed
    assert "\x07" not in printed


def test_status_and_reconcile_show_ledger_text_as_text(hostile_ledger: str, monkeypatch: pytest.MonkeyPatch) -> None:
    status = run_on(Terminal(), monkeypatch, "status")
    assert "\x1b]" not in status
    assert f"evil{SHOWN_OSC}" in status  # the changed tool's name
    reconciled = run_on(Terminal(), monkeypatch, "reconcile", f"{KEY}-2", "--wide")
    shown_as_text(reconciled)


@pytest.mark.parametrize(
    "argv", [("ops", "list"), ("ops", "show", KEY), ("review", "list"), ("suppress", "list"), ("status",)]
)
def test_json_output_is_ascii_and_keeps_the_exact_text(
    hostile_ledger: str, monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...]
) -> None:
    printed = run_on(Terminal(), monkeypatch, *argv, "--json")
    assert printed.isascii()
    values = [json.loads(line) for line in printed.splitlines()] if argv[-1] == "list" else [json.loads(printed)]
    assert any(OSC in text for text in strings_in(values))


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [text for item in items for text in strings_in(item)]


def test_the_resend_prompt_shows_ledger_text_as_text(
    hostile_ledger: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", Terminal("no\n"))
    assert main(["review", "resend", KEY, "--reason", "check"]) == 1
    prompt = capsys.readouterr().err
    assert "\x1b]" not in prompt
    assert f"{SHOWN_OSC}x@example.com" in prompt
    assert MARKUP in prompt


def test_the_drill_report_shows_its_texts_as_text(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    result: dict[str, Any] = {"number": 1, "name": REASON, "faults": REASON, "expected": 1, "sent": 2, "seconds": 0.1}
    failed = ScenarioResult(**result, failed_check=f"{RECIPIENTS[1]} got 2 messages", agent_saw=(REASON,))
    report = DrillReport(DrillOptions(seed=1), [failed], 0.1)
    monkeypatch.setenv("COLUMNS", "400")  # one line per row: the escaped text is not wrapped apart
    terminal = Terminal()
    with monkeypatch.context() as patched:
        patched.setattr(sys, "stdout", terminal)
        print_report(report)
    shown_as_text(terminal.getvalue())
