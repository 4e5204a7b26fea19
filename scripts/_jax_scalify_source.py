"""Fetch other projects' code from PyPI for the scripts that run it against ``scalify``: jax-scalify's
source (its sdist), and the wheels of model libraries (:func:`fetch_wheels`).

Shared by ``run_jax_scalify_suite.py``, ``run_jax_scalify_notebook.py`` and
``run_jax_scalify_examples.py``. Nothing of jax-scalify is kept in this repository: the sdist is
downloaded with ``pip download --no-deps --no-binary :all:`` into a directory the caller owns
(a temporary one) and unpacked there.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "jax-scalify"
SEED_VERSION = "0.1.1"
REPO_URL = "https://github.com/graphcore-research/jax-scalify"


def _extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
            return
        # Python without extraction filters: refuse members that would land outside dest.
        for m in tar.getmembers():
            if m.issym() or m.islnk() or not (dest / m.name).resolve().is_relative_to(dest.resolve()):
                raise SystemExit(f"refusing to unpack {archive.name}: unsafe member {m.name!r}")
        tar.extractall(dest)


def fetch_sdist(work: Path, version: str | None = SEED_VERSION, package=PACKAGE, repo_url=REPO_URL) -> Path:
    """``pip download`` a package's sdist (jax-scalify's by default) into ``work/sdist``, unpack it
    under ``work/src``; return its root."""
    dl = work / "sdist"
    spec = f"{package}=={version}" if version else package
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dl), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    archives = sorted(dl.glob("*.tar.gz"))
    if proc.returncode != 0 or not archives:
        raise SystemExit(
            f"could not download {spec}:\n{proc.stderr.strip()}\n"
            f"Clone {repo_url} (git clone {repo_url}.git) and pass --source DIR."
        )
    _extract(archives[0], work / "src")
    (root,) = list((work / "src").iterdir())
    return root


def fetch_wheels(work: Path, specs, hint: str) -> Path:
    """``pip download --no-deps --only-binary :all:`` each of ``specs`` into ``work/wheels`` and
    unpack every wheel into ``work/site``; return that directory (to put first on ``sys.path``).
    ``hint`` says what to do instead when PyPI cannot be reached."""
    dl, dest = work / "wheels", work / "site"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dl), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dl.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) < len(specs):
        raise SystemExit(f"could not download {' '.join(specs)}:\n{proc.stderr.strip()}\n{hint}")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest)
    return dest


# The seed's own environment: jax-scalify 0.1.1 on JAX 0.4.x, with the versions of flax/optax/chex of
# that time. These install together on Python 3.10-3.12 and run jax-scalify's examples and notebook.
SEED_REQUIREMENTS = (
    f"{PACKAGE}=={SEED_VERSION}",
    "jax[cpu]==0.4.30",
    "jaxlib==0.4.30",
    "numpy==1.26.4",
    "ml_dtypes==0.5.4",
    "chex==0.1.86",
    "flax==0.8.5",
    "optax==0.2.3",
)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/qformats-peers`` (default ``~/.cache/qformats-peers``)."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qformats-peers"


def seed_python(rebuild: bool = False) -> Path:
    """Python of a virtualenv with jax-scalify 0.1.1 and JAX 0.4.x (created on first use under the cache dir)."""
    import shutil

    tag = f"jax-scalify-{SEED_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    venv = cache_dir() / tag
    python = venv / "bin" / "python"
    marker = venv / "requirements.txt"
    wanted = "\n".join(SEED_REQUIREMENTS) + "\n"
    if not rebuild and python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"creating the seed environment {venv} ({', '.join(SEED_REQUIREMENTS)})", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *SEED_REQUIREMENTS], check=True)
    marker.write_text(wanted)
    return python
