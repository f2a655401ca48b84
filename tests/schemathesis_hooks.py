"""Schemathesis hooks for the env server's conformance run (`SCHEMATHESIS_HOOKS=schemathesis_hooks`).

The run lets schema-valid requests be answered 410 (the session was closed: a state, as 404 and 409 are)
and 422 (on create: the env refused the task, which is any JSON object in the document). This check
keeps that allowance narrow: a schema-valid request may get 422 only as the env's verdict, never as
`invalid_request`, which would mean the server validates more strictly than its document says.
"""

from __future__ import annotations

import schemathesis
from schemathesis.checks import Failure


class ValidDataRefused(Failure):
    """A schema-valid request failed the server's own validation."""


@schemathesis.check
def valid_data_passes_validation(ctx, response, case) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    body = response.json()
    if body.get("code") == "invalid_request":
        raise ValidDataRefused(
            operation=case.operation.label,
            title="Schema-valid request failed validation",
            message=f"the document allows this request, the server said: {body.get('message')}",
        )
    return None
