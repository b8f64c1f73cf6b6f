"""Integer parameters of the API, bounded to what both databases hold.

A number the schema lets through must never reach the database out of range: SQLite
refuses integers past 64 bits ("datatype mismatch", a 500 before these bounds) and
PostgreSQL's ``integer`` columns end at 2**31 - 1. So every integer the API reads is
declared with its range, which ninja enforces (a 422 naming the parameter) and the
OpenAPI schema shows (clients and schemathesis see the same limits):

- ids (BigAutoField primary keys, BIGINT / INTEGER): 0 ... 2**63 - 1
- counts, indices and rounds (``integer`` columns, offsets): 0 ... 2**31 - 1

`Paging` is ninja's limit/offset pagination with both bounded; list views use it.

Integers in JSON bodies are `JsonId` (or carry JSON_INTEGER): what JSON Schema calls an integer (``3`` or
``3.0``), never ``true`` or ``"3"``, which pydantic's lax mode would read as 1 and 3.
"""

from __future__ import annotations

from typing import Annotated, Any

from ninja import Field, Path, Query, Schema
from ninja.pagination import LimitOffsetPagination
from pydantic import BeforeValidator
from pydantic import Field as Range

MAX_ID = 2**63 - 1  # BIGINT (PostgreSQL) and INTEGER (SQLite) primary keys
MAX_INT = 2**31 - 1  # PostgreSQL integer: positive integer fields, offsets, indices
MAX_PAGE = 500


def _json_integer(value: Any) -> Any:
    """Let through what JSON Schema's "integer" admits; refuse booleans and strings."""
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"must be a JSON integer, not {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JSON_INTEGER = BeforeValidator(_json_integer)
# Body integers; the range inside the type, so it also holds under `| None`.
JsonId = Annotated[int, Range(ge=0, le=MAX_ID), JSON_INTEGER]  # ids, bytes, tokens

RunId = Annotated[int, Path(ge=0, le=MAX_ID, description="A run's id.")]
DatasetId = Annotated[int, Path(ge=0, le=MAX_ID, description="A dataset's id.")]
WorkerId = Annotated[int, Path(ge=0, le=MAX_ID, description="A worker's id.")]
TokenId = Annotated[int, Path(ge=0, le=MAX_ID, description="An enrollment token's id.")]
LeaseId = Annotated[int, Path(ge=0, le=MAX_ID, description="A lease's id.")]
PathIndex = Annotated[int, Path(ge=0, le=MAX_INT, description="A path's index in its run.")]


OptionalRound = Annotated[int | None, Query(ge=0, le=MAX_INT)]


class Paging(LimitOffsetPagination):
    """Limit/offset pagination: limit 1 ... MAX_PAGE (default 100), offset 0 ... MAX_INT."""

    class Input(Schema):
        limit: int = Field(100, ge=1, le=MAX_PAGE, description=f"At most {MAX_PAGE} items.")
        offset: int = Field(0, ge=0, le=MAX_INT, description="Items to skip.")

    def __init__(self, max_limit: int = MAX_PAGE, **kwargs: Any) -> None:
        super().__init__(max_limit=max_limit, **kwargs)
