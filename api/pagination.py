"""Cursor pagination as OpenAI does it: ``after`` (an id from the previous page), ``limit``, ``has_more``.

Ids from ``core.ids.new_id`` sort by creation time, so "the page after X" is simply "ids below X"
(newest first) and needs no lookup: a cursor stays valid even after X itself is deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Generic, Literal, TypeVar

from fastapi import Query
from pydantic import BaseModel
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel.sql.expression import SelectOfScalar

T = TypeVar("T")
R = TypeVar("R")
P = TypeVar("P", bound="ListPage")

DEFAULT_LIMIT = 20
MAX_LIMIT = 100

Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="How many objects to return (1-100).")]
After = Annotated[
    str | None,
    Query(
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:-]*$",
        description="Return objects after this id (the last id of the previous page).",
    ),
]
Order = Annotated[Literal["asc", "desc"], Query(description="By creation time: newest first (desc) or oldest.")]


class ListPage(BaseModel, Generic[T]):
    """One page of a list: OpenAI's ``{"object": "list", "data", "has_more"}`` plus first and last ids."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


def page_query(
    stmt: SelectOfScalar[R], id_column: Any, *, after: Any | None, limit: int, descending: bool = True
) -> SelectOfScalar[R]:
    """``stmt`` narrowed to the page after ``after``, fetching one extra row to learn ``has_more``."""
    column: ColumnElement = id_column
    if after is not None:
        stmt = stmt.where(column < after if descending else column > after)
    return stmt.order_by(column.desc() if descending else column.asc()).limit(limit + 1)


def build_page(page: type[P], rows: Sequence[R], limit: int, render: Callable[[R], Any]) -> P:
    """A ``page`` of the rendered ``rows`` (from :func:`page_query`): the first ``limit``, and whether more follow."""
    data = [render(row) for row in rows[:limit]]
    return page(
        data=data,
        has_more=len(rows) > limit,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )
