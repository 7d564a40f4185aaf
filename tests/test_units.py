import pytest

from vramlab.units import GiB, MiB, fmt_bytes, parse_bytes


def test_binary_units():
    assert fmt_bytes(3 * GiB) == "3.00 GiB"
    assert fmt_bytes(1536 * 1024) == "1.50 MiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(-2 * MiB) == "-2.00 MiB"


def test_parse_bytes():
    assert parse_bytes("16GiB") == 16 * GiB
    assert parse_bytes("16 GB") == 16 * 10**9  # vendor (decimal) gigabytes
    assert parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("lots")
    with pytest.raises(ValueError):
        parse_bytes("-1GiB")
