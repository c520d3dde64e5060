"""Error types. Every message says what to do about it."""

from __future__ import annotations


class PDError(Exception):
    """Base of every pdserve error."""


class ConfigError(PDError):
    """Invalid configuration (flag, environment variable, file). CLI exits 2 with the message."""


class PluginError(PDError):
    """A plugin failed to load, or a name is unknown or registered twice."""


class UnknownNameError(PluginError):
    """A backend / pool / platform / planner name nobody registered."""


class DuplicateNameError(PluginError):
    """Two plugins registered the same name of the same kind."""


class UnavailableError(PluginError):
    """The named component is installed but cannot run here (missing SDK or hardware)."""


class ModelLoadError(PDError):
    """The model could not be found or loaded."""


class InvalidRequestError(PDError):
    """A request is malformed; the HTTP layer answers 400 with this message."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ForbiddenRouteError(InvalidRequestError):
    """A request names a PD route this server may not act on; the HTTP layer answers 403 with
    `code` (a `pdcore.messages.codes.ErrorCode` value; None: "route_refused") as the error
    body's `code`, which routers read instead of the message."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message, field)
        self.code = code


class TransferError(PDError):
    """A KV transfer failed. `room` identifies the request."""

    def __init__(self, message: str, room: int | None = None) -> None:
        super().__init__(message)
        self.room = room


class ProtocolError(PDError):
    """A control-plane message was malformed, of another version, or unauthenticated."""


# The HTTP header (value "client") a server puts on an error answer the client caused that its
# status alone does not say, e.g. the 504 of a request whose own `timeout` ran out. The router
# passes such an answer on as it is, retries nothing and counts nothing against the server's
# circuit breaker (pdcore/router/circuit.py has the rule).
ERROR_ORIGIN_HEADER = "x-pd-error-origin"
