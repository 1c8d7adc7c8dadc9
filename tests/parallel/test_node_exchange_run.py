"""``parallel.expert_exchange: hierarchical`` through the trainer: 4 ranks at EP4 as 2 "nodes" of 2
(``parallel.node_size=2``) train the same losses as the flat exchange, step by step (relative
1e-6: the per-token sums are taken per node first), and config.json records the ep ranks per
node the run's groups were split into."""

from __future__ import annotations

import json

from tests.runs import ds_variant, rows

EP4 = ["parallel.expert_parallel_size=4", "eval.every=0", "model.moe.router_jitter=0.0"]


def test_hierarchical_run_matches_the_flat_one(warm_launcher, tmp_path):
    config = ds_variant(tmp_path, "zero1_fp32", train_micro_batch_size_per_gpu=4)
    warm_launcher.launch_many([(tmp_path / "flat", config, EP4),
                               (tmp_path / "nodes", config, EP4 + ["parallel.expert_exchange=hierarchical",
                                                                   "parallel.node_size=2"])],
                              nproc=4, steps=3)
    flat, nodes = rows(tmp_path / "flat"), rows(tmp_path / "nodes")
    assert len(flat) == len(nodes) == 3
    for a, b in zip(flat, nodes):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
    for name, per_node in (("flat", 0), ("nodes", 2)):     # the groups the run built
        world = json.loads((tmp_path / name / "config.json").read_text())["world"]
        assert world["ep_ranks_per_node"] == per_node, (name, world)
