"""A small registry of named implementations: the one pattern behind every extension point.

MoE backends (:data:`replicas.kernels.moe.backend.MOE_BACKENDS`), persistent backends
(:data:`replicas.persistent.contract.PERSISTENT_BACKENDS`) and model families
(:data:`replicas.models.base.MODELS`) are each one :class:`Registry`. An implementation is a class
that subclasses its concept's base class, declares its capabilities as class attributes (read
before anything is built) and registers itself once, in its own file::

    @MOE_BACKENDS.register("triton_tc")
    class TritonTc(MoEBackend):
        ...

The registry's :meth:`~Registry.names` (registration order) are the allowed values of the
matching engine/app config field and CLI flag, so a new implementation needs no other edit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named implementations of one concept, in registration order.

    Args:
        concept: what the names name (``"moe_backend"``, ``"persistent backend"``, ...), used in messages.
        base: when given, :meth:`register` accepts only subclasses of it.
        modules: modules that register implementations when imported, imported on the first lookup (so that
            importing the registry stays cheap). Their entries come first, in this order of modules,
            whatever order they were imported in; other entries follow in registration order.

    Lookups of a name that is not registered raise ``KeyError`` (callers with their own error type, e.g.
    :class:`~replicas.kernels.moe.MoEBackendError`, check :meth:`__contains__` first).
    """

    def __init__(self, concept: str, base: type | None = None, modules: tuple[str, ...] = ()):
        self.concept = concept
        self.base = base
        self._modules = tuple(modules)
        self._discovered = not self._modules
        self._entries: dict[str, T] = {}

    def _discover(self) -> None:
        if not self._discovered:
            self._discovered = True  # before the imports: they call register()
            for module in self._modules:
                importlib.import_module(module)

    def _rank(self, entry: T) -> int:
        module = getattr(entry, "__module__", None)
        return self._modules.index(module) if module in self._modules else len(self._modules)

    def register(self, name: str) -> Callable[[T], T]:
        """A class decorator that registers the class under ``name`` and returns it unchanged (it also
        sets the class's ``name`` attribute to ``name``).

        Raises:
            ValueError: ``name`` is already registered.
            TypeError: the class is not a subclass of the registry's ``base``.
        """

        def decorator(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.concept} {name!r} is already registered (by {self._entries[name]!r})")
            if self.base is not None and not (isinstance(entry, type) and issubclass(entry, self.base)):
                raise TypeError(f"{self.concept} {name!r}: {entry!r} is not a subclass of {self.base.__name__}")
            if isinstance(entry, type):
                entry.name = name
            self._entries[name] = entry
            # listed modules first, in their order (a stable sort keeps registration order within a rank)
            self._entries = dict(sorted(self._entries.items(), key=lambda kv: self._rank(kv[1])))
            return entry

        return decorator

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return its entry (tests register toy implementations and remove them).

        Raises:
            KeyError: ``name`` is not registered.
        """
        self._discover()
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
            KeyError: ``name`` is not registered (the message lists the registered names).
        """
        self._discover()
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.concept} {name!r}; registered: {', '.join(self._entries)}") from None

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        self._discover()
        return tuple(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        """``(name, entry)`` pairs, in registration order."""
        self._discover()
        return iter(tuple(self._entries.items()))

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._discover()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.concept!r}, {list(self._entries)})"


class OneOf:
    """Pydantic field metadata: the value must be one of ``fixed`` or a name in ``registry`` *at validation
    time* (so an implementation registered later, e.g. by a test, is accepted and listed), and the CLI
    offers those values as its choices (:meth:`choices`)::

        moe_backend: Annotated[str, OneOf(MOE_REGISTRY, fixed=("auto",))] = "auto"

    Validation raises ``ValueError`` (pydantic reports it as a ``ValidationError`` naming the field) with
    the allowed values in the message.
    """

    def __init__(self, registry: Registry, fixed: tuple[str, ...] = ()):
        self.registry = registry
        self.fixed = tuple(fixed)

    def choices(self) -> tuple[str, ...]:
        """The allowed values now: ``fixed``, then the registered names in registration order."""
        return (*self.fixed, *self.registry.names())

    def validate(self, value: str) -> str:
        if value not in self.choices():
            raise ValueError(f"{value!r} is not a {self.registry.concept}; choose one of {', '.join(self.choices())}")
        return value

    def __get_pydantic_core_schema__(self, source, handler):
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.validate, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        out = handler(schema)
        out["enum"] = list(self.choices())
        return out

    def __repr__(self) -> str:
        return f"OneOf({self.registry.concept!r}, {list(self.choices())})"
