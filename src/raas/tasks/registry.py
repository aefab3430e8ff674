"""Find the handler for an instance's ``data_source``: built-ins, runtime registrations, and entry points.

Third-party packages add tasks without touching raas by declaring an entry point in the ``raas.tasks``
group whose value is a :class:`~raas.tasks.base.TaskHandler` subclass; its name is the entry point's name.
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points

from raas.errors import RaasError
from raas.tasks.base import TaskHandler

ENTRY_POINT_GROUP = "raas.tasks"

_lock = threading.Lock()
_classes: dict[str, type[TaskHandler]] = {}
_instances: dict[str, TaskHandler] = {}
_broken: dict[str, str] = {}
_entry_points_loaded = False


def _builtin() -> dict[str, type[TaskHandler]]:
    from raas.tasks.final_number import FinalNumberHandler
    from raas.tasks.math import MathHandler

    return {MathHandler.name: MathHandler, FinalNumberHandler.name: FinalNumberHandler}


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _classes:
            continue  # an explicit registration wins over an installed plug-in
        try:
            cls = ep.load()
        except Exception as e:  # a broken plug-in must not take the service down
            _broken[ep.name] = f"entry point {ep.value!r} failed to load: {e}"
            continue
        if not (isinstance(cls, type) and issubclass(cls, TaskHandler)):
            _broken[ep.name] = f"entry point {ep.value!r} is not a TaskHandler subclass"
            continue
        _classes[ep.name] = cls


def _ensure() -> None:
    with _lock:
        for name, cls in _builtin().items():
            _classes.setdefault(name, cls)
        _load_entry_points()


def register(handler: type[TaskHandler], name: str | None = None, *, replace: bool = False) -> None:
    """Register a handler class under ``name`` (default: its ``name`` attribute)."""
    _ensure()
    key = name or getattr(handler, "name", None)
    if not key:
        raise RaasError("a task handler needs a name", kind="bad_request")
    with _lock:
        if key in _classes and not replace and _classes[key] is not handler:
            raise RaasError(f"task handler {key!r} is already registered", kind="bad_request")
        _classes[key] = handler
        _instances.pop(key, None)
        _broken.pop(key, None)


def unregister(name: str) -> None:
    """Drop a runtime registration (built-ins come back on the next lookup)."""
    with _lock:
        _classes.pop(name, None)
        _instances.pop(name, None)


def rescan() -> None:
    """Forget loaded plug-ins and read the ``raas.tasks`` entry points again (after installing one)."""
    global _entry_points_loaded
    with _lock:
        _entry_points_loaded = False
        _broken.clear()
        _instances.clear()


def list_handlers() -> list[str]:
    """Names of every handler that can be looked up."""
    _ensure()
    return sorted(_classes)


def get_handler(data_source: str) -> TaskHandler:
    """The (shared, stateless) handler instance for ``data_source``; ``bad_request`` when unknown."""
    _ensure()
    if not isinstance(data_source, str) or not data_source:
        raise RaasError("instance.data_source is missing", kind="bad_request")
    with _lock:
        inst = _instances.get(data_source)
        if inst is not None:
            return inst
        cls = _classes.get(data_source)
        if cls is None:
            if data_source in _broken:
                raise RaasError(
                    f"task handler {data_source!r} is unavailable: {_broken[data_source]}", kind="bad_request"
                )
            known = ", ".join(sorted(_classes))
            raise RaasError(f"unknown data_source {data_source!r} (known: {known})", kind="bad_request")
        try:
            inst = cls()
        except Exception as e:
            raise RaasError(
                f"task handler {data_source!r} failed to construct: {e}", kind="handler_error"
            ) from e
        _instances[data_source] = inst
        return inst
