"""Registries: the extension points of fasttrain (prediction types, weightings, timestep samplers,
models, generation solvers). An entry is a class or function that registers itself under a name;
its keyword arguments and defaults come from its signature, so config help, validation and the
one-line errors are derived here, once, for every extension point.

    REG = Registry("weighting")
    @REG.register("min_snr")
    def min_snr(schedule, gamma: float = 5.0): ...

Packages that hold extensions import every module they contain (`discover`), so a new extension is
one file (plus its test).
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

from .errors import InvalidInput


class Registry:
    def __init__(self, kind: str, positional: int = 0, defaults: dict | None = None):
        self.kind = kind
        self.positional = positional  # leading parameters that are not user arguments (e.g. schedule)
        self.defaults = dict(defaults or {})  # what every entry declares (`register(name, key=value)`)
        self._items: dict[str, Any] = {}

    def register(self, name: str, **meta) -> Callable:
        """Register under `name`; `meta` (over the registry's `defaults`) become attributes of the entry:
        what it declares about itself (e.g. a solver's spacing, a model's `check` of its sizes)."""
        unknown = set(meta) - set(self.defaults)
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown declaration {sorted(unknown)[0]!r} "
                             f"(this registry takes {', '.join(self.defaults) or 'none'})")

        def deco(obj):
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if inspect.isclass(obj):
                obj.name = name
            self._items[name] = obj
            for k, v in {**self.defaults, **meta}.items():
                setattr(obj, k, v)
            return obj

        return deco

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self):
        return iter(self._items)

    def get(self, name: str):
        if name not in self._items:
            raise InvalidInput(f"unknown {self.kind} {name!r}; choose from {', '.join(self._items)}")
        return self._items[name]

    def args(self, name: str) -> dict[str, Any]:
        """User-settable keyword arguments of an entry and their defaults (inspect.Parameter.empty if none)."""
        obj = self.get(name)
        target = obj.__init__ if inspect.isclass(obj) else obj
        params = list(inspect.signature(target).parameters.values())
        if inspect.isclass(obj):
            params = params[1:]  # self
        params = params[self.positional:]
        return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def check_args(self, name: str, args: dict, where: str | None = None) -> None:
        """One-line errors for unknown arguments and values of the wrong type (judged by the default)."""
        allowed = self.args(name)
        for key, value in args.items():
            label = f"{where}.{key}" if where else key
            if key not in allowed:
                raise InvalidInput(f"unknown argument '{label}' ({self.kind} {name!r} takes: "
                                 f"{', '.join(allowed) or 'no arguments'})")
            problem = type_problem(allowed[key], value)
            if problem:
                raise InvalidInput(f"bad value for '{label}': {value!r} ({problem})")

    def check(self, name: str, **context) -> None:
        """The entry's own check of a configuration (its `check` declaration, if the registry has one):
        e.g. a model's sizes against the image size. Raises InvalidInput."""
        if "check" not in self.defaults:
            return
        fn = self.get(name).check
        if fn is not None:
            defaults = {k: v for k, v in self.args(name).items() if v is not inspect.Parameter.empty}
            fn(**{**defaults, **context})

    def build(self, name: str, *args, **kwargs):
        self.check_args(name, kwargs)
        return self.get(name)(*args, **kwargs)


def type_problem(default, value) -> str | None:
    """Why `value` cannot stand where `default` stands (None if it can)."""
    if default is inspect.Parameter.empty or default is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "a number"
        return None if value == value and abs(value) != float("inf") else "a finite number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    if isinstance(default, (tuple, list)):
        return None if isinstance(value, (tuple, list)) else "a list"
    return None


def discover(package: str) -> None:
    """Import every module of a package, so that the extensions in it register themselves."""
    pkg = importlib.import_module(package)
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{m.name}")
