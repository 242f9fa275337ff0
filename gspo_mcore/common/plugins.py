"""Extension points named in the config: a built-in name or an import path `module:function`."""

from __future__ import annotations

import importlib
from typing import Callable

from gspo_mcore.common.errors import InputError


def by_name(name: str, built_in: dict[str, Callable], what: str) -> Callable:
    """`built_in[name]`, else the function `module:function` names; a one-line InputError
    naming `what` (the config field) otherwise."""
    if name in built_in:
        return built_in[name]
    module_name, sep, function_name = name.partition(":")
    if not sep:
        raise InputError(f"{what} {name!r}: not one of {sorted(built_in)} nor 'module:function'")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise InputError(f"{what} {name!r}: cannot import ({err})") from None
    if not callable(function):
        raise InputError(f"{what} {name!r}: not callable")
    return function
