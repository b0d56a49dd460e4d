"""rollgate.trajectory exposes each interaction's `output_versions_source`."""

from __future__ import annotations

import pytest

from rollgate.trajectory import decode_trajectory, trajectory_to_json
from tests.rollgate.test_trajectory_decode import blob


def with_source(source: str | None) -> bytes:
    interaction = {"interaction_id": "c1", "index": 0, "output_versions": b"\x09\x00\x00\x00"}
    if source is not None:
        interaction["output_versions_source"] = source
    return blob(interactions=[interaction])


@pytest.mark.parametrize("source", ["chunks", "admission", "admission_uncounted"])
def test_the_recorded_source_is_in_the_view_and_the_json(source: str) -> None:
    trajectory = decode_trajectory(with_source(source))
    assert trajectory.interactions[0].output_versions_source == source
    as_json = trajectory_to_json(trajectory)
    assert as_json["interactions"][0]["output_versions_source"] == source


def test_a_trajectory_written_before_the_field_reads_as_admission() -> None:
    trajectory = decode_trajectory(with_source(None))
    assert trajectory.interactions[0].output_versions_source == "admission"
    as_json = trajectory_to_json(trajectory)
    assert as_json["interactions"][0]["output_versions_source"] == "admission"
