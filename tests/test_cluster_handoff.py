"""The prefill -> decode handoff format (issue 23 item 1): a round trip, and a typed error naming the field for a
damaged or mismatched payload. The roles that write and read it: ``test_cluster_roles.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deepinfer_jax.cluster.handoff import Handoff, HandoffError, decode_handoff, encode_handoff


def _handoff() -> Handoff:
    return Handoff("r0", [5, 6, 7], [9, 10], 3, "ab" * 32, ["cd" * 32], {"swa": np.arange(6, dtype=np.float32)},
                   {"kv": np.ones((1, 3), np.float32)})


def test_handoff_round_trip():
    h = _handoff()
    data = encode_handoff(h)
    back = decode_handoff(data, "ab" * 32, 3)
    assert back.length == 4 and back.output_ids == [9, 10] and back.digests == h.digests and back.nbytes == len(data)
    assert np.array_equal(back.slot_state["swa"], h.slot_state["swa"]) and np.array_equal(back.tail["kv"], h.tail["kv"])


@pytest.mark.parametrize("damage, field", [
    (lambda d: d[:-1], "checksum"),
    (lambda d: d[:10], "magic"),
    (lambda d: b"NOTAHOF1" + d[8:], "magic"),
    (lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:], "checksum"),
])
def test_corrupted_handoff_is_a_typed_error_naming_the_field(damage, field):
    with pytest.raises(HandoffError) as e:
        decode_handoff(damage(encode_handoff(_handoff())))
    assert e.value.field == field and str(e.value).startswith(field)


@pytest.mark.parametrize("change, check, field", [
    ({"version": 2}, {}, "version"),
    ({}, {"model": "ef" * 32}, "model"),
    ({}, {"block_size": 16}, "block_size"),
    ({"digests": []}, {}, "digests"),
    ({"tail": None}, {}, "tail"),
])
def test_mismatched_handoff_names_the_field(change, check, field):
    with pytest.raises(HandoffError) as e:
        decode_handoff(encode_handoff(dataclasses.replace(_handoff(), **change)), **check)
    assert e.value.field == field
