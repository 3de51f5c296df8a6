"""Errors that carry an HTTP status, so they can travel to the one request they belong to."""
from __future__ import annotations

import json
from typing import Optional


class ConfigError(ValueError):
    """The model-config YAML is wrong. The message names the key and the fix."""


class RequestError(ValueError):
    """A client error in one request (bad body, bad parameter, over a limit)."""

    def __init__(self, message: str, parameter: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.parameter = parameter
        self.status = status

    def to_dict(self) -> dict:
        body = {"error": self.message, "error_type": _error_type(self.status), "code": self.status}
        if self.parameter is not None:
            body["parameter"] = self.parameter
        return body

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _error_type(status: int) -> str:
    return {
        400: "validation",
        413: "payload_too_large",
        415: "unsupported_media_type",
        503: "overloaded",
    }.get(status, "generation" if status >= 500 else "validation")
