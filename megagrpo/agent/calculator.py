"""Exact arithmetic on a parsed expression, without eval: the built-in `calculator` tool.

The expression is parsed with `ast` and only numbers, parentheses, unary +/- and the binary
operators + - * / // % ** are evaluated, over `fractions.Fraction` (integers of any size; `/` is
exact; a decimal literal is its exact decimal value). Sizes are bounded so that no expression
can stall the caller: every intermediate numerator and denominator stays under MAX_BITS, and a
power's size is estimated before it is computed.
"""
from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

MAX_BITS = 12_000
"""Largest numerator/denominator, in bits (~3600 decimal digits: Python refuses to print ints
of more than 4300 digits)."""
MAX_CHARS = 2_000
"""Longest expression accepted."""

_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; raises CalculatorError (or ZeroDivisionError)."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: an int literal over 4300 digits
        raise CalculatorError(f"not an arithmetic expression ({e.__class__.__name__}: "
                              f"{getattr(e, 'msg', e)})") from None
    return _eval(tree.body, expression.strip())


def _eval(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant):
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, source), _eval(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        op = _BINARY.get(type(node.op))
        if op is not None:
            return _checked(op(left, right))
    what = ast.get_source_segment(source, node) or type(node).__name__
    raise CalculatorError(f"unsupported: {what!r} (only numbers, + - * / // % ** and "
                          "parentheses)")


def _literal(node: ast.Constant, source: str) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"unsupported literal {value!r}")
    if isinstance(value, int):
        return _checked(Fraction(value))
    text = (ast.get_source_segment(source, node) or repr(value)).replace("_", "")
    return _checked(Fraction(text))  # the literal's exact decimal value, not the float's


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents are supported (the result would not "
                              "be exact)")
    e = exponent.numerator
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(base) not in (0, 1) and (size - 1) * abs(e) > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    return base ** e


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    return value


def format_number(value: Fraction) -> str:
    """An integer as digits; a fraction with a terminating decimal expansion as that exact
    decimal (7/4 -> '1.75'); any other fraction as 'p/q'."""
    num, den = value.numerator, value.denominator
    if den == 1:
        return str(num)
    twos, fives, rest = 0, 0, den
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{num}/{den}"
    places = max(twos, fives)
    digits = str(abs(num) * 10**places // den).rjust(places + 1, "0")
    sign = "-" if num < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"
