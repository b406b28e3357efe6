"""How the embedded cluster splits a host's GPUs between workers: disjoint groups of
slots_per_trial GPUs, and a clear error when a trial needs more GPUs than the host has."""

from __future__ import annotations

import pytest

from cluster.devices import gpu_groups


def test_groups_are_disjoint_and_sized_by_slots() -> None:
    assert gpu_groups(8, 1) == [[i] for i in range(8)]
    assert gpu_groups(8, 2, workers=3) == [[0, 1], [2, 3], [4, 5]]
    assert gpu_groups(5, 2) == [[0, 1], [2, 3]]  # GPU 4 cannot hold a 2-GPU trial


def test_more_slots_than_gpus_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"needs 3 GPUs \(resources.slots_per_trial\).* has 2"):
        gpu_groups(2, 3)
