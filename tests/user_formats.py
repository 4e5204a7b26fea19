"""A user format as a third party would write it, run through the same suites as the built-ins.

``DictMXFP8``: MX blocks of 32 E4M3 elements along ``axis``, its E8M0 scales held in a dict
``{"e8m0": grid}``. It reuses no scalify code and has no name the library knows; what rules and
helpers need (its axis, how to aim it at a GEMM operand, how it moves under vmap and all_gather)
it declares through the format protocol (``axis_fields``, ``aim``). Not registered: the tests
that take it pass the object.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

import qformats as qf


@attrs.frozen
class DictMXFP8(qf.ScaledFormat):
    """``value = e4m3(data) * 2**(scale["e8m0"] - 127)`` per block of 32 along ``axis``."""

    axis_fields: ClassVar[tuple[str, ...]] = ("axis",)

    name: str = "user_dict_mxfp8"
    axis: int = -1

    def _mx(self):
        return qf.MXFP8.replace(axis=self.axis)

    @property
    def element(self):
        return qf.MXFP8.element

    @property
    def layout(self):
        return qf.Blocked(self.axis, 32)

    def quantize(self, x):
        data, scale = self._mx().quantize(x)
        return data, {"e8m0": scale}

    def decode(self, data):
        return self._mx().decode(data)

    def scale_values(self, scale):
        return self._mx().scale_values(scale["e8m0"])

    def aim(self, contracted, free=None):
        del free
        return self.replace(axis=contracted)


DICT_MXFP8 = DictMXFP8()
