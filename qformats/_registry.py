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
_entry_points_loaded = False


class UnknownFormatError(KeyError, ValueError):
    """Raised by :func:`get_format` for a name that is not registered."""

    def __str__(self):  # KeyError would print the message quoted
        return str(self.args[0])


def register_format(fmt: ScaledFormat, name: str | None = None, *, overwrite: bool = False, aliases=()) -> ScaledFormat:
    """Register ``fmt`` under ``name`` (default ``fmt.name``) and optional ``aliases``.

    Raises ``ValueError`` if the name is taken, unless ``overwrite=True``. Returns ``fmt`` so it can
    be used as ``MYFMT = register_format(MyFormat(...))``.
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


def list_formats(*, aliases: bool = False) -> list[str]:
    """Names of the registered formats, in registration order (plus aliases if asked)."""
    _load_entry_points()
    names = list(_FORMATS)
    return names + sorted(_ALIASES) if aliases else names


def unregister_format(name: str) -> None:
    """Remove a registered name and the aliases pointing to it (mainly for tests)."""
    key = name.lower()
    _FORMATS.pop(key, None)
    for a in [a for a, k in _ALIASES.items() if k == key]:
        del _ALIASES[a]
