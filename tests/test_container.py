"""The Dockerfile cannot be built here (no Docker engine), so run exactly what the image runs."""

from __future__ import annotations

import json
import re
import shutil
import stat
import sys
from pathlib import Path

from mcp import Client, StdioServerParameters

from tests.conftest import data, email

DOCKERFILE = Path(__file__).resolve().parent.parent / "Dockerfile"


def final_stage() -> str:
    return DOCKERFILE.read_text().split("\nFROM ")[-1]


def test_the_image_runs_serve_as_a_non_root_user_with_the_ledger_on_the_data_volume() -> None:
    stage = final_stage()
    assert re.search(r"^USER hailguard$", stage, re.MULTILINE)
    assert 'VOLUME ["/data"]' in stage
    assert json.loads(re.search(r"^ENTRYPOINT (.+)$", stage, re.MULTILINE).group(1)) == ["hail-guard", "serve"]  # type: ignore[union-attr]
    assert "HAIL_GUARD_LEDGER_URL=sqlite:////data/ledger.db" in stage


async def test_the_images_entry_point_serves_and_keeps_the_ledger_where_the_volume_is(tmp_path: Path) -> None:
    stage = final_stage()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", stage, re.MULTILINE).group(1))  # type: ignore[union-attr]
    ledger_url = re.search(r"HAIL_GUARD_LEDGER_URL=(\S+)", stage).group(1)  # type: ignore[union-attr]
    data_dir = tmp_path / "data"  # stands in for the /data volume
    data_dir.mkdir()
    command = shutil.which(entrypoint[0]) or shutil.which(entrypoint[0], path=str(Path(sys.executable).parent))
    assert command is not None, "the package's console script is installed"
    params = StdioServerParameters(
        command=command,
        args=entrypoint[1:],
        env={"HAIL_GUARD_LEDGER_URL": ledger_url.replace("/data/", f"{data_dir}/"), "HAIL_GUARD_LOG_LEVEL": "warning"},
        cwd=str(tmp_path),
    )
    async with Client(params, mode="legacy") as agent:
        sent = await agent.call_tool("send_email", email())
        assert data(sent)["hail_guard"]["state"] == "accepted"
    ledger = data_dir / "ledger.db"
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600
    assert not any(path.suffix == ".db" for path in tmp_path.iterdir())  # nothing in the working directory
