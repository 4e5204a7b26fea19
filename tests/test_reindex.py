"""``ScaledFormat.reindex``: the format for data with an axis inserted or removed scales the same
data axes. Reference: quantizing each item on its own and stacking the results (``np.stack``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qformats as qf

FORMATS = {
    "mxfp8": qf.MXFP8,
    "mxfp4": qf.MXFP4,
    "int8_per_channel": qf.INT8_PER_CHANNEL,
    # One level: a per-tensor level would span the inserted axis too.
    "nvfp4_tiles": qf.NVFP4.replace(axis=-1, tile_axis=0, tensor_scale=False),
    "fp8": qf.FP8_E4M3,
}


def _leaves(tree):
    return [np.asarray(v).view(np.uint8) for v in jax.tree.leaves(tree)]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    # Formats whose blocks have a bounded extent on every axis (a per-channel or per-tensor block
    # spans the inserted axis too: see test_per_channel_axis_moves_with_its_data_axis).
    name=st.sampled_from(["mxfp8", "mxfp4", "nvfp4_tiles"]),
    axis=st.sampled_from([0, 1, -1, -2]),
    k=st.integers(0, 2),
)
def test_insert_axis_stacks_items(name, axis, k):
    """quantize(stack(items, k)) with the reindexed format == stack of each item's quantization."""
    base = FORMATS[name]
    fmt = base.aim(axis % 2, 1 - axis % 2) if name == "nvfp4_tiles" else base.replace(axis=axis)
    rng = np.random.default_rng(k)
    items = [jnp.asarray(rng.normal(size=(32, 64)).astype(np.float32) * 2.0**i) for i in range(3)]
    big = fmt.reindex(2, insert=k)
    got = big.quantize(jnp.stack(items, axis=k))
    per = [fmt.quantize(x) for x in items]
    want = jax.tree.map(lambda *v: jnp.stack(v, axis=k) if jnp.ndim(v[0]) else v[0], *per)
    for g, w in zip(_leaves(got[0]), _leaves(want[0]), strict=True):
        np.testing.assert_array_equal(g, w)
    # Scale leaves that are block grids stack like the data (NVFP4's 0-d tensor level, 1 here,
    # is one per array: not a grid).
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        if jnp.ndim(g):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_per_channel_axis_moves_with_its_data_axis(axis, k):
    """One scale per index of the same data axis after an axis is inserted at ``k``."""
    fmt = qf.INT8_PER_CHANNEL.replace(axis=axis)
    shape = [4, 6]
    channel = axis % 2
    big_shape = tuple(np.insert(np.asarray(shape), k, 3))
    moved = channel + (k <= channel)
    want = tuple(n if i == moved else 1 for i, n in enumerate(big_shape))
    assert tuple(fmt.reindex(2, insert=k).scale_shape(big_shape)) == want


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
@pytest.mark.parametrize("removed", [0, 1, 2])
def test_remove_axis_round_trips_insert(axis, removed):
    fmt = qf.MXFP8.replace(axis=axis)
    item = fmt.reindex(3, remove=removed)
    if fmt.axis % 3 == removed:
        assert item is None  # the blocks lie along the removed axis: the items cannot share them
        return
    assert item.reindex(2, insert=removed) == fmt


def test_formats_without_axis_fields_are_unchanged():
    assert qf.FP8_E4M3.reindex(2, insert=0) is qf.FP8_E4M3
    assert qf.get_format("gguf_q8_0").reindex(2, remove=0) is qf.get_format("gguf_q8_0")


def test_reindex_needs_exactly_one_change():
    with pytest.raises(ValueError, match="exactly one of insert= and remove="):
        qf.MXFP8.reindex(2)
    with pytest.raises(ValueError, match="exactly one of insert= and remove="):
        qf.MXFP8.reindex(2, insert=0, remove=1)
