"""Locate the published-checkpoint reference folders (``shared/vectors/checkpoints``)."""

import os

import pytest


@pytest.fixture(scope="session")
def ckpt_root(vectors_dir):
    path = os.path.join(vectors_dir, "checkpoints")
    if not os.path.isdir(path):
        pytest.skip(f"checkpoint reference folders not found at {path}")
    return path
