"""CostModel.target_only keeps every setting of the model but the drafter weight, which it sets to 0."""

from __future__ import annotations

from strategies.cost import CostModel


def test_target_only_keeps_a_b_block_size_and_num_anchors():
    model = CostModel(a=3.0, b=0.5, c=7.0, block_size=4, num_anchors=9)
    assert model.target_only() == CostModel(a=3.0, b=0.5, c=0.0, block_size=4, num_anchors=9)


def test_target_only_of_the_default_model():
    assert CostModel().target_only() == CostModel(a=1.0, b=8e-6, c=0.0, block_size=16, num_anchors=512)
