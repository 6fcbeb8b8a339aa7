"""Checks a class against one of ATOM's impl protocols (`atom.layers.attention_impl`):
every method the protocol declares, with the same parameter names in the same order.

`isinstance` against a runtime-checkable protocol only asks whether the names exist; a
host impl whose `forward` takes other arguments would pass it and fail at the first step.
"""

from __future__ import annotations

import inspect
from typing import Any


def _protocol_methods(protocol: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in vars(protocol).items()
        if callable(member) and not name.startswith("_")
    }


def _parameter_names(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def contract_problems(cls: type, protocol: type) -> list[str]:
    """What `cls` lacks or takes differently from `protocol`'s methods (empty: conforms)."""
    problems = []
    for name, declared in _protocol_methods(protocol).items():
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"{cls.__qualname__} has no {name}()")
            continue
        want, got = _parameter_names(declared), _parameter_names(method)
        if got != want:
            problems.append(
                f"{cls.__qualname__}.{name}{tuple(got)}: {protocol.__name__} takes {tuple(want)}"
            )
    return problems
