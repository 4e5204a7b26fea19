"""The format registry: names (case-insensitive) to :class:`ScaledFormat` values.

Installed packages contribute formats through the entry point group ``qformats.formats``; each
entry point loads to a ScaledFormat (registered under its ``name``), or to a callable returning one
or an iterable of them. Entry points are loaded once, on the first look-up.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from qformats._format import ScaledFormat

ENTRY_POINT_GROUP = "qformats.formats"

_FORMATS: dict[str, ScaledFormat] = {}
_ALIASES: dict[str, str] = {}
# Names registered with ``listed=False``: found by name, left out of the default listing (and so out of
# the test suites and benchmarks that run over every listed format).
_UNLISTED: set[str] = set()
_entry_points_loaded = False


class UnknownFormatError(KeyError, ValueError):
    """Raised by :func:`get_format` for a name that is not registered."""

    def __str__(self):  # KeyError would print the message quoted
        return str(self.args[0])


def register_format(
    fmt: ScaledFormat, name: str | None = None, *, overwrite: bool = False, aliases=(), listed: bool = True
) -> ScaledFormat:
    """Register ``fmt`` under ``name`` (default ``fmt.name``) and optional ``aliases``.

    Raises ``ValueError`` if the name is taken, unless ``overwrite=True``. Returns ``fmt`` so it can
    be used as ``MYFMT = register_format(MyFormat(...))``. ``listed=False`` registers a format that
    is found by name but not listed by :func:`list_formats` unless ``unlisted=True`` is asked for:
    the storage layouts of published checkpoints and the training-recipe operand formats, which are
    quantize/dequantize codecs rather than formats to carry through a whole program.
    """
    if not isinstance(fmt, ScaledFormat):
        raise TypeError(
            f"register_format expects a qformats.ScaledFormat, got {type(fmt).__name__}. "
            "Subclass qformats.ScaledFormat (see docs/custom_formats.md)."
        )
    key = (name or fmt.name).lower()
    for k in (key, *(a.lower() for a in aliases)):
        if not overwrite and (k in _FORMATS or k in _ALIASES) and _lookup(k) != fmt:
            raise ValueError(
                f"a format is already registered as {k!r}: {_lookup(k)!r}. Pick another name or pass overwrite=True."
            )
    _ALIASES.pop(key, None)
    _FORMATS[key] = fmt
    if listed:
        _UNLISTED.discard(key)
    else:
        _UNLISTED.add(key)
    for a in aliases:
        _ALIASES[a.lower()] = key
    return fmt


def _lookup(key):
    return _FORMATS.get(key) or _FORMATS.get(_ALIASES.get(key, ""))


def _load_entry_points():
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, ScaledFormat):
                obj = obj()
            for fmt in [obj] if isinstance(obj, ScaledFormat) else list(obj):
                if _lookup(fmt.name.lower()) != fmt:
                    register_format(fmt)
        except Exception as e:  # a broken plug-in must not break the library
            warnings.warn(f"could not load qformats format plug-in {ep.name!r} ({ep.value}): {e}", stacklevel=2)


def get_format(name) -> ScaledFormat:
    """The registered format called ``name`` (case-insensitive); a ScaledFormat is returned as is."""
    if isinstance(name, ScaledFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"get_format expects a format name or a ScaledFormat, got {type(name).__name__}")
    _load_entry_points()
    fmt = _lookup(name.lower())
    if fmt is None:
        raise UnknownFormatError(
            f"unknown format {name!r}. Known formats: {', '.join(list_formats())}"
            f" (aliases: {', '.join(sorted(_ALIASES))}). Register your own with qformats.register_format(fmt, name)."
        )
    return fmt


def list_formats(*, aliases: bool = False, unlisted: bool = False) -> list[str]:
    """Names of the registered formats, in registration order (plus aliases if asked).

    Formats registered with ``listed=False`` are included only with ``unlisted=True``.
    """
    _load_entry_points()
    names = [n for n in _FORMATS if unlisted or n not in _UNLISTED]
    return names + sorted(_ALIASES) if aliases else names


def unregister_format(name: str) -> None:
    """Remove a registered name and the aliases pointing to it (mainly for tests)."""
    key = name.lower()
    _FORMATS.pop(key, None)
    _UNLISTED.discard(key)
    for a in [a for a, k in _ALIASES.items() if k == key]:
        del _ALIASES[a]
