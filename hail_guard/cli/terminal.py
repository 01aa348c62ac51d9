"""What an operator's terminal is shown: ledger text made safe, tables that never cut an id, progress bars.

Everything read from the ledger was written, in the end, by an agent or by Hail: a recipient, a
key, a reason, a batch name. `terminal_text` is the one way such text reaches a terminal: control
characters (escape sequences, carriage returns, bidirectional overrides, zero-width characters)
are shown as escapes, and text printed through rich goes as `Text`, never parsed as markup.
JSON output is always ASCII (`json_text`), so it is safe on a terminal too.

Tables never truncate an id or a key: those columns keep their whole width and the other columns
wrap; when even that does not fit the width (the terminal's; 80 columns off a terminal), or with
`--wide`, the table is printed at its natural width, one line per row.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from rich.table import Table

    from hail_guard.models import BatchStatus, Operation

_CONTROL: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb]"
)
"""C0 and C1 controls (ESC, CSI, BEL, CR...), soft hyphen, and the invisible and bidirectional formats."""
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
NARROWEST: Final = 8
"""A wrapped column is never made narrower than this (or its own width, if less)."""
TIME_FORMAT: Final = "%Y-%m-%d %H:%M:%S"


def terminal_text(value: object) -> str:
    """Ledger text as terminal text: every control or invisible character shown as an escape (`\\x1b`)."""
    text = "-" if value is None else str(value)
    return _CONTROL.sub(_escaped, text)


def _escaped(found: re.Match[str]) -> str:
    char = found.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(value: object) -> Text:
    """`terminal_text` as a rich `Text`: printed as it reads, never parsed for markup or emoji."""
    return Text(terminal_text(value))


def labelled(label: str, value: object) -> Text:
    """`label: value`, the label in bold and the value as ledger text."""
    return Text.assemble((label, "bold"), ": ", shown(value))


def json_text(value: Any, *, indent: int | None = None) -> str:
    """JSON for stdout: ASCII only, so no character of it can act on a terminal."""
    return json.dumps(value, indent=indent, ensure_ascii=True, default=str)


def console(*, stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def say(*parts: str | Text | tuple[str, str]) -> None:
    """One line on stdout (labels and values already made safe), never wrapped by rich."""
    console().print(Text.assemble(*parts), soft_wrap=True)


@dataclass(frozen=True)
class Column:
    header: str
    whole: bool = False
    """An id or a key: never cut, never wrapped."""


def print_table(
    columns: Sequence[Column | str],
    rows: Iterable[Sequence[object]],
    *,
    title: str,
    wide: bool = False,
    caption: str | None = None,
    out: Console | None = None,
) -> None:
    """A table of ledger values (each made safe; a `Text` is taken as already safe); ids and keys whole,
    other columns wrapped to fit."""
    out = out or console()
    heads = [column if isinstance(column, Column) else Column(column) for column in columns]
    cells = [[value if isinstance(value, Text) else shown(value) for value in row] for row in rows]
    columns_of = list(_by_column(heads, cells))
    natural = [max([len(head.header), *(cell.cell_len for cell in column)]) for head, column in columns_of]
    words = [_longest_word([Text(head.header), *column]) for head, column in columns_of]
    widths = natural if wide else _fitted(heads, natural, words, out.width)
    table = _table(heads, widths, title, caption)
    for row in cells:
        table.add_row(*row)
    total = sum(widths) + 3 * len(widths) + 1
    if total > out.width:
        out = Console(file=out.file, width=total, highlight=False, force_terminal=out.is_terminal)
    out.print(table)


def _by_column(heads: Sequence[Column], cells: Sequence[Sequence[Text]]) -> Iterator[tuple[Column, list[Text]]]:
    for index, head in enumerate(heads):
        yield head, [row[index] for row in cells]


def _fitted(heads: Sequence[Column], natural: list[int], words: list[int], width: int) -> list[int]:
    """Widths that fit `width`: ids whole; the widest other columns narrowed first, down to their longest
    word (wrapped between words), then, if need be, further (folded); `natural` if even that does not fit."""
    room = width - 3 * len(heads) - 1 - sum(w for head, w in zip(heads, natural, strict=True) if head.whole)
    others = [index for index, head in enumerate(heads) if not head.whole]
    between_words = {i: min(natural[i], max(words[i], NARROWEST)) for i in others}
    folded = {i: min(natural[i], NARROWEST) for i in others}
    for floors in (between_words, folded):
        for cap in range(max([natural[i] for i in others], default=0), -1, -1):
            narrowed = {i: max(floors[i], min(natural[i], cap)) for i in others}
            if sum(narrowed.values()) <= room:
                return [narrowed.get(index, w) for index, w in enumerate(natural)]
    return natural


def _longest_word(texts: Sequence[Text]) -> int:
    return max((len(word) for text in texts for word in text.plain.split()), default=0)


def _table(heads: Sequence[Column], widths: Sequence[int], title: str, caption: str | None) -> Table:
    from rich.table import Table  # here: only listing commands draw tables, `serve` never does

    table = Table(title=title, caption=caption)
    for head, width in zip(heads, widths, strict=True):
        table.add_column(head.header, width=width, no_wrap=head.whole, overflow="fold")
    return table


def print_operations(operations: Sequence[Operation], *, title: str, wide: bool = False) -> None:
    columns = (
        Column("operation", whole=True),
        Column("key", whole=True),
        "state",
        "delivery",
        "tool",
        "to",
        Column("provider id", whole=True),
        "updated",
    )
    rows = [
        (
            op.id,
            op.idempotency_key,
            op.state.value,
            op.delivery_state.value if op.delivery_state else None,
            op.tool,
            ", ".join(op.recipients),
            op.provider_id,
            op.updated_at.strftime(TIME_FORMAT),
        )
        for op in operations
    ]
    print_table(columns, rows, title=title, wide=wide)


def print_batch(status: BatchStatus, *, wide: bool = False) -> None:
    counts = ", ".join(f"{state.value} {count}" for state, count in sorted(status.counts.items()))
    name = f" ({terminal_text(status.name)})" if status.name else ""
    say((status.batch_id, "bold"), f"{name}: {status.total} send(s): {counts or 'none'}")
    if status.unresolved:
        print_operations(status.unresolved, title="unresolved", wide=wide)
    if status.held:
        columns = (Column("waiting", whole=True), "to", Column("held by", whole=True), "its state")
        rows = [
            (held.operation.id, ", ".join(held.operation.recipients), held.held_by.id, held.held_by.state.value)
            for held in status.held
        ]
        title = "held: a send to the same recipient (or lead) is unresolved; these go once it is settled"
        print_table(columns, rows, title=title, wide=wide)


@contextmanager
def progress(description: str, *, total: int | None, enabled: bool = True) -> Iterator[Any]:
    """A progress bar on stderr, only when stderr is a terminal and it is `enabled`; yields
    `advance(done, total)`, a no-op when there is no bar."""
    if not enabled or not sys.stderr.isatty():
        yield _no_progress
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(done: int | None = None, total: int | None = None, description: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=description)

        yield advance


def _no_progress(done: int | None = None, total: int | None = None, description: str | None = None) -> None:
    return None
