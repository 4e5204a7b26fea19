"""The slow lane's step rotation (thirdparty_harness.STEP_ROTATION) still runs every built-in's step."""

from __future__ import annotations

from pathlib import Path

from thirdparty_harness import COVERED_BY_FAMILY, FAMILY_REPRESENTATIVES, STEP_ROTATION, runs_step


def test_every_covered_format_trains_in_two_suites():
    for name in COVERED_BY_FAMILY:
        suites = [m for m, names in STEP_ROTATION.items() if name in names]
        assert len(suites) >= 2, f"{name}'s gradient and Adam step run in {suites} only"
    assert set().union(*STEP_ROTATION.values()) <= set(COVERED_BY_FAMILY)


def test_rotation_names_existing_suites():
    here = Path(__file__).parent
    for module in STEP_ROTATION:
        assert (here / f"{module}.py").is_file(), module


def test_representatives_and_loss_are_never_deselected():
    for module in STEP_ROTATION:
        for name in FAMILY_REPRESENTATIVES:
            assert runs_step(module, "test_grad", name)
        for name in COVERED_BY_FAMILY:
            assert runs_step(module, "test_loss", name)
            assert runs_step(module, "test_grad", name) == (name in STEP_ROTATION[module])
    assert runs_step("test_flax", "test_grad", "a_users_format")
