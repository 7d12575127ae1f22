"""Small helpers every layer may use. Imports nothing from the package and nothing heavy."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up, for positive `b` (how many blocks hold `a` tokens); element-wise on
    numpy arrays too."""
    return -(-a // b)
