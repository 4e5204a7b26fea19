"""The slow lane's step rotation (thirdparty_harness.STEP_ROTATION) still runs every built-in's step."""

from __future__ import annotations

from pathlib import Path

from thirdparty_harness import COVERED_BY_FAMILY, FAMILY_REPRESENTATIVES, STEP_ONLY, STEP_ROTATION, runs_step


def test_every_covered_format_trains_in_two_suites():
    for name in COVERED_BY_FAMILY:
        suites = [m for m, names in STEP_ROTATION.items() if name in names]
        assert len(suites) >= 2, f"{name}'s gradient and Adam step run in {suites} only"
    assert set().union(*STEP_ROTATION.values()) <= set(COVERED_BY_FAMILY)


def test_rotation_names_existing_suites():
    here = Path(__file__).parent
    for module in [*STEP_ROTATION, *STEP_ONLY]:
        assert (here / f"{module}.py").is_file(), module


def test_representatives_and_loss_are_never_deselected():
    for module in STEP_ROTATION:
        for name in FAMILY_REPRESENTATIVES:
            assert runs_step(module, "test_grad", name)
        for name in COVERED_BY_FAMILY:
            assert runs_step(module, "test_loss", name)
            assert runs_step(module, "test_grad", name) == (name in STEP_ROTATION[module])
    assert runs_step("test_flax", "test_grad", "a_users_format")


def test_step_only_suites_run_their_formats_steps_and_every_loss():
    assert not set(STEP_ONLY) & set(STEP_ROTATION)
    for module, names in STEP_ONLY.items():
        assert set(names) <= set(FAMILY_REPRESENTATIVES), names
        for name in [*FAMILY_REPRESENTATIVES, *COVERED_BY_FAMILY, "a_users_format"]:
            assert runs_step(module, "test_loss", name)
            assert runs_step(module, "test_adam_update", name) == (name in names)
