"""An attribute of an object composed of parts that one of its parts owns: the decode engine's view of its
:class:`~laconic_nemo.rollout.stage.Stage` (``engine.fused`` is ``engine.stage.fused``) and the megatron-core
actor's settings held by its parts (``actor.lr`` is ``actor.stepper.lr``)."""

from __future__ import annotations

from typing import Any


class PartAttribute:
    """``obj.<name>`` reads (and, unless ``read_only``, writes) ``obj.<part>.<name>``; a write to a read-only one
    raises AttributeError naming where the value lives."""

    def __init__(self, part: str, read_only: bool = False):
        self.part, self.read_only, self.name = part, read_only, ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"``{self.part}.{name}``" + (" (read-only)" if self.read_only else "")

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if self.read_only:
            raise AttributeError(f"{self.name} is {self.part}.{self.name}, fixed when the object is built")
        setattr(getattr(obj, self.part), self.name, value)
