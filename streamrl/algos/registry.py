"""Registries of algorithm pieces the trainer and the advantage stage call by name.

An algorithm is a choice of small pure functions, one per role (advantage estimator, policy loss,
...). Each role has a ``Registry``: the built-ins register themselves under a short name
(``@ADVANTAGES.register("rloo")``), and a config may name either a registered name or any
importable function as ``module:function`` (the same form as a pipeline's stages). ``resolve``
checks the function's signature against the role's required parameters once, when the config is
validated, so a wrong function fails before any process starts, naming itself and what it lacks.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class UnknownAlgorithmError(ValueError):
    """A name that is neither registered nor an importable ``module:function``, or a function
    whose signature does not fit its role."""


class Registry(Generic[F]):
    """Named functions of one role; ``required``: the parameters every one of them must accept
    (by name, as the caller passes them); ``optional``: inputs the caller passes only to a function
    that names them (e.g. an advantage estimator's ``values``, which only a pipeline with a critic
    has), so a function may require them without a default."""

    def __init__(self, role: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
        self.role = role
        self.required = required
        self.optional = optional
        self._functions: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register the function under ``name`` (a name may be registered once)."""

        def add(fn: F) -> F:
            if name in self._functions and self._functions[name] is not fn:
                raise ValueError(f"{self.role} {name!r} is already registered ({self._functions[name].__module__})")
            self.check_signature(fn, name)
            self._functions[name] = fn
            return fn

        return add

    def names(self) -> list[str]:
        return sorted(self._functions)

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def resolve(self, name: str) -> F:
        """The function ``name`` names: a registered name, or ``module:function``."""
        if name in self._functions:
            return self._functions[name]
        if ":" not in name:
            close = difflib.get_close_matches(name, self._functions, n=2, cutoff=0.5)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise UnknownAlgorithmError(
                f"unknown {self.role} {name!r}; {hint}registered: {', '.join(self.names())} "
                "(or name your own function as module:function)")
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownAlgorithmError(f"{self.role} {name!r}: cannot import module {module_name!r} ({exc})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise UnknownAlgorithmError(f"{self.role} {name!r}: module {module_name!r} has no function {attr!r}")
        self.check_signature(fn, name)
        return fn  # type: ignore[no-any-return]

    def check_signature(self, fn: Callable[..., Any], name: str) -> None:
        """Refuse a function that cannot be called with the role's parameters by name."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return  # a builtin without a signature: it is called as it is
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        named = {n for n, p in params.items()
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
        missing = [r for r in self.required if r not in named and not takes_any]
        passed = (*self.required, *self.optional)
        extra = [n for n, p in params.items() if n not in passed and p.default is inspect.Parameter.empty
                 and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        if missing or extra:
            what = []
            if missing:
                what.append(f"lacks the parameter(s) {', '.join(missing)}")
            if extra:
                what.append(f"requires parameter(s) the caller does not pass: {', '.join(extra)}")
            raise UnknownAlgorithmError(
                f"{self.role} {name!r} ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}) "
                f"{' and '.join(what)}; a {self.role} is called as fn({', '.join(f'{r}=...' for r in self.required)})")
