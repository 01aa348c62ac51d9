"""The image, built from the Dockerfile and run for real with podman (`tests/podman.py`): every command, stdio
serving on the `/data` volume as uid 10001, `podman stop` answered at once, and the ledger kept across a restart.

Missing podman, runc or debootstrap (or not root), the tests are skipped and say why; under CI that is a failure
(`.ci/run` installs them). They are `slow`: the first run makes the stand-in base (a minute); later runs take it
from the cache. Only the lock's check runs by default.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from mcp import Client, StdioServerParameters, stdio_client
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests import podman
from tests.conftest import data, email, missing

LOCK = podman.REPO / "requirements.lock"
UID = 10001
"""The image's user, who must be able to write a folder mounted on /data."""
SETUP_SECONDS = 900
"""The first test's bound, which includes making the stand-in base and building the image (two minutes cold)."""
STOP_SECONDS = 2
"""`podman stop --time`: past it podman would SIGKILL, and the container's exit code would say 137."""


@pytest.fixture(scope="module")
def image() -> str:
    if reason := podman.missing_reason():
        missing(f"building and running the image: {reason}")
    return podman.build_image(podman.stand_in_base())


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A folder to bind-mount on /data, given to the image's user (`chown 10001:10001`, docs/how-to/docker.md)."""
    folder = tmp_path / "data"
    folder.mkdir()
    os.chown(folder, UID, UID)
    return folder


@pytest.fixture
def name() -> Iterator[str]:
    """A container name, removed afterwards whatever happened."""
    container = f"hail-guard-test-{uuid.uuid4().hex[:12]}"
    yield container
    podman.podman("rm", "--force", "--time", "0", container, check=False)


def run(image: str, *command: str, volume: Path | None = None) -> tuple[int, str, str]:
    """`podman run --rm IMAGE COMMAND...`: exit code, stdout, stderr."""
    mount = ["--volume", f"{volume}:/data"] if volume is not None else []
    done = podman.podman("run", "--rm", *podman.run_options(), *mount, image, *command, check=False)
    return done.returncode, done.stdout, done.stderr


@asynccontextmanager
async def serving(image: str, data_dir: Path, name: str, errlog: Path) -> AsyncIterator[Client]:
    """An MCP client of the image's default command (`serve` on stdio), as an agent starts it: `run -i`."""
    args = ["run", "-i", "--name", name, *podman.run_options(), "--volume", f"{data_dir}:/data", image]
    params = StdioServerParameters(command="podman", args=args, env={"HAIL_GUARD_LOG_LEVEL": "info"})
    with errlog.open("a") as log:
        async with Client(stdio_client(params, errlog=log), mode="legacy") as agent:
            yield agent


@pytest.mark.slow
@pytest.mark.timeout(SETUP_SECONDS)
def test_every_command_runs_in_the_image_the_drill_among_them(image: str, data_dir: Path) -> None:
    code, out, err = run(image, "drill", "--scenario", "1", "--scenario", "2")
    assert code == 0, err
    assert "scenarios hold" in out
    code, out, err = run(image, "status", volume=data_dir)
    assert code == 0, err
    assert "ledger: sqlite:////data/ledger.db" in out


@pytest.mark.slow
@pytest.mark.timeout(SETUP_SECONDS)
async def test_the_image_serves_on_stdio_stops_at_once_on_sigterm_and_keeps_the_ledger_on_its_volume(
    image: str, data_dir: Path, name: str, tmp_path: Path
) -> None:
    errlog = tmp_path / "serve.log"
    async with serving(image, data_dir, name, errlog) as agent:
        first = data(await agent.call_tool("send_email", email()))["hail_guard"]
        again = data(await agent.call_tool("send_email", email()))["hail_guard"]
        assert (first["state"], first["replayed"]) == ("accepted", False)
        assert (again["operation_id"], again["replayed"]) == (first["operation_id"], True)
        # The agent is still connected (stdin open) when the container is stopped, as `docker stop` does.
        await anyio.to_thread.run_sync(podman.podman, "stop", "--time", str(STOP_SECONDS), name)
    state = podman.podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name).stdout.split()
    assert state == ["exited", "0"], errlog.read_text()  # SIGKILLed after the 2 s: 137
    assert '"signal": "SIGTERM"' in errlog.read_text()
    ledger = data_dir / "ledger.db"
    assert (ledger.stat().st_uid, stat.S_IMODE(ledger.stat().st_mode)) == (UID, 0o600)

    podman.podman("rm", name)  # a new container on the same volume: the repeat is answered from the ledger
    async with serving(image, data_dir, name, errlog) as agent:
        after = data(await agent.call_tool("send_email", email()))["hail_guard"]
    assert (after["operation_id"], after["state"], after["replayed"]) == (first["operation_id"], "accepted", True)


@pytest.mark.slow
@pytest.mark.timeout(SETUP_SECONDS)
def test_a_data_folder_the_image_user_cannot_write_is_refused_naming_the_ledger(image: str, tmp_path: Path) -> None:
    owned_by_root = tmp_path / "root-owned"
    owned_by_root.mkdir()
    code, _, err = run(image, "status", volume=owned_by_root)
    assert code == 1
    assert "the ledger /data/ledger.db cannot be used: [Errno 13] Permission denied" in err


def test_the_lock_pins_every_requirement_of_the_image_within_its_bounds_with_hashes() -> None:
    """A dependency added to pyproject.toml without `pip-compile` (docs/how-to/docker.md) fails here, not in the
    image."""
    project = tomllib.loads((podman.REPO / "pyproject.toml").read_text())
    wanted = [
        *project["build-system"]["requires"],
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["postgres"],
    ]
    entries = re.findall(r"^(\S+)==(\S+) \\\n((?:    --hash=sha256:[0-9a-f]{64}.*\n)+)", LOCK.read_text(), re.MULTILINE)
    pinned = {canonicalize_name(name): Version(version) for name, version, _ in entries}
    assert len(entries) == len(re.findall(r"^[^\s#]", LOCK.read_text(), re.MULTILINE)), "every pin has its hashes"
    for requirement in map(Requirement, wanted):
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not in requirements.lock"
        assert requirement.specifier.contains(pinned[name]), f"{name}=={pinned[name]} is not {requirement.specifier}"
