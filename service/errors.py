"""Errors the service raises on purpose, each with its HTTP status; the app turns them into
`{"detail": "..."}` responses. The message is for the user: what was wrong and what to do.
"""

from __future__ import annotations

import math


class ServiceError(Exception):
    status_code = 400

    def __init__(self, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers


class BadRequestError(ServiceError):
    status_code = 400


class UnauthorizedError(ServiceError):
    status_code = 401

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": "Bearer"})


class ForbiddenError(ServiceError):
    status_code = 403


class NotFoundError(ServiceError):
    status_code = 404


class ConflictError(ServiceError):
    status_code = 409


class LeaseLostError(ConflictError):
    """A worker presented a lease token that is not the job's current one."""


class PayloadTooLargeError(ServiceError):
    status_code = 413


class UnsupportedMediaTypeError(ServiceError):
    status_code = 415


class UnprocessableError(ServiceError):
    status_code = 422


class RequestTimeoutError(ServiceError):
    status_code = 408


class TooManyRequestsError(ServiceError):
    status_code = 429

    def __init__(self, detail: str, retry_after_seconds: float) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, math.ceil(retry_after_seconds)))})


class QuotaExceededError(ServiceError):
    """A count the tenant may not exceed (no waiting helps: something must be deleted first)."""

    status_code = 429
