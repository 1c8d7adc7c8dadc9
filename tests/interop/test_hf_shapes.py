"""``interop/hf.py``'s reference shapes (what every conversion checks a state dict against) are
the names and shapes of the state dict of a model built and initialised on the CPU, for the
dense and the MoE families (shared experts, a dense first block and a persistent buffer: the
expert bias of sigmoid routing, included)."""

from __future__ import annotations

import pytest

from interop import hf
from model.transformer import Transformer
from tests.runs import REPO
from training.config.recipe import load_recipe


@pytest.mark.parametrize("recipe", ["tiny_dense", "tiny_mixtral", "tiny_qwen3_moe",
                                    "tiny_deepseek_moe"])
def test_reference_shapes_are_the_state_dict_of_a_built_model(recipe):
    cfg = load_recipe(REPO / "recipes" / f"{recipe}.yaml", ["model.num_layers=2"]).model
    want = {name: tuple(t.shape) for name, t in Transformer(cfg, init_seed=5).state_dict().items()}
    got = hf._reference_shapes(cfg)
    assert list(got) == list(want)
    assert {name: tuple(shape) for name, shape in got.items()} == want
