"""The Dockerfile built and run for real with Debian's podman, over a stand-in base made from Debian's packages.

No image registry is reachable here, so the base the Dockerfile names (`python:3.11-slim`) is stood in for by
Debian's own Python 3.11: `debootstrap` makes a root filesystem with `PACKAGES` (from its default mirror),
`podman import` makes it an image, and the build takes it through the Dockerfile's `BASE` argument (a real
`python:3.11-slim` already on the machine is never overwritten). The root filesystem is slow to make (a
minute), so its tarball is cached outside the repository, in `BASE_CACHE`, keyed by the suite and the
packages: a second run, or another checkout, imports it in seconds, or finds the image in podman's storage.

pip reaches PyPI here through a TLS-intercepting proxy whose certificate authority is only in the host's bundle
(`/etc/ssl/certs/ca-certificates.crt`, named by `PIP_CERT`); the build gets that bundle as a secret, mounted
for the install step only, never in a layer. Containers run as root with the `runc` runtime named (podman's
default may be crun, which this machine's cgroups refuse) and explicit `nofile`/`nproc` limits: podman's
defaults ask for more than this machine lets runc set ("error setting rlimits ... operation not permitted").
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import resource
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
"""Debian's release with Python 3.11, the Python `requirements.lock` is compiled for."""
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
"""What python:3.11-slim offers the Dockerfile: `python -m venv`, `useradd` (in every Debian), CA certificates."""
BASE_CACHE = Path(
    os.environ.get("HAIL_GUARD_TEST_CONTAINER_BASE_CACHE", "/var/tmp/hail-guard-container-base")  # noqa: S108  (kept across runs and checkouts on purpose)
)
IMAGE = "localhost/hail-guard-test:latest"
NPROC = 4096
"""Processes a test container may run: podman's default asks for more than this machine lets runc set."""


def missing_reason() -> str | None:
    """Why the image cannot be built and run here, or None."""
    if os.geteuid() != 0:
        return "building the stand-in base with debootstrap and running podman here needs root"
    wanted = ("podman", "runc", "debootstrap")
    if missing := [tool for tool in wanted if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]:
        return f"{', '.join(missing)} not installed (apt-get install podman runc debootstrap; .ci/run does)"
    return None


def podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A podman command; a failure raises with what podman printed."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        said = f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}".strip()  # a build's log ends with its error
        raise RuntimeError(f"podman {' '.join(args)} exited {done.returncode}:\n{said}")
    return done


def run_options() -> list[str]:
    """What every `podman run` here needs: the runtime, limits this machine can grant, and no network (the
    image's sandbox is in its own process), so no container network stack (CNI, iptables) is needed."""
    return [*_runtime(), "--network", "none"]


def build_options() -> list[str]:
    """What `podman build` needs: as `run_options`, with the host's network for pip."""
    return [*_runtime(), "--network", "host"]


def _runtime() -> list[str]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = min(NPROC, resource.getrlimit(resource.RLIMIT_NPROC)[0])
    return ["--runtime", "runc", "--ulimit", f"nofile={soft}:{soft}", "--ulimit", f"nproc={nproc}:{nproc}"]


def base_key() -> str:
    recipe = " ".join((SUITE, *PACKAGES))
    return f"{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def stand_in_base() -> str:
    """The stand-in base image's name, made (or taken from the cache) when podman does not have it yet."""
    name = f"localhost/hail-guard-test-base:{base_key()}"
    with _locked():
        if podman("image", "exists", name, check=False).returncode != 0:
            podman("import", "--change", 'CMD ["python"]', str(_base_tarball()), name)
    return name


def _base_tarball() -> Path:
    """The root filesystem as a tarball in the cache, made once (call it under `_locked`)."""
    tarball = BASE_CACHE / f"{base_key()}.tar"
    if tarball.exists():
        return tarball
    for left in BASE_CACHE.glob(f"{_SCRATCH}*"):  # from a run killed in the middle
        _remove(left)
    work = Path(tempfile.mkdtemp(prefix=_SCRATCH, dir=BASE_CACHE))
    try:
        root = work / "root"
        bootstrap = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(root)]
        made = subprocess.run(bootstrap, capture_output=True, text=True, timeout=900, check=False)
        if made.returncode != 0:
            raise RuntimeError(f"debootstrap of the stand-in base failed:\n{made.stdout[-4000:]}\n{made.stderr}")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / cache).glob("*"):
                if path.is_file():
                    path.unlink()
        partial = work / "base.tar"
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True)
        partial.rename(tarball)  # whole or not at all: a run cut short leaves no half tarball
    finally:
        _remove(work)
    return tarball


_SCRATCH = "scratch-"


def _remove(work: Path) -> None:
    """Delete a scratch folder, never through a mount: debootstrap cut short leaves its /proc mounted in it."""
    for point in sorted(_mounts_under(work), reverse=True):
        subprocess.run(["umount", "--lazy", point], check=False)
    if not _mounts_under(work):
        shutil.rmtree(work)


def _mounts_under(folder: Path) -> list[str]:
    points = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return [point for point in points if point == str(folder) or point.startswith(f"{folder}/")]


@contextmanager
def _locked() -> Iterator[None]:
    """One maker of the base and builder of the image at a time (two pytest workers, two checkouts)."""
    BASE_CACHE.mkdir(parents=True, exist_ok=True)
    with (BASE_CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_image(base: str) -> str:
    """The repository's Dockerfile built over `base` as `IMAGE` (podman's layer cache makes a rebuild quick)."""
    build = ["build", *build_options(), "--pull=never", "--build-arg", f"BASE={base}"]
    if (bundle := ca_bundle()) is not None:
        build += ["--secret", f"id=ca_certificates,src={bundle}"]
    with _locked():
        before = podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
        podman(*build, "--tag", IMAGE, str(REPO), timeout=900)
        after = podman("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
        if before and before != after:  # the image it replaces, with its own layers; the build's cache stays
            podman("rmi", before, check=False)
    return IMAGE


def ca_bundle() -> str | None:
    """The certificate authorities pip trusts on this machine, for the build's install step."""
    candidates: Sequence[str | None] = (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        ssl.get_default_verify_paths().cafile,
        "/etc/ssl/certs/ca-certificates.crt",
    )
    return next((path for path in candidates if path and Path(path).is_file()), None)
