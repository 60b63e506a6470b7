"""Money: ``Decimal`` end to end, stored as exact integers of micro-units.

Six decimal places (the range of SQL ``Numeric(18, 6)``) are kept internally; amounts are
quantized to the cent only for display. Storing integers of micro-units keeps sums
exact and identical on SQLite (which has no decimal type and would round through float)
and PostgreSQL.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from lattice_common.errors import ValidationError

QUANTUM = Decimal("0.000001")
CENT = Decimal("0.01")
MICROS = 1_000_000
# Numeric(18, 6): 12 digits before the point
MAX_AMOUNT = Decimal("999999999999.999999")
ZERO = Decimal(0)


def quantize(x: Decimal) -> Decimal:
    """To the stored precision (6 places), banker's rounding: for computed costs."""
    return x.quantize(QUANTUM, rounding=ROUND_HALF_EVEN)


def cents(x: Decimal) -> Decimal:
    """To the cent, for display."""
    return x.quantize(CENT, rounding=ROUND_HALF_EVEN)


def fmt(x: Decimal) -> str:
    return f"{cents(x):.2f}"


def to_micros(x: Decimal) -> int:
    return int(x.scaleb(6).to_integral_value(rounding=ROUND_HALF_EVEN))


def from_micros(n: int | None) -> Decimal:
    return Decimal(int(n or 0)).scaleb(-6)


def parse_amount(value: object, what: str = "amount", *, allow_zero: bool = False) -> Decimal:
    """A strictly positive (or, with ``allow_zero``, non-negative) amount with at most 6
    decimal places, from a Decimal, an int or a numeric string. Floats (and bools) are
    refused: a float cannot say 0.10 exactly."""
    if isinstance(value, bool | float):
        raise ValidationError(
            f"{what} must be a decimal number, not a float",
            details={what: repr(value)},
            hint="Pass the amount as a string or Decimal, e.g. '12.50'.",
        )
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise ValidationError(
            f"{what} is not a number",
            details={what: str(value)},
            hint="Give a positive decimal amount, e.g. '12.50'.",
        ) from None
    if not d.is_finite():
        raise ValidationError(
            f"{what} is not a finite number",
            details={what: str(value)},
            hint="Give a positive decimal amount, e.g. '12.50'.",
        )
    if d < 0 or (d == 0 and not allow_zero):
        raise ValidationError(
            f"{what} must be positive",
            details={what: str(d)},
            hint="Amounts move money in one direction; use a positive amount.",
        )
    if d > MAX_AMOUNT:
        raise ValidationError(
            f"{what} is too large",
            details={what: str(d), "Maximum": str(MAX_AMOUNT)},
            hint="Amounts are limited to 12 digits before the decimal point.",
        )
    if d != d.quantize(QUANTUM):
        raise ValidationError(
            f"{what} has more than 6 decimal places",
            details={what: str(d)},
            hint="Round the amount to at most 6 decimal places.",
        )
    return d.quantize(QUANTUM)
