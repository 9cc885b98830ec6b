"""Option types the commands share: numbers checked against a range, and comma-separated tuples
and lists of them. A value out of range is a usage error (exit status 2) whose one line names the
option and the range, before any work starts: a zero rate that would divide by zero, or a
negative one that would never end, never reaches the simulator.

No command logic lives here; each command picks its ranges.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import click

if TYPE_CHECKING:  # click >= 8.2 types ParamType by its output; 8.1 (allowed) has no subscript
    _TupleParam = click.ParamType[tuple[float, ...] | None, Any]
    _ListParam = click.ParamType[list[float], Any]
    _Choice = click.Choice[str]
else:
    _TupleParam = _ListParam = click.ParamType
    _Choice = click.Choice

__all__ = ["BugName", "FloatList", "FloatTuple", "Number"]


class Number(click.FloatRange):
    """A finite float in a range (click's `FloatRange` lets ``nan`` through every bound, and
    ``inf`` through an open one). `what` names the quantity in the error ("a positive number
    of seconds")."""

    def __init__(
        self,
        min: float | None = None,
        max: float | None = None,
        *,
        min_open: bool = False,
        max_open: bool = False,
        what: str | None = None,
    ) -> None:
        super().__init__(min, max, min_open=min_open, max_open=max_open)
        self.what = what

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            # click parses strings too, whatever its annotation says.
            rv = float(super().convert(cast(float, value), param, ctx))
        except click.BadParameter:
            if self.what is None:
                raise
            rv = math.nan
        if not math.isfinite(rv):
            what = self.what or "a finite number"
            self.fail(f"must be {what} in the range {self._describe_range()}, got {value}.", param, ctx)
        return rv

    def describe(self) -> str:
        return self._describe_range()


class FloatTuple(_TupleParam):
    """``A,B[,C]``: one number per field, each in its own range; ``none`` or ``off`` for None."""

    name = "tuple"

    def __init__(self, fields: tuple[tuple[str, Number], ...]) -> None:
        self.fields = fields
        self.name = ",".join(f for f, _ in fields)

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[float, ...] | None:
        if value is None or isinstance(value, tuple):
            return value
        text = str(value).strip()
        if text.lower() in ("none", "off", ""):
            return None
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != len(self.fields):
            self.fail(f"expected {self.name} ({len(self.fields)} numbers) or 'none', got {text!r}.", param, ctx)
        out = []
        for (field, kind), part in zip(self.fields, parts, strict=True):
            try:
                number = float(part)
            except ValueError:
                self.fail(f"{field} must be a number, got {part!r}.", param, ctx)
            if not _within(kind, number):
                self.fail(f"{field} {part} is not in the range {kind.describe()}.", param, ctx)
            out.append(number)
        return tuple(out)


class FloatList(_ListParam):
    """``A,B,...``: one or more numbers, each in `kind`'s range."""

    name = "list"

    def __init__(self, kind: Number, *, max_items: int) -> None:
        self.kind = kind
        self.max_items = max_items

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> list[float]:
        if isinstance(value, list):
            return value
        parts = [p.strip() for p in str(value).split(",") if p.strip()]
        if not parts or len(parts) > self.max_items:
            self.fail(f"expected 1 to {self.max_items} comma-separated numbers, got {value!r}.", param, ctx)
        out = []
        for part in parts:
            try:
                number = float(part)
            except ValueError:
                self.fail(f"{part!r} is not a number.", param, ctx)
            if not _within(self.kind, number):
                self.fail(f"{part} is not in the range {self.kind.describe()}.", param, ctx)
            out.append(number)
        return out


def _within(kind: Number, number: float) -> bool:
    try:
        kind.convert(number, None, None)
    except click.BadParameter:
        return False
    return True


class BugName(_Choice):
    """An ``--inject-bug`` name: one of `names`, or an earlier name in `renamed` (taken for the
    name it became, with a deprecation note on stderr). `--help` lists the current names and
    then the earlier ones, so a script written for them still runs and says what to change."""

    def __init__(self, names: list[str], renamed: dict[str, str]) -> None:
        super().__init__(sorted(names))
        self.renamed = dict(renamed)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value in self.renamed:
            new = self.renamed[value]
            click.echo(
                f"note: --inject-bug {value} is deprecated: it is now {new} (one name in check and sim)", err=True
            )
            value = new
        return super().convert(value, param, ctx)

    def deprecation(self) -> str:
        """The earlier names, for the option's help."""
        if not self.renamed:
            return ""
        return (
            " Deprecated earlier names, still accepted: "
            + ", ".join(f"{old} (now {new})" for old, new in sorted(self.renamed.items()))
            + "."
        )
