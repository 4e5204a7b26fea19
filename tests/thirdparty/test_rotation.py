"""The lanes' rotations: the slow lane's step rotation (thirdparty_harness.STEP_ROTATION) still runs
every built-in's step; the fast lane's format rotation (fast_lane_formats) every case and family."""

from __future__ import annotations

from pathlib import Path

from thirdparty_harness import (
    COVERED_BY_FAMILY,
    FAMILY_REPRESENTATIVES,
    FEW_FORMATS,
    FORMAT_NAMES,
    STEP_ONLY,
    STEP_ROTATION,
    fast_lane_formats,
    runs_step,
)


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


def test_fast_lane_formats_meet_every_case_and_every_family():
    """:func:`fast_lane_formats` over any number of cases: each case gets ``ceil(r / n)`` of the
    ``r`` representatives offered (all of them for one case), together they are all ``r``, and no
    case gets a format it was not offered."""
    reps = tuple(FAMILY_REPRESENTATIVES)
    for offered in (reps, FEW_FORMATS, ("mxfp8",), (*reps, "a_users_format")):
        n_reps = len([f for f in offered if f in FAMILY_REPRESENTATIVES])
        for n in range(1, 12):
            picks = [fast_lane_formats(k, n, offered) for k in range(n)]
            assert all(p and set(p) <= set(offered) for p in picks), (offered, n, picks)
            assert {f for p in picks for f in p} == set(offered) & set(reps), (offered, n, picks)
            assert all(len(p) == -(-n_reps // n) for p in picks), (offered, n, picks)
    assert fast_lane_formats(0, 2, reps) == reps[:3] and fast_lane_formats(1, 2, reps) == reps[3:]
    assert fast_lane_formats(0, 3, ("a_users_format",)) == ()


def _case_and_format(item: str) -> tuple[str, str]:
    """``("test_x.py::test_y", case id), format`` of a collected id such as ``...test_y[case-fmt]``."""
    test, _, params = item.rstrip("]").partition("[")
    tokens = params.split("-")
    fmt = next(t for t in tokens if t in FORMAT_NAMES)
    return (test, "-".join(t for t in tokens if t != fmt)), fmt


def test_the_fast_lane_keeps_every_case_and_family():
    """The rotation as collected (three suites of several cases, collected in a subprocess): the
    fast lane runs every case of their four format-parametrized tests of several cases in at least
    one representative, and every representative in at least one case; the slow lane holds the
    rest."""
    import subprocess
    import sys

    here = Path(__file__).parent
    suites = [str(here / f"{m}.py") for m in ("test_diffrax", "test_flowjax", "test_lineax")]
    lanes = []
    for lane in ("not slow and not fuzz", "slow"):
        argv = ["-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", lane, *suites]
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=here.parents[1], check=True)
        lanes.append({line for line in out.stdout.splitlines() if "::" in line})
    fast, slow = lanes
    assert not fast & slow
    rotated = ("test_loss", "test_linear_solve_and_its_gradient", "test_optimistix_solver")
    split = {i: _case_and_format(i) for i in fast | slow if i.partition("[")[0].rpartition("::")[2] in rotated}
    tests = {case[0] for case, _ in split.values()}
    assert len(tests) == 4, tests
    for test in tests:
        offered = {f for (c, f) in split.values() if c[0] == test}
        cases = {c for (c, f) in split.values() if c[0] == test}
        ran = [split[i] for i in fast if i in split and split[i][0][0] == test]
        assert {c for c, _ in ran} == cases, test
        assert {f for _, f in ran} >= offered & set(FAMILY_REPRESENTATIVES), test
    moved = [i for i in slow if i in split and split[i][1] in FAMILY_REPRESENTATIVES]
    assert moved, "the rotation moved no (case, representative) pair to the slow lane"
