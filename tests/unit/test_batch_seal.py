"""router.batch.seal: what a batch record's signatures bind, and what passes unsigned."""

from __future__ import annotations

from router.batch.seal import Seal

KEYS = {"k1": b"0123456789abcdef0123", "k2": b"fedcba9876543210fedc"}
LINE = '{"id":"x","custom_id":"req-0","response":null,"error":null}'


def test_a_result_is_bound_to_its_batch_and_index() -> None:
    seal = Seal(KEYS)
    stored = seal.wrap("batch_a", 3, LINE)
    assert stored != LINE and stored.endswith(" " + LINE)
    assert seal.unwrap("batch_a", 3, stored) == LINE
    assert seal.unwrap("batch_a", 4, stored) is None  # moved to another line
    assert seal.unwrap("batch_b", 3, stored) is None  # or another batch
    assert seal.unwrap("batch_a", 3, stored.replace("req-0", "req-9")) is None
    assert seal.unwrap("batch_a", 3, LINE) is None  # unsigned
    assert seal.unwrap("batch_a", 3, "k1:" + "0" * 64 + " " + LINE) is None


def test_any_listed_key_verifies_and_the_first_signs() -> None:
    """A rotation: records signed with the old first key still verify."""
    old = Seal({"k2": KEYS["k2"]})
    stored = old.wrap("batch_a", 0, LINE)
    assert Seal(KEYS).unwrap("batch_a", 0, stored) == LINE
    assert Seal(KEYS).of("batch_a", "doc").startswith("k1:")
    assert Seal({"k3": b"another secret 0123"}).unwrap("batch_a", 0, stored) is None


def test_parts_cannot_be_shifted_between_fields() -> None:
    seal = Seal(KEYS)
    assert seal.of("batch_a", "1x") != seal.of("batch_a1", "x")
    assert seal.holds(seal.of("a", "b"), "a", "b")
    assert not seal.holds(seal.of("a", "b"), "ab")
    assert not seal.holds(None, "a", "b") and not seal.holds("", "a", "b")
    assert not seal.holds("nokey", "a", "b") and not seal.holds("k1:", "a", "b")


def test_without_keys_nothing_is_signed_and_stored_seals_are_read_past() -> None:
    seal = Seal()
    assert not seal.on and seal.of("batch_a", "doc") == ""
    assert seal.wrap("batch_a", 0, LINE) == LINE
    assert seal.holds(None, "batch_a", "doc")
    signed = Seal(KEYS).wrap("batch_a", 0, LINE)  # written while the keys were set
    assert seal.unwrap("batch_a", 0, signed) == LINE
    assert seal.unwrap("batch_a", 0, LINE) == LINE
