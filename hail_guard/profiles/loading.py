"""Reading a profile: a built-in one by name (`hail`, `resend`, `agentmail`), or a TOML file by path.

Every problem is a `ConfigError` that names the file, the line (TOML syntax) or the key (everything else:
`tools[0] (post_message).search.match[1]`), and says what to do.
"""

from __future__ import annotations

import difflib
import functools
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from hail_guard.errors import ConfigError
from hail_guard.profiles.model import ProfileData
from hail_guard.profiles.spec import Profile

BUILT_IN = ("hail", "resend", "agentmail")
"""The profiles shipped with hail-guard (`hail_guard/profiles/<name>.toml`)."""
DEFAULT = "hail"


def load_profile(reference: str, base_dir: str | Path | None = None) -> Profile:
    """The profile `reference` names: a built-in name, else a file (relative to `base_dir`, else the working folder)."""
    if reference in BUILT_IN:
        return built_in(reference)
    path = Path(reference).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(
            f"cannot read the profile {path}: {why}; give [upstream] profile a built-in name "
            f"({', '.join(BUILT_IN)}) or the path of a profile file"
        ) from None
    return parse_profile(text, str(path))


@functools.cache
def built_in(name: str) -> Profile:
    """A shipped profile, read once."""
    text = resources.files("hail_guard.profiles").joinpath(f"{name}.toml").read_text(encoding="utf-8")
    return parse_profile(text, name)


def parse_profile(text: str, source: str) -> Profile:
    """A profile from its TOML text; `source` names it in messages."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the profile {source} is not valid TOML: {exc}; fix that line") from None
    try:
        data = ProfileData.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(_problem(error, raw) for error in exc.errors())
        raise ConfigError(f"the profile {source} is not valid: {problems}") from None
    return Profile(data, source)


def _problem(error: Any, raw: dict[str, Any]) -> str:
    """One validation error in words, naming the key (and the tool by its name)."""
    loc = tuple(error["loc"])
    where = _where(loc, raw)
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        near = _nearest(str(loc[-1]), _model_at(loc[:-1]))
        hint = f'; did you mean "{near}"?' if near else "; remove it or check its spelling"
        return f'unknown key "{loc[-1]}" in {_where(loc[:-1], raw) or "the top level"}{hint}'
    if error["type"] == "missing":
        return f"{where}: missing; add it"
    return f"{where or 'the profile'}: {message}"


def _where(loc: tuple[Any, ...], raw: dict[str, Any]) -> str:
    """`tools[0] (post_message).search.match[1]`: a key path, with each tool's name beside its index."""
    parts: list[str] = []
    node: Any = raw
    for part in loc:
        if isinstance(part, int):
            parts[-1] += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                parts[-1] += f" ({node['name']})"
            continue
        if not isinstance(part, str) or part in ("str", "Match", "function-after[_pointer(), str]"):
            continue  # pydantic's names for the branches of a union
        parts.append(part)
        node = node.get(part) if isinstance(node, dict) else None
    return ".".join(parts)


def _model_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at `loc` knows (for "did you mean")."""
    model: type[BaseModel] = ProfileData
    for part in loc:
        if isinstance(part, int) or part not in model.model_fields:
            continue
        annotation = model.model_fields[part].annotation
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            inner = getattr(candidate, "__args__", (candidate,))
            found = next((c for c in (candidate, *inner) if isinstance(c, type) and issubclass(c, BaseModel)), None)
            if found is not None:
                model = found
                break
    return list(model.model_fields)


def _nearest(name: str, known: list[str]) -> str | None:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return close[0] if close else None
