"""The exceptions asyncllm raises about its engine (a leaf module).

Bad input is a `ValueError` or `TypeError` naming the field; these are for everything
else a caller has to tell apart.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone (killed, crashed, shut down); nothing more will come."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message carries its reason."""


class EngineOverloadedError(RuntimeError):
    """The engine refused a request: too many are already waiting."""


class RequestFailedError(RuntimeError):
    """The engine core accepted a request and then failed it; the engine lives on."""


__all__ = [
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStartupError",
    "RequestFailedError",
]
