"""Which task handler runs an instance's ``data_source``: one :class:`HandlerRegistry` per service.

A registry holds the built-in handlers, the ``raas.tasks`` entry points of installed packages and what is
registered on it at runtime (``ServiceConfig.extra_handlers``, tests). Each service owns its own, so two
services in one process never see, or overwrite, each other's handlers.

Third-party packages add tasks without touching raas by declaring an entry point in the ``raas.tasks``
group whose value is a :class:`~raas.tasks.base.TaskHandler` subclass; its name is the entry point's name.
"""

from __future__ import annotations

import importlib
import logging
import threading
from importlib.metadata import entry_points

from raas.errors import RaasError
from raas.tasks.base import TaskHandler

ENTRY_POINT_GROUP = "raas.tasks"

log = logging.getLogger(__name__)


CODE_ALIASES = ("humaneval", "codecontests", "deepcoder")
"""Other ``data_source`` names the code handler answers to (datasets name themselves)."""


def builtin_handlers() -> dict[str, type[TaskHandler]]:
    """The handlers raas itself ships, by every ``data_source`` they answer to."""
    from raas.tasks.code import CodeHandler
    from raas.tasks.final_number import FinalNumberHandler
    from raas.tasks.harness import HarnessHandler
    from raas.tasks.lookup import LookupHandler
    from raas.tasks.math import MathHandler
    from raas.tasks.stem import StemHandler
    from raas.tasks.swe.handler import ALIASES, SweHandler
    from raas.tasks.swe.mini.handler import SweMiniHandler

    handlers: dict[str, type[TaskHandler]] = {
        MathHandler.name: MathHandler,
        FinalNumberHandler.name: FinalNumberHandler,
        CodeHandler.name: CodeHandler,
        StemHandler.name: StemHandler,
        HarnessHandler.name: HarnessHandler,
        LookupHandler.name: LookupHandler,
    }
    handlers.update({alias: CodeHandler for alias in CODE_ALIASES})
    handlers.update(dict.fromkeys((SweHandler.name, *ALIASES), SweHandler))
    handlers[SweMiniHandler.name] = SweMiniHandler
    return handlers


def load_handler_class(target: str) -> type[TaskHandler]:
    """The :class:`TaskHandler` subclass ``"module:Class"`` names, or ``bad_request`` saying why not."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise RaasError(f"a task handler is named 'module:Class', got {target!r}", kind="bad_request")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RaasError(f"cannot load task handler {target!r}: {exc}", kind="bad_request") from exc
    if not (isinstance(cls, type) and issubclass(cls, TaskHandler)):
        raise RaasError(f"task handler {target!r} is not a TaskHandler subclass", kind="bad_request")
    return cls


class HandlerRegistry:
    """Handler classes by ``data_source`` and one (shared, stateless) instance of each, made on first use.

    ``builtins`` and ``entry_points`` choose the sources read besides explicit registrations; an explicit
    registration wins over an installed plug-in of the same name."""

    def __init__(self, *, builtins: bool = True, entry_points: bool = True) -> None:
        self._lock = threading.Lock()
        self._classes: dict[str, type[TaskHandler]] = dict(builtin_handlers()) if builtins else {}
        self._instances: dict[str, TaskHandler] = {}
        self._broken: dict[str, str] = {}
        self._explicit: set[str] = set()
        self._read_entry_points = entry_points
        self._entry_points_loaded = not entry_points

    def _ensure(self) -> None:
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in self._explicit:
                    continue
                try:
                    cls = ep.load()
                except Exception as e:  # a broken plug-in must not take the service down
                    self._broken[ep.name] = f"entry point {ep.value!r} failed to load: {e}"
                    continue
                if not (isinstance(cls, type) and issubclass(cls, TaskHandler)):
                    self._broken[ep.name] = f"entry point {ep.value!r} is not a TaskHandler subclass"
                    continue
                self._classes[ep.name] = cls

    def warm_up(self) -> None:
        """Let each registered handler class start its background warm-up (see :meth:`TaskHandler.warm_up`)."""
        self._ensure()
        with self._lock:
            classes = list(dict.fromkeys(self._classes.values()))
        hooks: dict[object, type[TaskHandler]] = {}
        for cls in classes:  # a subclass that inherits its parent's hook (swe-mini's) shares one warm-up
            hooks.setdefault(getattr(cls.warm_up, "__func__", cls.warm_up), cls)
        for cls in hooks.values():
            try:
                cls.warm_up()
            except Exception as e:  # a plug-in's warm-up is an optimisation; it must not stop the service
                log.warning("warm-up of task handler %s failed: %s", cls.__qualname__, e)

    def register(self, handler: type[TaskHandler], name: str | None = None, *, replace: bool = False) -> None:
        """Register a handler class under ``name`` (default: its ``name`` attribute)."""
        self._ensure()
        key = name or getattr(handler, "name", None)
        if not key:
            raise RaasError("a task handler needs a name", kind="bad_request")
        with self._lock:
            if key in self._classes and not replace and self._classes[key] is not handler:
                raise RaasError(f"task handler {key!r} is already registered", kind="bad_request")
            self._classes[key] = handler
            self._explicit.add(key)
            self._instances.pop(key, None)
            self._broken.pop(key, None)

    def register_target(self, name: str, target: str) -> None:
        """Register ``"module:Class"`` under ``name``, replacing what was there (``extra_handlers``)."""
        self.register(load_handler_class(target), name, replace=True)

    def unregister(self, name: str) -> None:
        """Drop a handler from this registry (a built-in or plug-in comes back only with a new registry)."""
        with self._lock:
            self._classes.pop(name, None)
            self._instances.pop(name, None)
            self._explicit.discard(name)

    def rescan(self) -> None:
        """Read the ``raas.tasks`` entry points again on the next lookup (after installing a plug-in)."""
        with self._lock:
            self._entry_points_loaded = not self._read_entry_points
            self._broken.clear()
            self._instances.clear()

    def names(self) -> list[str]:
        """Names of every handler that can be looked up."""
        return sorted(self.classes())

    def classes(self) -> dict[str, type[TaskHandler]]:
        """Every handler class by name (none is instantiated)."""
        self._ensure()
        with self._lock:
            return dict(self._classes)

    def get(self, data_source: str) -> TaskHandler:
        """The handler instance for ``data_source``; ``bad_request`` when unknown or unavailable."""
        self._ensure()
        if not isinstance(data_source, str) or not data_source:
            raise RaasError("instance.data_source is missing", kind="bad_request")
        with self._lock:
            inst = self._instances.get(data_source)
            if inst is not None:
                return inst
            cls = self._classes.get(data_source)
            if cls is None:
                if data_source in self._broken:
                    raise RaasError(
                        f"task handler {data_source!r} is unavailable: {self._broken[data_source]}",
                        kind="bad_request",
                    )
                known = ", ".join(sorted(self._classes))
                raise RaasError(f"unknown data_source {data_source!r} (known: {known})", kind="bad_request")
            try:
                inst = cls()
            except Exception as e:
                raise RaasError(
                    f"task handler {data_source!r} failed to construct: {e}", kind="handler_error"
                ) from e
            self._instances[data_source] = inst
            return inst
