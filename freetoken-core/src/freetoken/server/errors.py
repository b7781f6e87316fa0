"""OpenAI-style errors: one exception type, the JSON body, and request-body parsing.

Every failure the server reports has the shape
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

import json
from typing import Any, Optional, TypeVar, Union

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from freetoken.server.protocol import ErrorInfo, ErrorResponse, FieldError

M = TypeVar("M", bound=BaseModel)

#: HTTP status -> OpenAI error ``type``.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error to return to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[Union[str, int]] = None,
        type: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump(mode="json")

    def response(self, headers: Optional[dict[str, str]] = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, **kwargs: Any) -> dict[str, Any]:
    return APIError(status, message, **kwargs).body()


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _loc_to_param(loc: tuple[Any, ...]) -> Optional[str]:
    """('messages', 0, 'role') -> 'messages.0.role'; union branch names are dropped."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, str) and (item in _UNION_TAGS or any(c in item for c in "[]()")):
            break  # a union branch: report the field itself, not the branch's inside
        parts.append(str(item))
    return ".".join(parts) or None


def _describe(err: dict[str, Any]) -> str:
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "missing":
        return "field required"
    if err.get("type") == "extra_forbidden":
        return "unknown field"
    return msg.removeprefix("Value error, ")


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate a JSON request body against ``model``; failures raise a 400 APIError."""
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        parsed = model.model_validate_json(raw)
        check = getattr(parsed, "check", None)
        if check is not None:
            check()
        return parsed
    except FieldError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first.get("type") == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {first.get('msg')}", code="invalid_json") from None
        if first.get("type") == "model_type" and not first.get("loc"):
            raise APIError(400, "request body must be a JSON object", code="invalid_json") from None
        # Report the first problem of the most specific location, plus a count.
        loc = tuple(first.get("loc", ()))
        param = _loc_to_param(loc)
        message = f"{param}: {_describe(first)}" if param else _describe(first)
        if len(errors) > 1:
            others = sorted({_loc_to_param(tuple(e.get("loc", ()))) or "body" for e in errors[1:]} - {param or "body"})
            if others:
                message += f" (also invalid: {', '.join(o for o in others if o)})"
        raise APIError(400, message, param=param, code="invalid_value") from None


def json_dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
